"""How the SQL lease store prepares a PostgreSQL engine (psycopg).

Used by :mod:`celery_leases.stores.sql._engine`. PostgreSQL gets a bound on
every wait, so that a connection that went silently dead (a firewall or NAT
that forgot it, a failover behind a virtual IP) cannot hang a store call:

- a new connection waits at most the store's ``timeout``, or until the
  caller's deadline if that is sooner (see :class:`_PostgresOnConnect`);
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
:func:`~celery_leases.stores.deadline.store_waits`), so other users of an
engine passed in keep their behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from celery_leases import unpatched
from celery_leases.stores.deadline import reply_limit, time_left

__all__ = ["prepare_postgres_engine"]


@functools.cache
def _bounded_connection_class() -> type[Any]:
    """A psycopg ``Connection`` whose waits for the server end in time.

    psycopg has no public API for a limit on one wait for a reply: this
    overrides ``Connection.wait`` (no underscore, but not in psycopg's
    documented API), through which every statement's reply comes, with its
    ``timeout`` (psycopg 3.3.6 and newer) ending the wait with an
    ``OperationalError``. tests/integration/test_driver_internals.py pins both.
    """
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


#: libpq's shortest ``connect_timeout``: it counts whole seconds, and less than 2 as 2
LIBPQ_SHORTEST_CONNECT = 2


def _postgres_parameters(timeout: float) -> dict[str, Any]:
    """libpq parameters that bound a connection's waits (see the module's docstring)."""
    seconds = max(1, math.ceil(timeout))
    return {
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": round(timeout * 1000),
    }


class _PostgresOnConnect:
    """The ``do_connect`` hook: bounded connections. A parameter or server
    setting the caller gave (in the URL or ``connect_args``) is kept.

    A new connection waits at most the store's ``timeout``, or until the
    deadline of the store call that opens it (the lease's remaining time)
    when that is sooner: libpq's ``connect_timeout`` is that many whole
    seconds, rounded down. libpq waits at least 2 s, so a shorter wait is
    kept by connecting on a thread of its own and giving up on it in time
    (it ends by itself within those 2 s). In the OS thread of a gevent or
    eventlet hub, which must not block, libpq's 2 s stand.
    """

    def __init__(self, timeout: float, server_limits: bool) -> None:
        self.timeout = timeout
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
        left = time_left()
        limit = self.timeout if left is None else min(self.timeout, left)
        if "connect_timeout" in cparams or "connect_timeout=" in conninfo:
            return _bounded_connection_class().connect(*cargs, **cparams)  # the caller's
        cparams["connect_timeout"] = max(LIBPQ_SHORTEST_CONNECT, math.floor(limit))
        if limit >= LIBPQ_SHORTEST_CONNECT or (
            unpatched.green_library() is not None and unpatched.in_main_os_thread()
        ):
            return _bounded_connection_class().connect(*cargs, **cparams)
        return _connect_within(limit, cargs, cparams)


def _connect_within(seconds: float, cargs: list[Any], cparams: dict[str, Any]) -> Any:
    """A bounded connection made on a thread of its own, if it comes within
    ``seconds``; one that comes later is closed.

    Raises:
        psycopg.errors.ConnectionTimeout: it did not come in time.
    """
    import psycopg

    outcome: list[Any] = []
    guard = unpatched.lock()

    def connect() -> None:
        try:
            made: Any = _bounded_connection_class().connect(*cargs, **cparams)
        except BaseException as error:  # handed to the caller
            made = error
        with guard:
            if outcome:  # the caller gave up on it
                if not isinstance(made, BaseException):
                    made.close()
                return
            outcome.append(made)

    thread = unpatched.start_thread(connect, name="celery-leases-connect")
    thread.join(seconds)
    with guard:
        if not outcome:
            outcome.append(None)
            raise psycopg.errors.ConnectionTimeout(
                f"connection timeout expired: no connection within {seconds:.3g} s"
            )
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


#: engines whose connections are bounded already
_BOUNDED: weakref.WeakSet[Engine] = weakref.WeakSet()


def prepare_postgres_engine(engine: Engine, timeout: float, server_limits: bool) -> None:
    if engine.driver != "psycopg" or engine in _BOUNDED:
        return
    _BOUNDED.add(engine)
    event.listen(engine, "do_connect", _PostgresOnConnect(timeout, server_limits))
    # connections made before the hook would not be bounded
    engine.dispose()
