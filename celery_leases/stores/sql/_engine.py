"""How the SQL lease store prepares an engine: hooks, timeouts, fork safety.

Used by :mod:`celery_leases.stores.sql._store`. Each database's own preparation is
in a module of its own: :mod:`~celery_leases.stores.sql._sqlite` (WAL,
a busy timeout, ``BEGIN IMMEDIATE``),
:mod:`~celery_leases.stores.sql._postgres` and
:mod:`~celery_leases.stores.sql._mysql` (a bound on every wait, so a
connection that went silently dead cannot hang a store call). Here: which
one an engine gets, the table's creation, idle pings, and the engines of a
store opened from a URL.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine

from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.redact import mask, secrets_of
from celery_leases.stores.sql._errors import FIX, permanent, reason
from celery_leases.stores.sql._mysql import prepare_mysql_engine
from celery_leases.stores.sql._pool import Checkouts, pool_capacity
from celery_leases.stores.sql._postgres import prepare_postgres_engine
from celery_leases.stores.sql._queued import queued_table
from celery_leases.stores.sql._sqlite import SQLITE_BUSY_TIMEOUT, prepare_sqlite_engine
from celery_leases.stores.sql._table import (
    DEFAULT_TABLE_NAME,
    MYSQL_NAMES,
    POSTGRES,
    SQLITE,
    SqlDialect,
    dialect_named,
    lease_table,
    missing_parts,
)
from celery_leases.stores.sql._waiters import waiters_table
from celery_leases.values import is_number

#: engines of open stores; a forked child must not reuse their connections
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_connections_after_fork() -> None:
    # A Celery prefork child inherits the parent's pooled connections; two
    # processes talking over one socket (or one SQLite handle) corrupt each
    # other. The child drops them without closing them (they are the parent's).
    for engine in list(_ENGINES):
        engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_connections_after_fork)


def masked_url(engine: Engine) -> str:
    """The engine's URL with the password hidden."""
    return mask(engine.url.render_as_string(hide_password=False))


def dialect_for(
    engine: Engine, timeout: float | None, *, server_limits: bool = False
) -> SqlDialect:
    """The store's dialect for ``engine``, with the engine prepared for it.

    Args:
        timeout: the longest wait for the database (seconds): SQLite's busy
            timeout; PostgreSQL's and MySQL's connect, socket and reply
            limits (None: leave such an engine as it is).
        server_limits: also set PostgreSQL's ``statement_timeout`` and
            ``lock_timeout`` (MySQL's lock wait and statement limits, see
            :mod:`~celery_leases.stores.sql._mysql`) on the engine's
            connections (engines the store opened itself).

    Raises:
        LeaseConfigurationError: the database or driver is not supported.
    """
    # threads that open stores on one engine at once must not add its hooks
    # twice, nor add them while another thread's connect runs through them
    with _PREPARING:
        return _prepare(engine, timeout, server_limits)


#: held while an engine gets its hooks (see dialect_for)
_PREPARING = threading.Lock()


def _prepare(engine: Engine, timeout: float | None, server_limits: bool) -> SqlDialect:
    dialect = dialect_named(engine.dialect.name, f"the SQL lease store ({masked_url(engine)})")
    _ENGINES.add(engine)
    if dialect is SQLITE:
        prepare_sqlite_engine(engine, SQLITE_BUSY_TIMEOUT if timeout is None else timeout)
    elif timeout is not None:
        prepare = prepare_postgres_engine if dialect is POSTGRES else prepare_mysql_engine
        prepare(engine, timeout, server_limits)
    return dialect


def create_table(engine: Engine, table_name: str = DEFAULT_TABLE_NAME) -> sa.Table:
    """Create the lease table and its index, and the tables of the queued
    marks and of the waiters beside it (``<table_name>_queued``,
    ``<table_name>_waiters``), unless they exist; safe to race.

    Tables that exist are only looked at, without the DDL lock.

    Returns:
        The table, bound to a fresh ``MetaData``.

    Raises:
        StoreUnavailable: the database could not be reached.
        LeaseConfigurationError: the database is not PostgreSQL, SQLite or
            MySQL, or a table of that name exists that is not this
            release's lease table (:func:`check_table`).
    """
    dialect = dialect_for(engine, None)
    table = lease_table(sa.MetaData(), table_name)
    beside = [queued_table(table.metadata, table), waiters_table(table.metadata, table)]
    try:
        with engine.connect() as conn:
            missing = _missing(conn, table)
            inspector = sa.inspect(conn)
            whole = missing == [] and all(inspector.has_table(t.name) for t in beside)
        if whole:
            return table
        # Absent, or seen between another process's CREATE TABLE and its
        # CREATE INDEX: look again under the DDL lock, which that process
        # holds until its tables are whole.
        with engine.begin() as conn:
            dialect.lock_for_ddl(conn, table_name)
            try:
                missing = _missing(conn, table)
                if not missing:
                    table.metadata.create_all(conn, checkfirst=True)
            finally:
                dialect.unlock_for_ddl(conn, table_name)
    except (exc.DBAPIError, exc.TimeoutError) as error:
        about = f"could not create the lease table {table_name!r} in {masked_url(engine)}"
        if permanent(error):
            raise LeaseConfigurationError(f"{about}: {reason(error)}. {FIX}") from error
        raise StoreUnavailable(f"{about}: {reason(error)}") from error
    if missing:
        raise _not_this_release(engine, table, missing)
    return table


