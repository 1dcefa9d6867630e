"""How the SQL lease store prepares an engine: hooks, timeouts, fork safety.

Used by :mod:`celery_leases.stores.sql`.

SQLite gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` on each connection.

PostgreSQL gets a bound on every wait, so that a connection that went
silently dead (a firewall or NAT that forgot it, a failover behind a virtual
IP) cannot hang a store call:

- ``connect_timeout`` for a new connection;
- TCP keepalives and ``tcp_user_timeout``, so the kernel gives up on a peer
  that stopped acknowledging;
- ``statement_timeout`` and ``lock_timeout`` on the server (engines the store
  opens itself), so a statement waiting on a row lock ends;
- and, in the client, a limit on each wait for a reply: a proxy or a
  half-open path can acknowledge every packet and still never answer, which
  no socket option sees. Past the limit the connection is closed, so the
  pool discards it (and every connection pooled before it) and the next
  checkout opens a fresh one.

The client limit applies only inside the store's own calls (see
:func:`store_waits`), so other users of an engine passed in keep their
behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine

from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.redact import mask, secrets_of
from celery_leases.stores.deadline import reply_limit
from celery_leases.stores.sql_errors import FIX, permanent, reason
from celery_leases.stores.sql_mysql_engine import prepare_mysql_engine
from celery_leases.stores.sql_table import (
    _MYSQL,
    _POSTGRES,
    _READ_ONLY_OPTION,
    _SQLITE,
    DEFAULT_TABLE_NAME,
    MYSQL_NAMES,
    _add_missing_columns,
    _Dialect,
    _missing_columns,
    lease_table,
)

#: seconds a SQLite connection waits for another writer, unless told
SQLITE_BUSY_TIMEOUT = 10.0

#: RETURNING arrived in SQLite 3.35 (UPDATE ... FROM in 3.33)
MIN_SQLITE_VERSION = (3, 35, 0)

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


def dialect_for(engine: Engine, timeout: float | None, *, server_limits: bool = False) -> _Dialect:
    """The store's dialect for ``engine``, with the engine prepared for it.

    Args:
        timeout: the longest wait for the database (seconds): SQLite's busy
            timeout; PostgreSQL's and MySQL's connect, socket and reply
            limits (None: leave such an engine as it is).
        server_limits: also set PostgreSQL's ``statement_timeout`` and
            ``lock_timeout`` (MySQL's lock wait and statement limits, see
            :mod:`~celery_leases.stores.sql_mysql_engine`) on the engine's
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


def _prepare(engine: Engine, timeout: float | None, server_limits: bool) -> _Dialect:
    _ENGINES.add(engine)
    if engine.dialect.name == "postgresql":
        if timeout is not None:
            _prepare_postgres_engine(engine, timeout, server_limits)
        return _POSTGRES
    if engine.dialect.name in MYSQL_NAMES:
        if timeout is not None:
            prepare_mysql_engine(engine, timeout, server_limits)
        return _MYSQL
    if engine.dialect.name == "sqlite":
        _prepare_sqlite_engine(engine, SQLITE_BUSY_TIMEOUT if timeout is None else timeout)
        return _SQLITE
    raise LeaseConfigurationError(
        "the SQL lease store supports PostgreSQL, SQLite and MySQL/MariaDB, "
        f"not {engine.dialect.name!r} ({masked_url(engine)})"
    )


def create_table(engine: Engine, table_name: str = DEFAULT_TABLE_NAME) -> sa.Table:
    """Create the lease table and its index unless they exist; safe to race.

    A table made by an older release gets the columns it lacks.

    Returns:
        The table, bound to a fresh ``MetaData``.

    Raises:
        StoreUnavailable: the database could not be reached.
        LeaseConfigurationError: the database is not PostgreSQL, SQLite or MySQL.
    """
    dialect = dialect_for(engine, None)
    table = lease_table(sa.MetaData(), table_name)
    try:
        with engine.begin() as conn:
            dialect.lock_for_ddl(conn, table_name)
            try:
                table.metadata.create_all(conn, checkfirst=True)
                _add_missing_columns(conn, table)
            finally:
                dialect.unlock_for_ddl(conn, table_name)
    except (exc.DBAPIError, exc.TimeoutError) as error:
        about = f"could not create the lease table {table_name!r} in {masked_url(engine)}"
        if permanent(error):
            raise LeaseConfigurationError(f"{about}: {reason(error)}. {FIX}") from error
        raise StoreUnavailable(f"{about}: {reason(error)}") from error
    return table


def check_columns(engine: Engine, table: sa.Table) -> None:
    """Refuse a lease table made by an older release that lacks columns,
    for a store that does not create it (``create_table=False``).

    A table that is missing, or a database that cannot be reached now, is
    left to the store's calls to report.

    Raises:
        LeaseConfigurationError: the table lacks columns; the message gives
            the statements that add them.
    """
    try:
        with engine.connect() as conn:
            missing = _missing_columns(conn, table)
    except (exc.DBAPIError, exc.TimeoutError, exc.NoSuchTableError):
        return
    if missing:
        statements = "; ".join(missing)
        raise LeaseConfigurationError(
            f"the lease table {table.name!r} in {masked_url(engine)} was made by an earlier "
            f"version and lacks columns: run `celery leases init-db`, open the store with "
            f"create_table=True, or run: {statements}"
        )


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
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= 3600
    ):
        raise LeaseConfigurationError(
            f"timeout must be a number of seconds above 0 and at most 3600, got {timeout!r}"
        )
    return float(timeout)


