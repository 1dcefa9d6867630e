"""Lease stores and :func:`open_store`, which picks one from a URL.

Optional backends are imported only when asked for, and a missing driver
says which extra to install.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_leases.errors import LeaseConfigurationError
from celery_leases.redact import mask, secrets_of
from celery_leases.stores.base import LeaseStore
from celery_leases.urls import url_scheme

__all__ = [
    "LeaseStore",
    "StoreOpener",
    "is_redis_url",
    "is_sql_url",
    "INIT_DB",
    "known_schemes",
    "open_store",
    "register_scheme",
    "scheme_is_known",
    "table_maker",
]

#: opens a store from its URL and the ``open_store`` options
StoreOpener = Callable[..., LeaseStore]

_REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_MYSQL_SCHEMES = ("mysql", "mysql+pymysql", "mariadb", "mariadb+pymysql")
_SQL_SCHEMES = ("postgresql", "postgresql+psycopg", "sqlite", "sqlite+pysqlite", *_MYSQL_SCHEMES)


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis lease store (one server, Sentinel or Cluster)."""
    return url_scheme(url) in (*_REDIS_SCHEMES, *_CLUSTER_SCHEMES)


def is_sql_url(url: str) -> bool:
    """Whether ``url`` names a SQL lease store (which has a table to create)."""
    return url_scheme(url) in _SQL_SCHEMES


#: schemes added by integrations (``django://`` by celery_leases.contrib.django)
_REGISTERED: dict[str, StoreOpener] = {}
#: how the table of a registered scheme's store is made, by scheme
_TABLE_MAKERS: dict[str, str] = {}
#: what makes the table of a SQL store URL
INIT_DB = "celery leases init-db"


def register_scheme(scheme: str, opener: StoreOpener, *, table_maker: str = "") -> None:
    """Let :func:`open_store` open ``scheme://`` URLs with ``opener(url, **options)``.

    For framework integrations, which live above the core: the core never
    imports them, they register here when their framework starts them.
    Registering a scheme again replaces its opener; a built-in scheme cannot
    be replaced. ``table_maker`` says how the integration makes its store's
    table (``"manage.py migrate"``), for messages; ``celery leases init-db``
    refuses such a store.

    Raises:
        LeaseConfigurationError: ``scheme`` is a built-in one or not a plain name.
    """
    builtin = {"memory", *_REDIS_SCHEMES, *_CLUSTER_SCHEMES, *_SQL_SCHEMES}
    if not isinstance(scheme, str) or not scheme.isidentifier() or scheme.lower() in builtin:
        raise LeaseConfigurationError(
            f"cannot register the lease store scheme {scheme!r}: it must be a plain name "
            f"and not one of {sorted(builtin)}"
        )
    _REGISTERED[scheme.lower()] = opener
    _TABLE_MAKERS[scheme.lower()] = table_maker


def known_schemes() -> list[str]:
    """The schemes :func:`open_store` can open now (built in and registered), sorted."""
    return sorted({"memory", *_REDIS_SCHEMES, *_CLUSTER_SCHEMES, *_SQL_SCHEMES, *_REGISTERED})


def scheme_is_known(url: str) -> bool:
    """Whether :func:`open_store` can open ``url``'s scheme now (built in or registered)."""
    return url_scheme(url) in known_schemes()


def table_maker(url: str) -> str:
    """What makes the table of ``url``'s store: :data:`INIT_DB` for a SQL
    URL, the registering integration's way for its scheme, ``""`` for a
    store without a table."""
    if is_sql_url(url):
        return INIT_DB
    return _TABLE_MAKERS.get(url_scheme(url), "")


def _missing(extra: str, exc: ImportError) -> LeaseConfigurationError:
    error = LeaseConfigurationError(
        f"this store needs a driver that is not installed ({exc.name}): "
        f"pip install 'celery-leases[{extra}]'"
    )
    error.__cause__ = exc
    return error


