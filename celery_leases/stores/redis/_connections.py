"""The clients of the Redis lease store: how they are made, and the server check.

A store holds two clients of the same server (or Sentinel master, or
Cluster), each with a connection pool of its own:

- the *task client* sends claims, completions, releases and reads. Its pool
  is redis-py's, ``max_connections`` (100 by default) per server;
- the *renewal client* sends ``renew_many``, the heartbeat's one call, from a
  pool of ``renew_connections`` (:data:`RENEW_CONNECTIONS` by default).

So the heartbeat never waits for a connection that tasks hold: a threads
worker whose thousand tasks finish at once fills the task pool, and the
renewals of every lease still go out on their own connections.

Under gevent or eventlet monkey-patching the heartbeat's threads are OS
threads (:mod:`celery_leases.unpatched`), and the renewal client is made
for them: its sockets come from the unpatched socket module and its pool's
locks are OS locks, so a renewal waits in its own thread, never in the hub
that a task greenlet may be holding.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from celery_leases import unpatched
from celery_leases.errors import LeaseConfigurationError, LeaseStoreWarning
from celery_leases.redact import mask
from celery_leases.stores.redis._sentinel import SENTINEL_SCHEME, sentinel_client
from celery_leases.urls import url_scheme
from celery_leases.values import as_text, is_whole

__all__ = [
    "DEFAULT_SOCKET_TIMEOUT",
    "RENEW_CONNECTIONS",
    "RedisConfigWarning",
    "check_renew_connections",
    "client_options",
    "config_warnings",
    "open_client",
    "renewal_client",
    "renews_outside_the_hub",
]

logger = logging.getLogger("celery_leases.stores.redis")

#: Default socket timeouts (seconds) of a client made from a URL.
DEFAULT_SOCKET_TIMEOUT = 5.0

#: Connections of the renewal pool by default: the heartbeat sends at most
#: two renewal calls to a store at once (one of them may hang until its
#: socket timeout), and a caller of its own may add some.
RENEW_CONNECTIONS = 4


class RedisConfigWarning(LeaseStoreWarning):
    """The Redis server is configured in a way that can lose lease records."""


def client_options(given: dict[str, Any]) -> dict[str, Any]:
    """The options of a client made from a URL: ``given`` over the defaults.

    By default socket and connect timeouts are 5 s, commands are never
    retried (a script whose reply was lost is not sent again: a second
    complete would be refused as already completed), and the client speaks
    RESP2: the store reads nothing RESP3 adds (redis-py 8 picks RESP3 when
    not told).
    """
    return {
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
        "socket_connect_timeout": DEFAULT_SOCKET_TIMEOUT,
        "retry": Retry(NoBackoff(), 0),
        "protocol": 2,
        **given,
    }


def check_renew_connections(value: object) -> int:
    """``value`` as the size of the renewal pool.

    Raises:
        LeaseConfigurationError: it is not a whole number of at least 1.
    """
    if not is_whole(value, 1):
        raise LeaseConfigurationError(
            f"renew_connections must be a whole number of at least 1, got {value!r}"
        )
    return value


def open_client(url: str, options: dict[str, Any]) -> tuple[redis.Redis, Sentinel | None, str]:
    """The task client of ``url`` (``redis://``, ``rediss://``, ``unix://`` or
    ``sentinel://...;sentinel://...``), its sentinels, and the URL to show.

    Raises:
        LeaseConfigurationError: the URL or an option is invalid.
    """
    if url_scheme(url) == SENTINEL_SCHEME:
        client, sentinel = sentinel_client(url, options)
        return client, sentinel, mask(url)
    try:
        return redis.Redis.from_url(url, **options), None, mask(url)
    except (ValueError, TypeError) as exc:
        raise LeaseConfigurationError(
            f"cannot open the Redis lease store {mask(url)!r}: {exc}"
        ) from exc


def renewal_client(client: redis.Redis, connections: int) -> redis.Redis:
    """A client of the same server as ``client`` with a pool of its own.

    Its connections are made as ``client``'s are (class, address,
    credentials, timeouts, retry policy, decoding); behind Sentinel they
    ask the same sentinels for the master. Opening it reaches no server.
    The caller disconnects its pool (``connection_pool.disconnect()``) when
    done: closing the client leaves a pool it was given open.
    """
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    if isinstance(pool, SentinelConnectionPool):
        kwargs.pop("connection_pool", None)  # the task pool's link to the sentinels
        own: redis.ConnectionPool = SentinelConnectionPool(  # type: ignore[no-untyped-call]
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            is_master=pool.is_master,
            check_connection=pool.check_connection,
            max_connections=connections,
            **kwargs,
        )
    elif unpatched.green_library() is not None and pool.connection_class in _UNPATCHED:
        own = _UnpatchedPool(
            connection_class=_UNPATCHED[pool.connection_class],
            max_connections=connections,
            **kwargs,
        )
    else:
        own = redis.ConnectionPool(
            connection_class=pool.connection_class, max_connections=connections, **kwargs
        )
    return redis.Redis(connection_pool=own)


# No public API of redis-py sets the locks of a pool or the socket of a
# connection, so the classes below use private names of redis-py: a
# pool's locks are its ``_lock`` and ``_fork_lock``, and ``Connection.connect``
# makes its socket with ``_connect``. A redis-py that renames or adds one
# fails tests/integration/test_redis_connections.py
# (test_the_renewal_pool_under_patching_has_os_locks_and_os_sockets).


class _UnpatchedPool(redis.ConnectionPool):
    """A connection pool whose locks are OS locks (for OS threads under patching)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._os_locks()

    def reset(self) -> None:
        super().reset()
        self._os_locks()

    def _os_locks(self) -> None:
        self._lock = unpatched.rlock()
        self._fork_lock = unpatched.rlock()


