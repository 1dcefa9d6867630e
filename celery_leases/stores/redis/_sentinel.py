"""Redis Sentinel URLs for the Redis lease store, spelled as kombu spells them.

``sentinel://[user:password@]host:26379[/db];sentinel://host2:26379`` lists
the sentinels; the ``master_name`` option names the monitored master (in
Celery: ``leases_store_options = {"master_name": "mymaster"}``, as
``broker_transport_options`` does for the broker). The user, password and
database of the first URL that has them are those of the master; the
sentinels themselves take ``sentinel_kwargs`` (their own password, say).

The client asks the sentinels for the master's address on every new
connection, and a connection to a master that was demoted since (``READONLY``)
is dropped: after a failover the next command reaches the new master.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from celery_leases.errors import LeaseConfigurationError
from celery_leases.redact import mask

__all__ = ["SENTINEL_SCHEME", "SentinelUrl", "parse_sentinel_url", "sentinel_client"]

SENTINEL_SCHEME = "sentinel"
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelUrl:
    """What a ``sentinel://...;sentinel://...`` URL says."""

    sentinels: list[tuple[str, int]]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0


def _bad(url: str, why: str) -> LeaseConfigurationError:
    return LeaseConfigurationError(
        f"lease store URL {mask(url)!r}: {why}; use "
        "sentinel://host:26379;sentinel://host2:26379 with the master_name option"
    )


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The sentinels, credentials and database of ``url``.

    Raises:
        LeaseConfigurationError: a part is not a ``sentinel://`` URL, has no
            host, or has a database that is not a whole number.
    """
    sentinels: list[tuple[str, int]] = []
    username: str | None = None
    password: str | None = None
    db: int | None = None
    for part in url.split(";"):
        part = part.strip()
        if not part:
            continue
        try:
            parts = urlsplit(part)
            port = parts.port or DEFAULT_SENTINEL_PORT
        except ValueError as exc:
            raise _bad(url, f"cannot read {mask(part)!r} ({exc})") from exc
        if parts.scheme.lower() != SENTINEL_SCHEME or not parts.hostname:
            raise _bad(url, f"{mask(part)!r} is not sentinel://host:port")
        sentinels.append((parts.hostname, port))
        if parts.password is not None and password is None:
            username = unquote(parts.username) if parts.username else None
            password = unquote(parts.password)
        path = parts.path.strip("/")
        if path and db is None:
            if not path.isdigit():
                raise _bad(url, f"database {path!r} is not a whole number")
            db = int(path)
    if not sentinels:
        raise _bad(url, "no sentinel is named")
    return SentinelUrl(sentinels, username, password, db or 0)


def sentinel_client(url: str, options: dict[str, Any]) -> tuple[redis.Redis, Sentinel]:
    """A client of the master that the sentinels of ``url`` name.

    Args:
        url: ``sentinel://...`` URLs joined by ``;``.
        options: ``master_name`` (required), ``sentinel_kwargs`` and
            ``min_other_sentinels`` are taken out; the rest configure the
            connections to the master (timeouts, retry, ...).

    Returns:
        The master's client and the :class:`~redis.sentinel.Sentinel`
        (close both).

    Raises:
        LeaseConfigurationError: the URL is invalid or ``master_name`` is missing.
    """
    parsed = parse_sentinel_url(url)
    master_name = options.pop("master_name", None)
    if not isinstance(master_name, str) or not master_name:
        raise _bad(url, "the master_name option is missing")
    sentinel_kwargs = options.pop("sentinel_kwargs", None)
    min_other_sentinels = options.pop("min_other_sentinels", 0)
    # the sentinels answer quickly or not at all: the same timeouts as the master
    sentinel_options = {
        "socket_timeout": options.get("socket_timeout"),
        "socket_connect_timeout": options.get("socket_connect_timeout"),
        **(sentinel_kwargs or {}),
    }
    credentials = {"username": parsed.username, "password": parsed.password, "db": parsed.db}
    try:
        # called through Callable[..., Any]: redis-py before 8.2 leaves these
        # untyped, and 8.2's types do not take the options as keywords
        make_sentinel: Callable[..., Any] = Sentinel
        sentinel: Sentinel = make_sentinel(
            parsed.sentinels,
            min_other_sentinels=min_other_sentinels,
            sentinel_kwargs=sentinel_options,
        )
        master_for: Callable[..., Any] = sentinel.master_for
        client: redis.Redis = master_for(
            master_name, redis_class=redis.Redis, **credentials, **options
        )
    except (ValueError, TypeError) as exc:
        raise _bad(url, str(exc)) from exc
    return client, sentinel
