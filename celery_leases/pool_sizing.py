"""The Redis store's task pool, sized to the tasks of one worker process.

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
"""

from __future__ import annotations

import logging
from typing import Any

from celery_leases.runtime import forget_runtime, settings_for
from celery_leases.stores import is_redis_url

__all__ = ["DEFAULT_CONNECTIONS", "SPARE_CONNECTIONS", "size_task_pool"]

logger = logging.getLogger("celery_leases")

#: redis-py's pool size when none is given
DEFAULT_CONNECTIONS = 100
#: connections beyond one per task: store calls a task does not make itself
#: (a forced release, an operator's read in the same process)
SPARE_CONNECTIONS = 8
#: pools whose tasks all run in the worker's own process
_ONE_PROCESS_POOLS = ("thread", "gevent", "eventlet")


def size_task_pool(app: Any, pool: str, concurrency: int) -> str | None:
    """Give the Redis store of ``app`` a task pool as wide as ``concurrency``.

    Args:
        pool: the worker's pool class name or alias.
        concurrency: the worker's ``-c``.

    Returns:
        A warning when ``max_connections`` is set below the concurrency.

    Raises:
        LeaseConfigurationError: a ``leases_*`` setting is invalid.
    """
    if not any(kind in pool.lower() for kind in _ONE_PROCESS_POOLS):
        return None
    settings = settings_for(app)
    if not is_redis_url(settings.store_url):
        return None
    options = dict(settings.store_options)
    given = options.get("max_connections")
    if given is None:
        wanted = concurrency + SPARE_CONNECTIONS
        if wanted > DEFAULT_CONNECTIONS:
            app.conf.leases_store_options = {**options, "max_connections": wanted}
            forget_runtime(app)  # the store opens with the new option
            logger.info(
                "celery-leases: the Redis lease store's task pool gets max_connections=%d "
                "(one connection per task of this %s worker, and %d more)",
                wanted, pool, SPARE_CONNECTIONS,
            )  # fmt: skip
        return None
    if isinstance(given, int) and not isinstance(given, bool) and given < concurrency:
        return (
            f"leases_store_options sets max_connections={given}, below the worker's "
            f"concurrency ({concurrency}): when more tasks than that talk to the Redis "
            "lease store at once, the claims beyond it are deferred as if the store were "
            f"down. Leave max_connections out (the worker then uses {concurrency} + "
            f"{SPARE_CONNECTIONS}) or raise it."
        )
    return None
