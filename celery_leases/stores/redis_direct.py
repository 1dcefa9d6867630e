"""The Redis store's scripts sent on connections it keeps between calls.

redis-py's ``Redis.execute_command`` takes a connection out of the client's
pool for every command and puts it back after the reply: a lock, a check
that the connection has nothing to read (a non-blocking read that sets the
socket's timeout twice), observability counters, then the retry wrapper and
the reply's parsing layers. For one script that is about a third of the
client's CPU time, more than all the store's own Python around a claim.

:class:`DirectCalls` sends each script with the connection's own
``pack_command``, ``send_packed_command`` and ``read_response`` (the same
socket, parser, timeouts and error types) on a connection it keeps in a
list of its own between calls. The connections come from the client's pool,
so its ``max_connections`` still bounds them. What the pool's checkout
promises is kept:

- a connection goes back to the list only after its whole reply was read
  (an error reply included); anything else (a timeout, a lost connection,
  an interrupt such as a time limit) disconnects it, so a late reply is
  never read as another command's;
- before a connection from the list is used, one ``poll`` with no timeout
  tells whether the server closed it or left something on it, and then it
  is connected again before anything is sent: a script is never sent on a
  connection already known dead;
- a process that forked never uses its parent's connections;
- a command of the store that is not a script gives the kept connections
  back to the pool first (:meth:`DirectCalls.give_back`), so it finds one
  even in a pool of one.

It is used only where no one else would see the difference: a plain
``redis.Redis`` client whose ``execute_command`` nobody replaced or wrapped
(tracing instrumentation does), while redis-py's own metrics are off, with a plain
``ConnectionPool`` without a client-side cache, and TCP or Unix sockets of
the standard library (not TLS; not under gevent or eventlet monkey-patching,
whose sockets wait in the hub). Any other client sends its scripts through
``execute_command``, as before.
"""

from __future__ import annotations

import os
import select
import socket
from typing import Any

import redis
from redis.exceptions import ResponseError

from celery_leases import unpatched

try:  # redis-py 8 and later can record metrics of its own
    from redis.observability.recorder import is_enabled as _redis_metrics_on
except ImportError:  # pragma: no cover - older redis-py records nothing

    def _redis_metrics_on() -> bool:
        return False


__all__ = ["DirectCalls"]

#: the connection classes whose sockets are the standard library's
_PLAIN_CONNECTIONS = (redis.Connection, redis.UnixDomainSocketConnection)
#: what poll() answers for a connection that must not be used as it is
_STALE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | select.POLLNVAL
#: the last ``execute_command`` found to be redis-py's own, unwrapped
_plain_execute: Any = None


def _own_execute(execute: Any) -> bool:
    """Whether ``execute`` is redis-py's ``Redis.execute_command`` as shipped:
    not replaced (a patch names another function) nor wrapped (a wrapper
    keeps the name and adds ``__wrapped__``)."""
    global _plain_execute
    if execute is _plain_execute:
        return True
    plain = (
        getattr(execute, "__module__", None) == "redis.client"
        and getattr(execute, "__qualname__", None) == "Redis.execute_command"
        and not hasattr(execute, "__wrapped__")
    )
    if plain:
        _plain_execute = execute
    return plain


def _plain_client(client: Any) -> bool:
    """Whether ``client`` is redis-py's plain client on a plain pool of
    standard-library TCP or Unix sockets."""
    pool = getattr(client, "connection_pool", None)
    return (
        type(client) is redis.Redis
        and type(pool) is redis.ConnectionPool
        and getattr(client, "connection", None) is None  # not a single-connection client
        and getattr(pool, "cache", None) is None
        and pool.connection_class in _PLAIN_CONNECTIONS
        and unpatched.green_library() is None
    )


class DirectCalls:
    """Commands on a store client's connections, kept between calls."""

    __slots__ = ("_client", "_free", "_pid", "_plain", "_pool")

    def __init__(self, client: Any) -> None:
        self._client = client
        self._pool: Any = getattr(client, "connection_pool", None)
        self._free: list[Any] = []
        self._pid = os.getpid()
        self._plain = _plain_client(client)

    @property
    def usable(self) -> bool:
        """Whether commands go out this way now (asked before every call: a
        tracer may wrap ``execute_command`` or turn metrics on at any time)."""
        return (
            self._plain
            and _own_execute(redis.Redis.execute_command)
            and "execute_command" not in vars(self._client)
            and not _redis_metrics_on()
        )

    def command(self, *args: Any) -> Any:
        """Send one command (``"EVALSHA", sha, 1, key, ...``) and read its
        reply as redis-py reads it.

        Raises what ``execute_command`` would: an error reply as its
        ``ResponseError`` (``NoScriptError`` among them), a lost or timed
        out connection as ``ConnectionError`` or ``TimeoutError``, a pool
        with no connection left as ``MaxConnectionsError``.
        """
        conn = self._checkout()
        try:
            conn.send_packed_command(conn.pack_command(*args))
            reply = conn.read_response()
        except ResponseError:
            self._free.append(conn)  # the whole reply was read: ready for the next
            raise
        except BaseException:
            conn.disconnect()
            self._free.append(conn)  # connected again before its next use
            raise
        self._free.append(conn)
        return reply

    def _checkout(self) -> Any:
        self._forget_the_parents()
        try:
            conn = self._free.pop()
        except IndexError:
            return self._pool.get_connection()  # the pool's own checks, counted by it
        try:
            sock = getattr(conn, "_sock", None)
            if sock is None:
                conn.connect()
            elif _stale(sock):
                # closed by the server (a restart, an idle timeout) or left
                # with data: start again, as the pool would, before sending
                conn.disconnect()
                conn.connect()
        except BaseException:
            # the server is down: keep the connection (the pool counts it)
            # for the next try rather than lose it
            self._free.append(conn)
            raise
        return conn

    def _forget_the_parents(self) -> None:
        if self._pid != os.getpid():
            # a forked child: those sockets are the parent's
            self._free = []
            self._pid = os.getpid()

    def give_back(self) -> None:
        """Return the kept connections to the client's pool."""
        self._forget_the_parents()
        while True:
            try:
                conn = self._free.pop()
            except IndexError:
                return
            self._pool.release(conn)

    def close(self) -> None:
        """Forget the kept connections (closing the client's pool closes them)."""
        self._free = []


def _stale(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read, an error or a hang-up now."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return any(events & _STALE for _, events in poller.poll(0))