class _UnpatchedTcpConnection(redis.Connection):
    """A TCP connection made with the unpatched socket module."""

    def _connect(self) -> Any:
        sockets = unpatched.socket_module()
        error: OSError = OSError(f"no address found for {self.host}:{self.port}")
        for family, kind, proto, _, address in sockets.getaddrinfo(
            self.host, self.port, self.socket_type, sockets.SOCK_STREAM
        ):
            sock = sockets.socket(family, kind, proto)
            try:
                sock.setsockopt(sockets.IPPROTO_TCP, sockets.TCP_NODELAY, 1)
                if self.socket_keepalive:
                    sock.setsockopt(sockets.SOL_SOCKET, sockets.SO_KEEPALIVE, 1)
                    for option, value in self.socket_keepalive_options.items():
                        sock.setsockopt(sockets.IPPROTO_TCP, option, value)
                sock.settimeout(self.socket_connect_timeout)
                sock.connect(address)
                sock.settimeout(self.socket_timeout)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            return sock
        raise error


class _UnpatchedUnixConnection(redis.UnixDomainSocketConnection):
    """A Unix socket connection made with the unpatched socket module."""

    def _connect(self) -> Any:
        sockets = unpatched.socket_module()
        sock = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
        try:
            sock.settimeout(self.socket_connect_timeout)
            sock.connect(self.path)
            sock.settimeout(self.socket_timeout)
        except OSError:
            sock.close()
            raise
        return sock


#: the unpatched twin of each connection class that has one (TLS has none:
#: the ssl module is patched too)
_UNPATCHED: dict[type[Any], type[Any]] = {
    redis.Connection: _UnpatchedTcpConnection,
    redis.UnixDomainSocketConnection: _UnpatchedUnixConnection,
}


def renews_outside_the_hub(client: redis.Redis) -> bool:
    """Whether ``client`` (a renewal client) waits outside the hub under patching."""
    return isinstance(getattr(client, "connection_pool", None), _UnpatchedPool)


def config_warnings(client: redis.Redis, url: str) -> bool:
    """Warn with :class:`RedisConfigWarning` when the server can lose lease records.

    Returns:
        Whether the check is done (False: the server did not answer, ask again later).
    """
    try:
        policy = _config_value(client, "maxmemory-policy")
        appendonly = _config_value(client, "appendonly")
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
        logger.debug("Redis at %s not reachable; config check deferred", url)
        return False
    except RedisError as exc:
        # managed services often disable or rename CONFIG
        logger.debug("CONFIG GET refused by Redis at %s (%s); not checked", url, exc)
        return True
    if policy is not None and policy != "noeviction":
        warnings.warn(
            f"Redis at {url} has maxmemory-policy {policy!r}: when memory runs out "
            "it may evict lease records, and then a held job can be claimed a second "
            "time or a completed job run again. Set maxmemory-policy noeviction.",
            RedisConfigWarning,
            stacklevel=4,
        )
    if appendonly is not None and appendonly != "yes":
        warnings.warn(
            f"Redis at {url} has appendonly {appendonly!r}: a restart loses lease "
            "records written since the last snapshot, and then a held job can be claimed "
            "a second time or a completed job run again. Set appendonly yes.",
            RedisConfigWarning,
            stacklevel=4,
        )
    return True


def _config_value(client: redis.Redis, name: str) -> str | None:
    reply = client.config_get(name)
    values = {as_text(k): as_text(v) for k, v in reply.items()}
    return values.get(name)