def _sql_extra(scheme: str) -> str:
    if scheme.startswith("postgresql"):
        return "postgres"
    if scheme in _MYSQL_SCHEMES:
        return "mysql"
    return "sqlalchemy"


def open_store(url: str, **options: Any) -> LeaseStore:
    """Open the lease store that ``url`` names.

    Args:
        url: ``redis://``, ``rediss://`` or ``unix://`` for Redis, or
            ``sentinel://host:26379;sentinel://host2:26379`` (with the
            ``master_name=`` option) for Redis behind Sentinel;
            ``redis+cluster://host:port`` for a Redis Cluster;
            ``postgresql+psycopg://``, ``mysql+pymysql://``,
            ``mariadb+pymysql://`` or ``sqlite:///path`` for SQL;
            ``memory://`` for the in-process testing store;
            ``django://alias`` with ``celery_leases.contrib.django``
            installed, or any scheme given to :func:`register_scheme`.
        **options: passed to the store's ``from_url`` (for example
            ``prefix=`` for Redis, ``table_name=`` for SQL).

    Raises:
        LeaseConfigurationError: the URL is not one of the above, or its
            driver is not installed.
    """
    if not isinstance(url, str) or "://" not in url:
        raise LeaseConfigurationError(
            f"lease store URL {mask(url) if isinstance(url, str) else url!r} "
            "is not a URL; use redis://host:6379/0, "
            "postgresql+psycopg://user@host/db, sqlite:///path/to/file.db or memory://"
        )
    scheme = url_scheme(url)
    try:
        return _open(scheme, url, options)
    except TypeError as exc:
        if "keyword argument" not in str(exc):
            raise
        # an option the store does not take (prefix= on a SQL store, say)
        raise LeaseConfigurationError(
            f"lease store {scheme}:// does not take the options {sorted(options)}: {exc}; "
            "check leases_store_options"
        ) from exc
    except (UnicodeError, ValueError) as exc:
        # a malformed host or port the driver's URL parser rejects
        raise LeaseConfigurationError(
            f"the lease store URL {mask(url)!r} cannot be used: "
            f"{mask(str(exc), secrets=secrets_of(url))}; check its host and port"
        ) from None


def _open(scheme: str, url: str, options: dict[str, Any]) -> LeaseStore:
    if scheme == "memory":
        from celery_leases.stores.memory import MemoryStore

        return MemoryStore(**options)
    if scheme in _REDIS_SCHEMES:
        try:
            from celery_leases.stores.redis import RedisStore
        except ImportError as exc:
            raise _missing("redis", exc) from exc
        return RedisStore.from_url(url, **options)
    if scheme in _CLUSTER_SCHEMES:
        try:
            from celery_leases.stores.redis import RedisClusterStore
        except ImportError as exc:
            raise _missing("redis", exc) from exc
        return RedisClusterStore.from_url(url, **options)
    if scheme in _SQL_SCHEMES:
        try:
            from celery_leases.stores.sql import SqlStore
        except ImportError as exc:
            raise _missing(_sql_extra(scheme), exc) from exc
        return SqlStore.from_url(url, **options)
    if scheme in _REGISTERED:
        return _REGISTERED[scheme](url, **options)
    if scheme == "django":
        raise LeaseConfigurationError(
            f"the lease store {mask(url)!r} needs 'celery_leases.contrib.django' in "
            "INSTALLED_APPS and Django set up (django.setup(), which the worker of a "
            "Django project does at start)"
        )
    raise LeaseConfigurationError(
        f"unknown lease store scheme {scheme!r} in {mask(url)!r}; use one of "
        "redis://, rediss://, unix://, sentinel://, redis+cluster://, "
        "postgresql+psycopg://, mysql+pymysql://, mariadb+pymysql://, sqlite:///, memory://"
        + "".join(f", {name}://" for name in sorted(_REGISTERED))
    )
