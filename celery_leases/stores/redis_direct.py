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

It is used only where no one else would see the difference, and so only on
a client the store made itself from a URL (a client you pass in may be
shared with your code, another store or the renewals), and only while:

- the client is a plain ``redis.Redis`` on a plain ``ConnectionPool`` of
  TCP or Unix sockets (not TLS, no client-side cache);
- every connection option is one this module knows the meaning of (see
  :data:`KNOWN_OPTIONS`), commands are never retried, and the protocol is
  RESP2 (the store's default): a retry policy, RESP3's push notifications
  (maintenance notices) or a credential provider that re-authenticates
  connections need redis-py's own path;

(judged once, when the store opens) and, judged before every call:

- sockets and ``select.poll`` are the standard library's (gevent or eventlet
  monkey-patching, of threads or not, replaces them: their sockets wait in
  the hub);
- nobody replaced or wrapped the client's command methods or the
  connection's send and read methods (tracing instrumentation does), and
  redis-py's own metrics are off.

Any other client, and these clients whenever one of the checks made before
a call fails, send their scripts through ``execute_command`` as before,
after the kept connections went back to the pool.
"""

from __future__ import annotations

import os
import select
import socket
from typing import Any

import redis
import redis.utils
from redis.exceptions import ResponseError

from celery_leases import unpatched
from celery_leases.stores.deadline import time_left

try:  # redis-py 8 and later can record metrics of its own
    from redis.observability.recorder import is_enabled as _redis_metrics_on
except ImportError:  # pragma: no cover - older redis-py records nothing

    def _redis_metrics_on() -> bool:
        return False


__all__ = ["KNOWN_OPTIONS", "DirectCalls"]

#: the connection options (``connection_pool.connection_kwargs``) whose
#: meaning the direct path keeps: the address and the database, credentials
#: given as such, timeouts and keepalive, decoding, names, health checks, and
#: what redis-py adds to every pool of its own (maintenance notifications stay
#: off on RESP2)
KNOWN_OPTIONS = frozenset(
    {
        "host", "port", "path", "db", "username", "password", "client_name",
        "lib_name", "lib_version", "socket_timeout", "socket_connect_timeout",
        "socket_keepalive", "socket_keepalive_options", "socket_type",
        "socket_read_size", "encoding", "encoding_errors", "decode_responses",
        "health_check_interval", "retry", "retry_on_timeout", "retry_on_error",
        "protocol", "himport_registry", "maint_notifications_pool_handler",
        "maint_notifications_config", "orig_host_address", "orig_socket_timeout",
        "orig_socket_connect_timeout",
    }
)  # fmt: skip

#: the connection classes whose sockets are the standard library's
_PLAIN_CONNECTIONS = (redis.Connection, redis.UnixDomainSocketConnection)
#: what poll() answers for a connection that must not be used as it is
_STALE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | select.POLLNVAL
#: the methods a tracer wraps: the client's, then the connection's
_CLIENT_METHODS = ("execute_command", "evalsha")
_CONNECTION_METHODS = ("pack_command", "send_packed_command", "send_command", "read_response")


def _as_shipped(method: Any) -> bool:
    """Whether ``method`` is redis-py's own: not replaced (a patch is a function
    of another module) nor wrapped (a wrapper adds ``__wrapped__``)."""
    module = getattr(method, "__module__", None) or ""
    return module.startswith("redis.") and not hasattr(method, "__wrapped__")


def _never_retries(options: dict[str, Any]) -> bool:
    retry = options.get("retry")
    return retry is not None and retry.get_retries() == 0


def _plain_client(client: Any) -> bool:
    """Whether ``client`` is redis-py's plain client on a plain pool of
    standard-library sockets, with options whose meaning the direct path keeps."""
    pool = getattr(client, "connection_pool", None)
    if (
        type(client) is not redis.Redis
        or type(pool) is not redis.ConnectionPool
        or getattr(client, "connection", None) is not None  # a single-connection client
        or getattr(pool, "cache", None) is not None
        or pool.connection_class not in _PLAIN_CONNECTIONS
    ):
        return False
    options = pool.connection_kwargs
    return (
        set(options) <= KNOWN_OPTIONS
        and _never_retries(options)
        and _resp2(options.get("protocol"))
    )


def _resp2(protocol: Any) -> bool:
    """Whether connections made with ``protocol`` speak RESP2 (no push
    notifications: redis-py 8 defaults to RESP3 and its maintenance notices)."""
    if protocol is None:
        protocol = getattr(redis.utils, "DEFAULT_RESP_VERSION", 2)
    try:
        return int(protocol) == 2
    except (TypeError, ValueError):
        return False


def _stdlib_io() -> bool:
    """Whether sockets and ``select.poll`` are the standard library's now
    (gevent or eventlet patching replaces them, threads patched or not)."""
    poll = getattr(select, "poll", None)
    return (
        socket.socket.__module__ == "socket"
        and getattr(poll, "__module__", None) == "select"
        and unpatched.green_library() is None
    )


class DirectCalls:
    """Commands on a store client's connections, kept between calls.

    ``client`` is the store's own (made from a URL), or None for a store
    over a client it was given: then nothing goes this way.
    """

    __slots__ = ("_client", "_free", "_methods", "_pid", "_plain", "_pool")

    def __init__(self, client: Any = None) -> None:
        self._client = client
        self._pool: Any = getattr(client, "connection_pool", None)
        self._free: list[Any] = []
        self._pid = os.getpid()
        self._plain = client is not None and _plain_client(client)
        #: the methods last found to be redis-py's own
        self._methods: tuple[Any, ...] = ()

    @property
    def usable(self) -> bool:
        """Whether commands go out this way now (asked before every call: a
        tracer may wrap a method or turn metrics on at any time)."""
        if not self._plain or _redis_metrics_on() or not _stdlib_io():
            return False
        patched = self._client.__dict__
        if "execute_command" in patched or "evalsha" in patched:
            return False
        known = self._methods
        if known:
            connection = self._pool.connection_class
            if (
                redis.Redis.execute_command is known[0]
                and redis.Redis.evalsha is known[1]
                and connection.pack_command is known[2]
                and connection.send_packed_command is known[3]
                and connection.send_command is known[4]
                and connection.read_response is known[5]
            ):
                return True
        return self._as_shipped()

    def _as_shipped(self) -> bool:
        """Whether the client's and the connection's methods are redis-py's own
        now; remembered when they are."""
        connection = self._pool.connection_class
        methods = tuple(getattr(redis.Redis, name) for name in _CLIENT_METHODS) + tuple(
            getattr(connection, name) for name in _CONNECTION_METHODS
        )
        if not all(_as_shipped(method) for method in methods):
            return False
        self._methods = methods
        return True

    def command(self, *args: Any) -> Any:
        """Send one command (``"EVALSHA", sha, 1, key, ...``) and read its
        reply as redis-py reads it, never decoded (``RAW``).

        Inside :func:`~celery_leases.stores.deadline.bounded`, the wait for
        the reply's first bytes ends at that deadline (``TimeoutError``, and
        the connection is dropped), not only at the socket timeout.

        Raises what ``execute_command`` would: an error reply as its
        ``ResponseError`` (``NoScriptError`` among them), a lost or timed
        out connection as ``ConnectionError`` or ``TimeoutError``, a pool
        with no connection left as ``MaxConnectionsError``.
        """
        conn = self._checkout()
        try:
            conn.send_packed_command(conn.pack_command(*args))
            left = time_left()
            if left is not None and not conn.can_read(timeout=left):
                # the caller's deadline (a lease's) comes before the reply:
                # the connection is dropped below, a late reply with it
                raise redis.TimeoutError(
                    f"no reply from the store within {left:.3g} s, the time its caller had left"
                )
            reply = conn.read_response(disable_decoding=True)
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
        if not self._free:
            return
        self._forget_the_parents()
        while True:
            try:
                conn = self._free.pop()
            except IndexError:
                return
            self._pool.release(conn)


def _stale(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read, an error or a hang-up now."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return any(events & _STALE for _, events in poller.poll(0))
