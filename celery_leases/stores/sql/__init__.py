"""The SQL lease store: PostgreSQL, MySQL/MariaDB or SQLite through SQLAlchemy Core.

One table holds one row per job (see :func:`lease_table`). Every operation
is one statement that reads the database's clock itself, so a worker's
clock is never compared with a lease. What differs between the databases
(the clock, the upsert, how a JSON batch becomes rows, how transactions
begin) lives in ``SqlDialect`` (module ``_table``) and nowhere else: the
fenced SQL targets and the Django app read it too (:func:`dialect_named`).
The package's private modules, each used only here:

- ``_store``: the store, :class:`SqlStore`;
- ``_table``: the table and what differs between the databases;
  ``_indexes``: its index, which differs too;
- ``_statements``: the statements; ``_operations``: running them
  (``_mysql_operations`` for MySQL and MariaDB, which decide under row locks);
- ``_engine``: the engine's hooks and timeouts, with each database's own
  preparation beside it: ``_postgres``, ``_mysql``, ``_sqlite``;
- ``_pool``: how long a call waits for a pooled connection;
- ``_records``: reading and purging records, and the calls a fenced write
  makes in its own transaction;
- ``_errors``: which driver errors are an outage, which a configuration.

PostgreSQL runs each statement in driver-level autocommit: an operation is
one statement, so it is its own transaction and costs one round trip. A
claim that finds the record taken decides with one more statement, which
locks the row. SQLite runs each write in
``BEGIN IMMEDIATE``: the write lock is taken before anything is read, so
many processes wait on the busy timeout instead of failing with
``database is locked``.

Every wait is bounded (``timeout``); a call whose connection died is tried
once more on a fresh connection when trying again is safe: reads, renewals
and completions (a completion whose first try was applied is judged by the
record, see :meth:`LeaseStore.complete`), never a claim or a release.
"""

from __future__ import annotations

from celery_leases.stores.sql._engine import create_table
from celery_leases.stores.sql._errors import (
    MYSQL_DEADLOCK,
    mysql_error_number,
    permanent,
    reason,
    refused_for_good,
)
from celery_leases.stores.sql._indexes import indexes_in
from celery_leases.stores.sql._operations import CLAIM_ATTEMPTS
from celery_leases.stores.sql._pool import MAX_OVERFLOW, POOL_SIZE, pool_capacity
from celery_leases.stores.sql._queued import queued_table
from celery_leases.stores.sql._sqlite import MIN_SQLITE_VERSION
from celery_leases.stores.sql._store import DEFAULT_TIMEOUT, SqlStore
from celery_leases.stores.sql._table import (
    DEFAULT_TABLE_NAME,
    IDLE_LIMITS,
    MYSQL_NAMES,
    MYSQL_NOW_MS,
    MYSQL_ROW_EXISTED,
    POSTGRES_NOW_MS,
    SQLITE_NOW_MS,
    SqlDialect,
    dialect_named,
    key_text,
    lease_table,
    lock_on_duplicate,
    record_of,
)
from celery_leases.stores.sql._waiters import waiters_table

__all__ = [
    # the store and its table
    "SqlStore",
    "create_table",
    "lease_table",
    "queued_table",
    "waiters_table",
    "indexes_in",
    "record_of",
    "DEFAULT_TABLE_NAME",
    "DEFAULT_TIMEOUT",
    "CLAIM_ATTEMPTS",
    "MIN_SQLITE_VERSION",
    # what differs between the databases, for the fenced targets and the
    # Django app: the dialect table, the clocks, MySQL's upsert that locks
    "SqlDialect",
    "dialect_named",
    "lock_on_duplicate",
    "MYSQL_NAMES",
    "MYSQL_NOW_MS",
    "MYSQL_ROW_EXISTED",
    "POSTGRES_NOW_MS",
    "SQLITE_NOW_MS",
    "IDLE_LIMITS",
    "key_text",
    # judging driver errors
    "MYSQL_DEADLOCK",
    "mysql_error_number",
    "permanent",
    "reason",
    "refused_for_good",
    # the pool's size, for a worker that sizes it
    "MAX_OVERFLOW",
    "POOL_SIZE",
    "pool_capacity",
]
