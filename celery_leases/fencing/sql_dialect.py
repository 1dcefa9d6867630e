"""What differs between the SQL databases fenced writes run on.

The dialect table is the SQL store's (:func:`celery_leases.stores.sql.dialect_named`):
its clock, its INSERT and MySQL's upsert that locks. PostgreSQL and SQLite
both have an upsert with a condition (``INSERT ... ON CONFLICT ... DO UPDATE
... WHERE``); every fenced form of :mod:`celery_leases.fencing.sql` builds on
it.

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
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql.expression import ColumnElement

from celery_leases.fencing import OnRepeat
from celery_leases.stores.sql import (
    MYSQL_NAMES,
    MYSQL_ROW_EXISTED,
    dialect_named,
    lock_on_duplicate,
)

__all__ = ["insert_for", "is_mysql", "lock_or_insert", "newer", "now_ms"]


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
    or, when that row exists, its ``columns`` as they were, now locked
    (:func:`~celery_leases.stores.sql.lock_on_duplicate`). The marker stays
    the session's ``LAST_INSERT_ID()``.
    """
    first = next(iter(key))
    statement = lock_on_duplicate(mysql.insert(table).values(dict(values)), table.c[first])
    if conn.execute(statement).lastrowid != MYSQL_ROW_EXISTED:
        return None
    locate = (
        sa.select(*columns)
        .where(*(table.c[name] == value for name, value in key.items()))
        .with_for_update()
    )
    return conn.execute(locate).one()


def insert_for(conn: Connection, table: sa.Table) -> Any:
    """The dialect's INSERT (PostgreSQL's and SQLite's have ``on_conflict_do_update``)."""
    return dialect_named(conn.dialect.name, "fenced SQL writes").insert(table)


def newer(
    stored: ColumnElement[Any], incoming: ColumnElement[Any], on_repeat: OnRepeat
) -> ColumnElement[bool]:
    """SQL for "the incoming generation may be written over the stored one"."""
    if on_repeat == "apply":
        return stored <= incoming
    return stored < incoming


def now_ms(conn: Connection) -> ColumnElement[int]:
    """The database's clock in ms, as a column expression."""
    return dialect_named(conn.dialect.name, "fenced_transaction").now_ms()
