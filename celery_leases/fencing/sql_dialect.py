"""What differs between the SQL databases fenced writes run on.

PostgreSQL and SQLite both have an upsert with a condition (``INSERT ... ON
CONFLICT ... DO UPDATE ... WHERE``) and a clock readable in a statement;
every fenced form of :mod:`celery_leases.fencing.sql` builds on these.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection
from sqlalchemy.sql.expression import ColumnElement

from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing import OnRepeat

__all__ = ["POSTGRES_NOW_MS", "SQLITE_NOW_MS"]

# The clock of the lease check, in integer milliseconds like lease_until.
# PostgreSQL: clock_timestamp() is the time of the check itself; now() would
# be the start of the transaction, possibly long before.
POSTGRES_NOW_MS = "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"
# SQLite: julianday('now') minus the Unix epoch as a Julian day, in ms.
SQLITE_NOW_MS = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"


def _insert_for(conn: Connection, table: sa.Table) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_update``."""
    name = conn.dialect.name
    if name == "postgresql":
        return pg.insert(table)
    if name == "sqlite":
        return sqlite_dialect.insert(table)
    raise LeaseConfigurationError(
        f"fenced SQL writes need PostgreSQL or SQLite (an upsert with a condition), not {name!r}"
    )


def _newer(
    stored: ColumnElement[Any], incoming: ColumnElement[Any], on_repeat: OnRepeat
) -> ColumnElement[bool]:
    """SQL for "the incoming generation may be written over the stored one"."""
    if on_repeat == "apply":
        return stored <= incoming
    return stored < incoming


def _now_ms(conn: Connection) -> ColumnElement[int]:
    if conn.dialect.name == "postgresql":
        return sa.literal_column(POSTGRES_NOW_MS, sa.BigInteger)
    if conn.dialect.name == "sqlite":
        return sa.literal_column(SQLITE_NOW_MS, sa.BigInteger)
    raise LeaseConfigurationError(
        f"fenced_transaction needs PostgreSQL or SQLite, not {conn.dialect.name!r}"
    )
