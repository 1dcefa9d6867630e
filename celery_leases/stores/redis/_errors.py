"""How the Redis lease store reports a redis-py error.

An error that means the server cannot answer now is
:class:`~celery_leases.errors.StoreUnavailable`; a refusal that trying again
cannot change (credentials, rights, an unknown command) is
:class:`~celery_leases.errors.LeaseConfigurationError`. A pool whose every
connection is in use in this process is not an outage: it is
``StoreUnavailable`` too (the caller's answer is the same, try again later),
with a message of its own that says the command was never sent and which
pool to enlarge.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.exceptions import MaxConnectionsError, RedisClusterException, RedisError

from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.stores.redis._replies import permanent

__all__ = ["DriverErrors", "pool_exhausted", "raise_wrapped"]

#: What redis-py's pools say, as a ConnectionError, when every connection is
#: in use: a BlockingConnectionPool when none came free in time, and a
#: ConnectionPool before redis-py raised MaxConnectionsError for it (5.0)
_NO_CONNECTION = ("No connection available.", "Too many connections")
#: the server's reply to SELECT of a database number it does not have
NO_SUCH_DATABASE = "DB index is out of range"


def pool_exhausted(exc: BaseException) -> bool:
    """Whether ``exc`` says every connection of a client's pool was in use
    (also as redis-py 5.0's cluster client says it: it cannot connect to
    the cluster again, for "Too many connections")."""
    if isinstance(exc, MaxConnectionsError):
        return True
    if isinstance(exc, redis.exceptions.ConnectionError):
        return str(exc) in _NO_CONNECTION
    return isinstance(exc, RedisClusterException) and str(exc).endswith(f": {_NO_CONNECTION[1]}")


def raise_wrapped(
    exc: BaseException, url: str, prefix: str, operation: str, job_id: str | None
) -> None:
    """Raise the store's error for driver error ``exc``; return for any other error."""
    about = f" of job {job_id!r}" if job_id else ""
    if pool_exhausted(exc):
        # renew_many has the renewal pool; every other call the task pool
        option = "renew_connections" if operation.startswith("renew_many") else "max_connections"
        raise StoreUnavailable(
            f"every connection of this process's pool to the Redis lease store at {url} "
            f"was in use, so {operation}{about} was not sent ({type(exc).__name__}: {exc}). "
            "The server was not asked and nothing changed; this is not an outage. Raise "
            f"{option} in the store options (leases_store_options) to at least the number "
            "of calls this process makes at once (for tasks: the worker's concurrency).",
            job_id=job_id,
        ) from exc
    if isinstance(exc, RedisError):
        if str(exc) == NO_SUCH_DATABASE:
            raise LeaseConfigurationError(
                f"the Redis server of the lease store at {url} has no such database: the "
                "database number in the store URL is out of range for the server (its "
                "'databases' setting, 16 unless changed); use a number below it",
                job_id=job_id,
            ) from exc
        if permanent(exc):
            raise LeaseConfigurationError(
                f"the Redis lease store at {url} refused {operation}{about} "
                f"({type(exc).__name__}: {exc}). This is not an outage and trying again "
                "will not help: check the user and password in the store URL and that "
                "the user may run EVALSHA, SCRIPT LOAD, HGETALL, SCAN and TIME on keys "
                f"under {prefix!r}.",
                job_id=job_id,
            ) from exc
        raise _unavailable(url, operation, about, exc, job_id) from exc
    if isinstance(exc, (OSError, RedisClusterException)):
        # a cluster client error (a slot no node serves after a failover,
        # no node reachable) is not a RedisError: the cluster is unavailable
        raise _unavailable(url, operation, about, exc, job_id) from exc
    if isinstance(exc, (KeyError, ValueError, IndexError)):
        # a reply from a server that is not Redis-compatible enough
        raise StoreUnavailable(
            f"the Redis lease store at {url} returned data it cannot read during "
            f"{operation}{about} ({exc!r}). Check that the server is Redis 7 or newer.",
            job_id=job_id,
        ) from exc


def _unavailable(
    url: str, operation: str, about: str, exc: BaseException, job_id: str | None
) -> StoreUnavailable:
    return StoreUnavailable(
        f"the Redis lease store at {url} failed during {operation}{about} "
        f"({type(exc).__name__}: {exc}). Check that the server is up and reachable; "
        "the outcome of this operation is unknown to the caller.",
        job_id=job_id,
    )


class DriverErrors:
    """Driver errors of one store call wrapped as :func:`raise_wrapped` does,
    and the store's deferred configuration check after the first call that
    worked (a class: a generator-based context manager costs a measurable
    part of a fast operation)."""

    __slots__ = ("client", "job_id", "operation", "store")

    def __init__(self, store: Any, operation: str, job_id: str | None, client: redis.Redis) -> None:
        self.store = store
        self.operation = operation
        self.job_id = job_id
        self.client = client

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if exc is None:
            if self.store._config_pending:
                self.store._check_config(self.client)
            return
        store = self.store
        raise_wrapped(exc, store.url, store.prefix, self.operation, self.job_id)
