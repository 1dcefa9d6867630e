"""What differs between the SQL databases fenced writes run on.

PostgreSQL and SQLite both have an upsert with a condition (``INSERT ... ON
CONFLICT ... DO UPDATE ... WHERE``) and a clock readable in a statement;
every fenced form of :mod:`celery_leases.fencing.sql` builds on these.

MySQL and MariaDB have an upsert (``ON DUPLICATE KEY UPDATE``) without a
condition that reports whether it wrote, so there a fenced write inserts or
locks the row (:func:`lock_or_insert`), decides on what it read, and then
updates it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql.expression import ColumnElement

from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing import OnRepeat
from celery_leases.stores.sql import MYSQL_NAMES, MYSQL_NOW_MS, MYSQL_ROW_EXISTED

__all__ = ["MYSQL_NOW_MS", "POSTGRES_NOW_MS", "SQLITE_NOW_MS"]

# The clock of the lease check, in integer milliseconds like lease_until.
# PostgreSQL: clock_timestamp() is the time of the check itself; now() would
# be the start of the transaction, possibly long before.
POSTGRES_NOW_MS = "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"
# SQLite: julianday('now') minus the Unix epoch as a Julian day, in ms.
SQLITE_NOW_MS = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"


def is_mysql(conn: Connection) -> bool:
    return conn.dialect.name in MYSQL_NAMES


def lock_or_insert(
    conn: Connection,
    table: sa.Table,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    columns: Sequence[sa.Column[Any]],
) -> Row[Any] | None:
    """MySQL: insert ``values`` as the row with primary key ``key`` (None),
    or, when that row exists, its ``columns`` as they were, now locked.

    One upsert decides: ``INSERT ... ON DUPLICATE KEY UPDATE key = IF(
    LAST_INSERT_ID(marker), key, key)`` inserts, or locks the row that is
    there (exclusively: a later ``FOR UPDATE`` read never has to upgrade a
    shared lock, which would deadlock two writers) and changes nothing; the
    marker, reported back as the statement's insert id, tells which it was.
    A row count cannot: with ``CLIENT_FOUND_ROWS`` (SQLAlchemy's setting)
    both count 1. Two writers of a new row take turns on its key lock, where
    a read first would lock the gap and deadlock them. The marker stays the
    session's ``LAST_INSERT_ID()``.
    """
    first = next(iter(key))
    statement = (
        mysql.insert(table)
        .values(dict(values))
        .on_duplicate_key_update(
            {
                first: sa.func.IF(
                    sa.func.LAST_INSERT_ID(MYSQL_ROW_EXISTED), table.c[first], table.c[first]
                )
            }
        )
    )
    if conn.execute(statement).lastrowid != MYSQL_ROW_EXISTED:
        return None
    locate = (
        sa.select(*columns)
        .where(*(table.c[name] == value for name, value in key.items()))
        .with_for_update()
    )
    return conn.execute(locate).one()


def insert_for(conn: Connection, table: sa.Table) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_update``."""
    name = conn.dialect.name
    if name == "postgresql":
        return pg.insert(table)
    if name == "sqlite":
        return sqlite_dialect.insert(table)
    raise LeaseConfigurationError(
        f"fenced SQL writes need PostgreSQL, SQLite or MySQL/MariaDB, not {name!r}"
    )


def newer(
    stored: ColumnElement[Any], incoming: ColumnElement[Any], on_repeat: OnRepeat
) -> ColumnElement[bool]:
    """SQL for "the incoming generation may be written over the stored one"."""
    if on_repeat == "apply":
        return stored <= incoming
    return stored < incoming


def now_ms(conn: Connection) -> ColumnElement[int]:
    if conn.dialect.name == "postgresql":
        return sa.literal_column(POSTGRES_NOW_MS, sa.BigInteger)
    if conn.dialect.name == "sqlite":
        return sa.literal_column(SQLITE_NOW_MS, sa.BigInteger)
    if is_mysql(conn):
        return sa.literal_column(MYSQL_NOW_MS, sa.BigInteger)
    raise LeaseConfigurationError(
        f"fenced_transaction needs PostgreSQL, SQLite or MySQL/MariaDB, not {conn.dialect.name!r}"
    )
