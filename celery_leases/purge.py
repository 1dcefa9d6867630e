"""A periodic purge of finished lease records, added to beat in one line.

Completed records stay in the store so that a late duplicate of a job finds
it completed and skips it; nothing deletes them unless asked. In the module
that makes the app (imported by the worker and by beat)::

    from celery_leases.purge import schedule_purge

    schedule_purge(app, every=3600, older_than=7 * 86400)

This registers the task ``celery_leases.purge`` on ``app`` and adds the beat
entry ``celery-leases-purge``. Keep ``older_than`` well above the longest
time a message can wait in the broker (retries, ETAs, visibility timeout):
a duplicate delivered after its record was purged runs the job again.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from celery_leases.errors import LeaseConfigurationError
from celery_leases.runtime import store_for
from celery_leases.stores.base import MIN_RETENTION, LeaseStore
from celery_leases.values import is_number

__all__ = ["PURGE_TASK_NAME", "purge_records", "purge_task", "schedule_purge"]

logger = logging.getLogger("celery_leases")

PURGE_TASK_NAME = "celery_leases.purge"
BEAT_ENTRY_NAME = "celery-leases-purge"


def purge_records(store: LeaseStore, older_than: float) -> int:
    """Delete finished records older than ``older_than`` seconds; return how many.

    Completed and released records are deleted; held records never are.

    Raises:
        LeaseConfigurationError: ``older_than`` is below the store's minimum.
        StoreUnavailable: the store could not be reached.
    """
    return store.purge(older_than)


def _check_seconds(name: str, value: object, minimum: float) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not is_number(value) or not value >= minimum:
        raise LeaseConfigurationError(f"{name} must be at least {minimum:g} seconds, got {value!r}")
    return float(value)


def purge_task(app: Any) -> Any:
    """The ``celery_leases.purge`` task of ``app``, registered on first call."""
    if PURGE_TASK_NAME in app.tasks:
        return app.tasks[PURGE_TASK_NAME]

    @app.task(name=PURGE_TASK_NAME, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def purge(older_than: float) -> int:
        """Delete finished lease records older than ``older_than`` seconds."""
        deleted = purge_records(store_for(app), older_than)
        logger.info("purged %d lease records older than %g s", deleted, older_than)
        return deleted

    return purge


def schedule_purge(
    app: Any,
    *,
    every: float | timedelta = 3600.0,
    older_than: float | timedelta = 7 * 86400.0,
) -> dict[str, Any]:
    """Register the purge task on ``app`` and add its beat entry.

    Args:
        every: seconds between purges (at least 60).
        older_than: age in seconds of the finished records to delete (at
            least :data:`~celery_leases.stores.base.MIN_RETENTION`).

    Returns:
        The beat entry that was added (also in ``app.conf.beat_schedule``).

    Raises:
        LeaseConfigurationError: a value is too small.
    """
    interval = _check_seconds("every", every, 60.0)
    retention = _check_seconds("older_than", older_than, MIN_RETENTION)
    purge_task(app)
    entry: dict[str, Any] = {
        "task": PURGE_TASK_NAME,
        "schedule": interval,
        "args": (retention,),
        # a purge that waited longer than one period is replaced by the next
        "options": {"expires": interval},
    }
    schedule = dict(app.conf.beat_schedule or {})
    schedule[BEAT_ENTRY_NAME] = entry
    app.conf.beat_schedule = schedule
    return entry
