"""How the SQL lease store prepares a MySQL or MariaDB engine (PyMySQL).

Used by :mod:`celery_leases.stores.sql._engine`. Every wait is bounded, as
for PostgreSQL:

- ``connect_timeout`` for a new connection;
- inside the store's calls, a limit on each wait for a reply and on each
  write to the socket (``timeout`` plus a margin), kept below the caller's
  deadline (:func:`~celery_leases.stores.deadline.reply_limit`). A proxy or a
  half-open path can acknowledge every packet and never answer; past the
  limit PyMySQL closes the socket and SQLAlchemy discards the connection
  (and every connection pooled before it). Outside them the engine's other
  users keep their own ``read_timeout`` and ``write_timeout``;
- on engines the store opens itself, the server's own limits on each
  session: ``innodb_lock_wait_timeout`` and ``lock_wait_timeout`` (whole
  seconds), and ``max_statement_time`` (MariaDB) or ``max_execution_time``
  (MySQL, which applies it to SELECT alone).
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from celery_leases.errors import LeaseConfigurationError
from celery_leases.stores.deadline import reply_limit

__all__ = ["prepare_mysql_engine"]


@functools.cache
def _bounded_connection_class() -> type[Any]:
    """A PyMySQL ``Connection`` whose waits for the server end in time.

    PyMySQL has no public API for a limit on one read or write inside a
    call (``read_timeout`` and ``write_timeout`` are fixed at connect), so
    this overrides its private ``_read_packet`` (every reply) and
    ``_write_bytes`` (every request) to set its private ``_read_timeout`` and
    ``_write_timeout`` first, and closes with the private ``_force_close``
    (``close()`` would first send a QUIT to a server that may not answer).
    tests/integration/test_driver_internals.py pins each of them.
    """
    import pymysql
    from pymysql.connections import MysqlPacket

    class BoundedConnection(pymysql.connections.Connection):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # the limits outside the store's calls; the handshake reads already
            self._store_connect_timeout = kwargs.get("connect_timeout", 10)
            self._store_read_timeout = kwargs.get("read_timeout")
            self._store_write_timeout = kwargs.get("write_timeout")
            super().__init__(*args, **kwargs)

        def _bound(self, configured: float | None) -> tuple[float | None, float | None]:
            """(the socket timeout for the next wait, the store's limit or None)."""
            limit = reply_limit()
            if limit is None:
                return configured, None
            if limit <= 0:
                self._force_close()
                raise pymysql.err.OperationalError(
                    2013, "no time left before the caller's deadline; the connection was closed"
                )
            return (limit if configured is None else min(limit, configured)), limit

        def connect(self, sock: Any = None) -> None:
            self.connect_timeout, _ = self._bound(self._store_connect_timeout)
            super().connect(sock)

        def _read_packet(self, packet_type: Any = MysqlPacket) -> Any:
            self._read_timeout, limit = self._bound(self._store_read_timeout)
            try:
                return super()._read_packet(packet_type)
            except pymysql.err.OperationalError as error:
                if limit is None or "timed out" not in str(error):
                    raise
                # PyMySQL closed the socket: the pool discards the connection
                raise pymysql.err.OperationalError(
                    2013,
                    f"no reply from the database within {limit:.3g} s; the connection was closed",
                ) from error

        def _write_bytes(self, data: bytes) -> None:
            self._write_timeout, _ = self._bound(self._store_write_timeout)
            super()._write_bytes(data)

    return BoundedConnection


class _MysqlOnConnect:
    """The ``do_connect`` hook: bounded connections and, when asked, the
    server's limits. A parameter the caller gave is kept."""

    def __init__(self, timeout: float, server_limits: bool) -> None:
        self.timeout = timeout
        self.server_limits = server_limits

    def __call__(
        self, dialect: Any, connection_record: Any, cargs: list[Any], cparams: dict[str, Any]
    ) -> Any:
        # read_timeout and write_timeout stay the caller's: the store's own
        # calls get their limit from store_waits, other users of the engine
        # keep their behaviour
        cparams.setdefault("connect_timeout", max(1, math.ceil(self.timeout)))
        connection = _bounded_connection_class()(*cargs, **cparams)
        if self.server_limits:
            self._set_server_limits(connection, str(cparams.get("init_command") or ""))
        return connection

    def _set_server_limits(self, connection: Any, init_command: str) -> None:
        seconds = max(1, math.ceil(self.timeout))
        mariadb = "mariadb" in connection.get_server_info().lower()
        limits = {
            "innodb_lock_wait_timeout": str(seconds),
            "lock_wait_timeout": str(seconds),
        }
        if mariadb:
            limits["max_statement_time"] = f"{self.timeout:.3f}"
        else:
            limits["max_execution_time"] = str(round(self.timeout * 1000))
        chosen = [
            f"SESSION {name} = {value}"
            for name, value in limits.items()
            if name not in init_command
        ]
        if chosen:
            with connection.cursor() as cursor:
                cursor.execute("SET " + ", ".join(chosen))


#: engines whose connections are bounded already
_BOUNDED: weakref.WeakSet[Engine] = weakref.WeakSet()


def prepare_mysql_engine(engine: Engine, timeout: float, server_limits: bool) -> None:
    """Bound every wait of ``engine``'s connections (see the module's docstring).

    Raises:
        LeaseConfigurationError: the driver is not PyMySQL.
    """
    if engine.driver != "pymysql":
        raise LeaseConfigurationError(
            f"the MySQL lease store needs the PyMySQL driver (mysql+pymysql:// or "
            f"mariadb+pymysql://), not {engine.driver!r}: pip install 'celery-leases[mysql]'"
        )
    if engine in _BOUNDED:
        return
    _BOUNDED.add(engine)
    event.listen(engine, "do_connect", _MysqlOnConnect(timeout, server_limits))
    # connections made before the hook would not be bounded
    engine.dispose()
