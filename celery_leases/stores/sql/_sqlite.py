"""How the SQL lease store prepares a SQLite engine: WAL, a busy timeout and
``BEGIN IMMEDIATE`` on each connection.

Used by :mod:`celery_leases.stores.sql._engine`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from celery_leases.errors import LeaseConfigurationError
from celery_leases.stores.sql._table import READ_ONLY_OPTION

__all__ = [
    "MIN_SQLITE_VERSION",
    "SQLITE_BUSY_TIMEOUT",
    "check_sqlite_version",
    "prepare_sqlite_engine",
]

#: seconds a SQLite connection waits for another writer, unless told
SQLITE_BUSY_TIMEOUT = 10.0

#: RETURNING arrived in SQLite 3.35 (UPDATE ... FROM in 3.33)
MIN_SQLITE_VERSION = (3, 35, 0)


class _SqliteOnConnect:
    """The ``connect`` hook: autocommit at the driver, busy timeout, WAL."""

    def __init__(self, busy_timeout: float) -> None:
        self.busy_timeout_ms = round(busy_timeout * 1000)

    def __call__(self, dbapi_connection: Any, connection_record: Any) -> None:
        # Let SQLAlchemy emit BEGIN itself (see _sqlite_on_begin): the driver's
        # own BEGIN is deferred and is skipped before SELECT.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
            # WAL: readers never block the writer and the writer never blocks readers.
            cursor.execute("PRAGMA journal_mode = WAL")
        finally:
            cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    # A deferred transaction that reads, then writes must upgrade its lock;
    # if another process wrote in between, SQLite answers SQLITE_BUSY at once,
    # without waiting on the busy timeout. BEGIN IMMEDIATE takes the write
    # lock first (waiting on the timeout), so that cannot happen.
    if conn.get_execution_options().get(READ_ONLY_OPTION):
        conn.exec_driver_sql("BEGIN")
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def prepare_sqlite_engine(engine: Engine, busy_timeout: float) -> None:
    if event.contains(engine, "begin", _sqlite_on_begin):
        return
    if engine.driver != "pysqlite":
        raise LeaseConfigurationError(
            f"the SQLite lease store needs the standard sqlite3 driver "
            f"(sqlite:///path), not {engine.driver!r}"
        )
    if engine.url.database in (None, "", ":memory:") or "mode=memory" in str(engine.url):
        raise LeaseConfigurationError(
            "an in-memory SQLite database is private to one connection, so workers "
            "cannot share it; use a file (sqlite:///path/to/leases.db) or memory://"
        )
    check_sqlite_version(sqlite3.sqlite_version_info)
    folder = Path(str(engine.url.database)).parent
    if not folder.is_dir():
        raise LeaseConfigurationError(
            f"the folder {folder} of the SQLite lease database does not exist; create it "
            "first (every worker must open the same file)"
        )
    event.listen(engine, "connect", _SqliteOnConnect(busy_timeout))
    event.listen(engine, "begin", _sqlite_on_begin)
    # connections made before the hooks existed would lack them
    engine.dispose()


def check_sqlite_version(version: tuple[int, ...]) -> None:
    """Refuse a SQLite older than :data:`MIN_SQLITE_VERSION`."""
    if tuple(version) < MIN_SQLITE_VERSION:
        have = ".".join(map(str, version))
        need = ".".join(map(str, MIN_SQLITE_VERSION))
        raise LeaseConfigurationError(
            f"the SQLite lease store needs SQLite {need} or newer (for RETURNING); "
            f"this Python links SQLite {have}. Use a newer Python build, or PostgreSQL."
        )