# --- SQLite --------------------------------------------------------------------


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
    if conn.get_execution_options().get(_READ_ONLY_OPTION):
        conn.exec_driver_sql("BEGIN")
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _prepare_sqlite_engine(engine: Engine, busy_timeout: float) -> None:
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


# --- PostgreSQL: a bound on every wait ------------------------------------------


@functools.cache
def _bounded_connection_class() -> type[Any]:
    """A psycopg ``Connection`` whose waits for the server end in time."""
    import psycopg

    class ReplyTimedOut(psycopg.OperationalError):
        """No reply from the server in time; the connection was closed."""

    class BoundedConnection(psycopg.Connection[Any]):
        def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
            limit = reply_limit()
            if limit is None:
                return super().wait(gen, interval, timeout)
            if timeout is not None:
                limit = min(limit, timeout)
            started = time.monotonic()
            try:
                return super().wait(gen, interval, limit)
            except psycopg.OperationalError as error:
                if time.monotonic() - started < limit:
                    raise
                # Mid-reply, the connection's state is unknown: close it, so
                # the pool discards it instead of handing it out again.
                with contextlib.suppress(Exception):
                    self.close()
                raise ReplyTimedOut(
                    f"no reply from the database within {limit:.3g} s; the connection was closed"
                ) from error

    return BoundedConnection


def _postgres_parameters(timeout: float) -> dict[str, Any]:
    """libpq parameters that bound a connection's waits (see the module's docstring)."""
    seconds = max(1, math.ceil(timeout))
    return {
        # libpq counts whole seconds and treats less than 2 as 2
        "connect_timeout": max(2, seconds),
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": round(timeout * 1000),
    }


class _PostgresOnConnect:
    """The ``do_connect`` hook: bounded connections. A parameter or server
    setting the caller gave (in the URL or ``connect_args``) is kept."""

    def __init__(self, timeout: float, server_limits: bool) -> None:
        self.parameters = _postgres_parameters(timeout)
        ms = round(timeout * 1000)
        self.settings = {"statement_timeout": ms, "lock_timeout": ms} if server_limits else {}

    def __call__(
        self, dialect: Any, connection_record: Any, cargs: list[Any], cparams: dict[str, Any]
    ) -> Any:
        conninfo = " ".join(map(str, cargs)) + " " + str(cparams.get("dsn", ""))
        for name, value in self.parameters.items():
            if name not in cparams and f"{name}=" not in conninfo:
                cparams[name] = value
        options = str(cparams.get("options", ""))
        added = [
            f"-c {name}={value}" for name, value in self.settings.items() if name not in options
        ]
        if added and "options=" not in conninfo:
            cparams["options"] = " ".join([options, *added]).strip()
        return _bounded_connection_class().connect(*cargs, **cparams)


#: engines whose connections are bounded already
_BOUNDED: weakref.WeakSet[Engine] = weakref.WeakSet()


def _prepare_postgres_engine(engine: Engine, timeout: float, server_limits: bool) -> None:
    if engine.driver != "psycopg" or engine in _BOUNDED:
        return
    _BOUNDED.add(engine)
    event.listen(engine, "do_connect", _PostgresOnConnect(timeout, server_limits))
    # connections made before the hook would not be bounded
    engine.dispose()


# --- the engines of a store opened from a URL -------------------------------------


def open_engines(url: str, engine_options: dict[str, Any]) -> tuple[Engine, Engine | None]:
    """The engines of a store opened from ``url``: its public engine, and on
    PostgreSQL one for its calls.

    The store's calls on PostgreSQL run in autocommit, one statement each. An
    engine whose connections are made in autocommit spares them the isolation
    level set and reset around every call (about 0.1 ms of CPU per claim and
    complete); the public engine stays the one for transactions (the table's
    DDL, fenced transactions, a user's own). None when the caller chose an
    ``isolation_level``, or on another database.

    Raises:
        LeaseConfigurationError: the URL cannot be parsed, or its driver is
            not installed.
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
    backend = parsed.get_backend_name()
    # a server's pooled connections are pinged only after they sat idle
    # (ping_when_idle), unless the caller chose pool_pre_ping itself
    idle_ping = backend in ("postgresql", *MYSQL_NAMES) and "pool_pre_ping" not in engine_options
    if backend in MYSQL_NAMES:
        # Every store call ends its transaction itself (a COMMIT, or the
        # ROLLBACK of a read's connection on close); the pool's own
        # ROLLBACK on return would be one more round trip per call.
        engine_options.setdefault("pool_reset_on_return", None)
    try:
        engine = sa.create_engine(parsed, **engine_options)
        # made with the options each call would otherwise set (PostgreSQL's
        # read and write options are the same: autocommit)
        calls_options = _POSTGRES.write_options
        calls = (
            sa.create_engine(parsed, **engine_options, **calls_options)
            if backend == "postgresql" and not calls_options.keys() & engine_options.keys()
            else None
        )
    except (ImportError, exc.NoSuchModuleError) as error:
        raise LeaseConfigurationError(
            f"the driver of {mask(parsed.render_as_string(hide_password=False))} is not "
            f"installed ({error}): pip install 'celery-leases[postgres]' for PostgreSQL, "
            "'celery-leases[mysql]' for MySQL or MariaDB"
        ) from error
    if idle_ping:
        for each in (engine, calls):
            if each is not None:
                ping_when_idle(each)
    return engine, calls
