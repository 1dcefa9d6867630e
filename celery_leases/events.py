"""Task events about leases, for Flower and other monitors.

Event types: ``task-lease-lost``, ``task-lease-fenced-out`` and
``task-lease-deferred``. Each carries ``job_id`` and ``generation`` (and a
``reason``). They go out only when the worker sends task events (``-E`` or
``worker_send_task_events``); a failure to send is logged, never raised.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["LEASE_DEFERRED", "LEASE_FENCED_OUT", "LEASE_LOST", "send_task_event"]

logger = logging.getLogger("celery_leases")

LEASE_LOST = "task-lease-lost"
LEASE_FENCED_OUT = "task-lease-fenced-out"
LEASE_DEFERRED = "task-lease-deferred"


def send_task_event(
    app: Any, type_: str, *, task_id: str | None, hostname: str | None, **fields: Any
) -> None:
    """Send a task event if the app sends task events.

    Takes the task id and hostname as arguments because the heartbeat thread
    cannot read ``task.request`` (it is thread-local).
    """
    if not app.conf.worker_send_task_events:
        return
    try:
        with app.events.default_dispatcher(hostname=hostname) as dispatcher:
            dispatcher.send(type_, uuid=task_id, **fields)
    except Exception:
        logger.warning("could not send the %s event for task %s", type_, task_id, exc_info=True)
