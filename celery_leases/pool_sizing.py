"""The lease store's connection pool, sized to the tasks of one worker process.

redis-py's connection pool holds 100 connections unless told otherwise, and
a call that finds every one of them in use fails at once. A threads, gevent
or eventlet worker runs all of its tasks in one process, so with more than
about a hundred of them the claims beyond the pool would fail and be
deferred as if the store were down. At worker start, before the pool runs a
task, the store's task pool gets a connection per task and
:data:`SPARE_CONNECTIONS` more, unless ``leases_store_options`` sets
``max_connections`` itself; a value below the concurrency is named in a
warning. Prefork and solo children run one task at a time and keep the
default. (The renewals have a pool of their own: ``renew_connections``.)

The SQL store's pool (SQLAlchemy's ``QueuePool``: ``pool_size`` 5 and
``max_overflow`` 10 unless told) is sized the same way (a threads worker:
gevent and eventlet workers refuse a SQL store at start): a worker whose
tasks and :data:`SPARE_CONNECTIONS` are more than the 15 gets ``pool_size``
of that many, unless ``leases_store_options`` sets
``pool_size``, ``max_overflow`` or ``poolclass`` itself; a pool below the
concurrency is named in a warning. The heartbeat's renewals share it (they
are among the spare connections). A store call waits for a connection of
the pool at most until its deadline (:mod:`celery_leases.stores.sql`).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import parse_qs, urlsplit

from celery_leases.errors import LeaseConfigurationError
from celery_leases.green_pools import green_pool
from celery_leases.runtime import forget_runtime, settings_for
from celery_leases.stores import is_redis_url, is_sql_url
from celery_leases.values import is_whole

__all__ = ["DEFAULT_CONNECTIONS", "SPARE_CONNECTIONS", "most_tasks", "size_task_pool"]

logger = logging.getLogger("celery_leases")

#: redis-py's pool size when none is given
DEFAULT_CONNECTIONS = 100
#: connections beyond one per task: store calls a task does not make itself
#: (a forced release, an operator's read in the same process)
SPARE_CONNECTIONS = 8


def most_tasks(concurrency: int, autoscale: object = None) -> int:
    """The most tasks a worker runs at once: ``-c``, or ``--autoscale``'s
    maximum (``"10,3"`` or ``(10, 3)``, as Celery's pool step reads it) when larger."""
    if isinstance(autoscale, list | tuple):
        autoscale = autoscale[0] if autoscale else None
    most = str(autoscale).partition(",")[0].strip() if autoscale else ""
    # a bad --autoscale is Celery's pool step's to report
    return max(concurrency, int(most)) if most.isdigit() else concurrency


def _in_url(url: str) -> int | str | None:
    """The ``max_connections`` a Redis URL's query gives (redis-py reads it over the options)."""
    values = parse_qs(urlsplit(url.split(";", 1)[0]).query).get("max_connections")
    if not values:
        return None
    return int(values[-1]) if values[-1].isdigit() else values[-1]


def _set_options(app: Any, options: dict[str, Any]) -> bool:
    """Set ``leases_store_options`` to ``options`` where ``app`` reads it; whether it does now.

    Celery reads a key with the app's namespace (``CELERY_LEASES_STORE_OPTIONS``)
    before the bare one, so a value set directly under that name hides the bare
    key: then it is replaced too.
    """
    app.conf.leases_store_options = options
    forget_runtime(app)  # the store opens with the new options
    if _reads(app) == options:
        return True
    namespace = getattr(app, "namespace", None)
    if not namespace:
        return False
    key = f"{namespace.rstrip('_')}_leases_store_options"
    app.conf[key.upper() if namespace.isupper() else key] = options
    forget_runtime(app)
    return _reads(app) == options


def _reads(app: Any) -> dict[str, Any]:
    return dict(settings_for(app).store_options)


def size_task_pool(app: Any, pool: str, tasks: int) -> str | None:
    """Give the Redis store of ``app`` a task pool as wide as ``tasks``.

    Args:
        pool: the worker's pool class name or alias.
        tasks: the most tasks the worker runs at once (:func:`most_tasks`).

    Returns:
        A warning when ``max_connections`` is set below ``tasks``.
    """
    if "thread" not in pool.lower() and green_pool(pool) is None:
        return None  # a task per process at a time
    try:
        settings = settings_for(app)
    except LeaseConfigurationError:
        return None  # the start check names the mistake
    if is_sql_url(settings.store_url):
        return _size_sql_pool(app, dict(settings.store_options), tasks)
    if not is_redis_url(settings.store_url):
        return None
    options = dict(settings.store_options)
    given = _in_url(settings.store_url)
    if given is None:
        given = options.get("max_connections")
    if given is None:
        wanted = tasks + SPARE_CONNECTIONS
        if wanted > DEFAULT_CONNECTIONS:
            if not _set_options(app, {**options, "max_connections": wanted}):
                return (
                    f"could not give the Redis lease store's task pool max_connections="
                    f"{wanted}: the configuration keeps reading leases_store_options from "
                    "another key. Set max_connections in leases_store_options yourself, "
                    "or the claims beyond redis-py's 100 connections are deferred as if "
                    "the store were down."
                )
            logger.info(
                "celery-leases: the Redis lease store's task pool gets max_connections=%d "
                "(one connection per task this worker runs at once, and %d more)",
                wanted, SPARE_CONNECTIONS,
            )  # fmt: skip
        return None
    if is_whole(given) and given < tasks:
        return (
            f"the lease store sets max_connections={given}, below the worker's "
            f"concurrency ({tasks}): when more tasks than that talk to the Redis "
            "lease store at once, the claims beyond it are deferred as if the store were "
            f"down. Leave max_connections out (the worker then uses {tasks} + "
            f"{SPARE_CONNECTIONS}) or raise it."
        )
    return None


#: the SQL store's pool options a user may set
_SQL_POOL_OPTIONS = ("pool_size", "max_overflow", "poolclass", "pool", "creator")


def _size_sql_pool(app: Any, options: dict[str, Any], tasks: int) -> str | None:
    """:func:`size_task_pool` for a SQL store (see the module's docstring)."""
    try:
        from celery_leases.stores.sql import MAX_OVERFLOW, POOL_SIZE, pool_capacity
    except ImportError:
        return None  # SQLAlchemy is missing: the start check says what to install

    wanted = tasks + SPARE_CONNECTIONS
    if not options.keys() & set(_SQL_POOL_OPTIONS):
        if wanted <= POOL_SIZE + MAX_OVERFLOW:
            return None
        if not _set_options(app, {**options, "pool_size": wanted}):
            return (
                f"could not give the SQL lease store's pool pool_size={wanted}: the "
                "configuration keeps reading leases_store_options from another key. Set "
                "pool_size in leases_store_options yourself, or tasks beyond SQLAlchemy's "
                f"{POOL_SIZE + MAX_OVERFLOW} connections wait for one, and are deferred "
                "when none comes before their deadline."
            )
        logger.info(
            "celery-leases: the SQL lease store's pool gets pool_size=%d "
            "(one connection per task this worker runs at once, and %d more)",
            wanted, SPARE_CONNECTIONS,
        )  # fmt: skip
        return None
    capacity = pool_capacity(options)
    if capacity is not None and capacity < tasks:
        return (
            f"the SQL lease store's pool holds {capacity} connections (pool_size + "
            f"max_overflow), below the worker's concurrency ({tasks}): when more tasks "
            "than that call the store at once, the calls beyond it wait for a connection "
            f"and are deferred when none comes in time. Leave pool_size and max_overflow "
            f"out (the worker then uses pool_size={wanted}) or raise them."
        )
    return None