def _missing(conn: Connection, table: sa.Table) -> list[str] | None:
    """What ``table`` lacks of this release's lease table (``[]``: nothing),
    or ``None`` when there is no such table.

    Raises:
        sqlalchemy.exc.DBAPIError: the database could not be read.
    """
    try:
        return missing_parts(conn, table)
    except exc.NoSuchTableError:
        return None


def _not_this_release(
    engine: Engine, table: sa.Table, missing: list[str]
) -> LeaseConfigurationError:
    return LeaseConfigurationError(
        f"the table {table.name!r} in {masked_url(engine)} is not this release's lease "
        f"table: it lacks the {', '.join(missing)}. If its records can go, drop it "
        "(DROP TABLE) and run `celery leases init-db` (Django: manage.py migrate "
        "celery_leases zero, then migrate); or give the store another table_name"
    )


def check_table(engine: Engine, table: sa.Table) -> None:
    """Refuse a table that is not this release's lease table, for a store
    that does not create it (``create_table=False``).

    A table that is missing, or a database that cannot be reached now, is
    left to the store's calls to report.

    Raises:
        LeaseConfigurationError: the table lacks a column or the index; the
            message names them and says what to do.
    """
    missing = None
    with contextlib.suppress(exc.DBAPIError, exc.TimeoutError), engine.connect() as conn:
        missing = _missing(conn, table)
    if missing:
        raise _not_this_release(engine, table, missing)


#: a pooled connection idle this long (seconds) is pinged before a store
#: call uses it; one used more recently is trusted
PING_AFTER_IDLE = 1.0
_IDLE_SINCE = "celery_leases_idle_since"


def ping_when_idle(engine: Engine, idle: float = PING_AFTER_IDLE) -> None:
    """Ping a pooled connection at checkout only when it sat idle ``idle``
    seconds or more (SQLAlchemy's ``pool_pre_ping`` pings at every checkout,
    one more round trip per store call).

    A connection that went dead while idle (the server restarted, or a
    firewall dropped it) is replaced before the call, as with
    ``pool_pre_ping``. One that died within the last ``idle`` seconds is
    found by the call itself, which is judged as any lost connection:
    retried on a fresh connection where that is safe, else
    ``StoreUnavailable`` (the task waits), and SQLAlchemy replaces the
    pool's connections for the next call.
    """

    def stamp(dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.get(_IDLE_SINCE)
        if since is not None and time.monotonic() - since < idle:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as error:
            if engine.dialect.is_disconnect(error, dbapi_connection, None):
                raise exc.DisconnectionError(str(error)) from error
            raise
        if not alive:
            raise exc.DisconnectionError("the ping got no answer")

    event.listen(engine, "connect", stamp)
    event.listen(engine, "checkin", stamp)
    event.listen(engine, "checkout", checkout)


def check_timeout(timeout: object) -> float:
    if not is_number(timeout) or not 0 < timeout <= 3600:
        raise LeaseConfigurationError(
            f"timeout must be a number of seconds above 0 and at most 3600, got {timeout!r}"
        )
    return float(timeout)


# --- the engines of a store opened from a URL -------------------------------------


def store_url(url: str) -> sa.URL:
    """``url`` parsed, with the store's drivers: psycopg for ``postgresql://``,
    PyMySQL for ``mysql://`` and ``mariadb://``.

    Raises:
        LeaseConfigurationError: the URL cannot be parsed.
    """
    try:
        parsed = sa.make_url(url)
    except (exc.ArgumentError, ValueError) as error:
        raise LeaseConfigurationError(
            f"cannot parse the SQL URL {mask(url)!r}: {mask(str(error), secrets=secrets_of(url))}"
        ) from None  # the parser's error quotes the URL, password and all
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername in MYSQL_NAMES:
        parsed = parsed.set(drivername=f"{parsed.drivername}+pymysql")
    return parsed


def open_engine(
    parsed: sa.URL, engine_options: dict[str, Any], timeout: float
) -> tuple[Engine, Checkouts | None]:
    """The engine of a store opened from ``parsed`` (:func:`store_url`), and
    the slots its calls take (None when its pool has no limit).

    Its pool waits at most ``timeout`` for a connection unless
    ``pool_timeout`` is given (:mod:`~celery_leases.stores.sql._pool`).

    Raises:
        LeaseConfigurationError: the URL's driver is not installed.
    """
    backend = parsed.get_backend_name()
    # a server's pooled connections are pinged only after they sat idle
    # (ping_when_idle), unless the caller chose pool_pre_ping itself
    idle_ping = backend in ("postgresql", *MYSQL_NAMES) and "pool_pre_ping" not in engine_options
    if backend in MYSQL_NAMES:
        # Every store call ends its transaction itself (a COMMIT, or the
        # ROLLBACK of a read's connection on close); the pool's own
        # ROLLBACK on return would be one more round trip per call.
        engine_options.setdefault("pool_reset_on_return", None)
    if backend in ("postgresql", *MYSQL_NAMES) and pool_capacity(engine_options) is not None:
        # the checkouts of the engine's other users (see sql_pool)
        engine_options.setdefault("pool_timeout", timeout)
    try:
        engine = sa.create_engine(parsed, **engine_options)
    except (ImportError, exc.NoSuchModuleError) as error:
        raise LeaseConfigurationError(
            f"the driver of {mask(parsed.render_as_string(hide_password=False))} is not "
            f"installed ({error}): pip install 'celery-leases[postgres]' for PostgreSQL, "
            "'celery-leases[mysql]' for MySQL or MariaDB"
        ) from error
    if idle_ping:
        ping_when_idle(engine)
    width = pool_capacity(engine_options) if isinstance(engine.pool, sa.QueuePool) else None
    return engine, None if width is None else Checkouts(width, timeout)
