"""Fenced writes to SQL tables (PostgreSQL, SQLite, MySQL/MariaDB; SQLAlchemy Core).

Three forms, from the most general to the strongest:

- **Fence table**: :func:`fence_table` keeps one row per resource with the
  highest generation accepted. :func:`fenced_execute` moves that fence
  forward with one conditional upsert and runs your statement in the same
  transaction, so both commit or neither does.
- **Fence column**: your own table has a generation column;
  :func:`fenced_update` and :func:`fenced_upsert` write a row only if its
  column is older than the token, in one statement.
- **Lease check in the same transaction**: when the lease store is an
  ``SqlStore`` in the same database, :func:`fenced_transaction` locks the
  lease record before your writes; a newer claim cannot be granted until
  your transaction ends, and a stale holder's transaction writes nothing.

Errors of your own database (a failed statement, a lost connection) pass
through unchanged: the connection and its transaction are yours.
"""

from __future__ import annotations

from celery_leases.fencing.sql_column import DEFAULT_FENCE_COLUMN, fenced_update, fenced_upsert
from celery_leases.fencing.sql_table import (
    DEFAULT_FENCE_TABLE,
    SqlFences,
    advance_fence,
    create_fence_table,
    fence_table,
    fenced_execute,
)
from celery_leases.fencing.sql_transaction import SqlLeaseStore, fenced_transaction
from celery_leases.stores.sql import MYSQL_NOW_MS, POSTGRES_NOW_MS, SQLITE_NOW_MS

__all__ = [
    "DEFAULT_FENCE_COLUMN",
    "DEFAULT_FENCE_TABLE",
    "MYSQL_NOW_MS",
    "POSTGRES_NOW_MS",
    "SQLITE_NOW_MS",
    "SqlFences",
    "SqlLeaseStore",
    "advance_fence",
    "create_fence_table",
    "fence_table",
    "fenced_execute",
    "fenced_transaction",
    "fenced_update",
    "fenced_upsert",
]
