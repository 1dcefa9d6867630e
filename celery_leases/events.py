"""Events about leases, for Flower and other monitors.

Every lease transition of a run becomes one event (``lease-claimed``,
``lease-renewed``, ``lease-completed``, ``lease-released``, ``lease-lost``,
``lease-fenced-out``, ``lease-deferred``, ``lease-skipped``) with the task's
``uuid``, the job id and, once a claim succeeded, the generation, the owner,
``lease_until`` and the renewal count.

They form a group of their own, ``lease``, not ``task``: a monitor that
does not know them (``celery events``, a Flower without
:mod:`celery_leases.flower`) ignores them, where a ``task-*`` event of an
unknown type would replace the task's state (``STARTED`` would read
``LEASE-RENEWED``). :mod:`celery_leases.observe` sends them from the lease
signals; :mod:`celery_leases.flower` shows them in Flower as task fields.

They go out when the worker sends task events: started with ``-E``
(``--task-events``) or with ``worker_send_task_events = True``. The ``-E``
flag lives only on the worker object, which a pool child never sees, so
the ``worker_init`` signal records it here before the pool forks.

Sending never blocks the caller and never raises: events wait in a bounded
queue that one daemon thread per process publishes from. A broker that
hangs stalls only that thread; once the queue is full, events are dropped
and that is logged.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_init, worker_process_shutdown, worker_shutdown

from celery_leases.per_process import JobThread, ProcessLocalByKey

__all__ = [
    "LEASE_CLAIMED",
    "LEASE_COMPLETED",
    "LEASE_DEFERRED",
    "LEASE_FENCED_OUT",
    "LEASE_LOST",
    "LEASE_RELEASED",
    "LEASE_RENEWED",
    "LEASE_SKIPPED",
    "LEASE_UNQUEUED",
    "EVENT_TYPES",
    "emit",
    "flush",
    "stop",
    "task_events_enabled",
]

logger = logging.getLogger("celery_leases")

LEASE_CLAIMED = "lease-claimed"
LEASE_RENEWED = "lease-renewed"
LEASE_COMPLETED = "lease-completed"
LEASE_RELEASED = "lease-released"
LEASE_LOST = "lease-lost"
LEASE_FENCED_OUT = "lease-fenced-out"
LEASE_DEFERRED = "lease-deferred"
LEASE_SKIPPED = "lease-skipped"
#: a worker took a queued mark (``lease_queue_unique``) away: its message's
#: run claimed the lease, or it was revoked or skipped
LEASE_UNQUEUED = "lease-unqueued"

EVENT_TYPES = (
    LEASE_CLAIMED,
    LEASE_RENEWED,
    LEASE_COMPLETED,
    LEASE_RELEASED,
    LEASE_LOST,
    LEASE_FENCED_OUT,
    LEASE_DEFERRED,
    LEASE_SKIPPED,
    LEASE_UNQUEUED,
)

#: events waiting to be published, per process; more are dropped
QUEUE_SIZE = 1000
#: seconds a worker's shutdown waits for queued events to go out
FLUSH_TIMEOUT = 2.0
#: a publish retries this often (with short pauses) before the event is dropped
_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2, "interval_max": 0.5}

# --- does this worker send task events? ----------------------------------------

#: app -> the worker's ``task_events`` option (``-E`` or the setting)
_worker_task_events: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    # sent after WorkController.setup_defaults resolved ``-E`` against the
    # setting, and before the pool starts: prefork children inherit this
    app = getattr(sender, "app", None)
    if app is not None:
        _worker_task_events[app] = bool(getattr(sender, "task_events", False))


worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_leases.events.init")


def task_events_enabled(app: Any) -> bool:
    """Whether lease events of ``app`` are sent from this process.

    In a worker (and its pool children): whether it runs with ``-E`` or
    ``worker_send_task_events``. Elsewhere: the ``worker_send_task_events``
    setting.
    """
    recorded = _worker_task_events.get(app)
    if recorded is not None:
        return recorded
    return bool(app.conf.worker_send_task_events)


# --- the sender thread ------------------------------------------------------------


@dataclass
class _Event:
    type: str
    task_id: str | None
    hostname: str | None
    fields: dict[str, Any]


class _Sender:
    """The job thread of one app and process that publishes queued events."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.dropped = 0
        #: publishes failed in a row; a broker that is down is logged once per 100
        self.failures = 0
        self._dispatchers: dict[str | None, Any] = {}
        self._connection: Any = None
        self._thread = JobThread("celery-leases-events", maxsize=QUEUE_SIZE, on_stop=self._reset)

    def put(self, event: _Event) -> None:
        if self._thread.submit(self._send, event):
            return
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 100 == 0:
            logger.warning(
                "lease event queue is full (the broker may hang): dropped %d %s "
                "event(s) so far, last for task %s",
                self.dropped, event.type, event.task_id,
            )  # fmt: skip

    def flush(self, timeout: float) -> bool:
        return self._thread.flush(timeout)

    def stop(self, timeout: float) -> None:
        """Send what is queued, then end the thread (waits up to ``timeout``)."""
        self._thread.stop(timeout)

    def _send(self, event: _Event) -> None:
        try:
            self._publish(event)
        except Exception as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                logger.warning(
                    "could not send the %s event for task %s (%d failed in a row): %r",
                    event.type, event.task_id, self.failures, exc,
                )  # fmt: skip
            self._reset()
        else:
            if self.failures:
                logger.info("lease events are sent again after %d failed", self.failures)
            self.failures = 0

    def _publish(self, event: _Event) -> None:
        dispatcher = self._dispatchers.get(event.hostname)
        if dispatcher is None:
            if self._connection is None:
                self._connection = self.app.connection_for_write()
            dispatcher = self.app.events.Dispatcher(
                self._connection, hostname=event.hostname, buffer_while_offline=False
            )
            self._dispatchers[event.hostname] = dispatcher
        dispatcher.send(
            event.type, uuid=event.task_id, retry=True, retry_policy=_RETRY_POLICY, **event.fields
        )

    def _reset(self) -> None:
        # a broken connection may fail to close; it is dropped either way
        for dispatcher in self._dispatchers.values():
            with contextlib.suppress(Exception):
                dispatcher.close()
        self._dispatchers.clear()
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
        self._connection = None


#: one sender per app and process: a forked child has the queue but not the thread
_senders: ProcessLocalByKey[Any, _Sender] = ProcessLocalByKey(_Sender)


def emit(app: Any, type_: str, *, task_id: str | None, hostname: str | None, **fields: Any) -> None:
    """Queue a lease event if this process sends task events; never blocks or raises.

    Args:
        app: the Celery app whose broker carries the event.
        type_: one of :data:`EVENT_TYPES`.
        task_id: the Celery task id (the event's ``uuid``).
        hostname: the worker's node name, so monitors file it under that worker.
        fields: the event's fields (``job_id``, ``generation``, ...).
    """
    try:
        if not task_events_enabled(app):
            return
        _senders.get(app).put(_Event(type_, task_id, hostname, fields))
    except Exception:
        logger.warning("could not queue the %s event for task %s", type_, task_id, exc_info=True)


def flush(timeout: float = FLUSH_TIMEOUT) -> bool:
    """Wait up to ``timeout`` seconds for this process's queued events to go out.

    Returns:
        True if every queue was emptied in time.
    """
    return all(sender.flush(timeout) for sender in _senders.made())


def stop(timeout: float = FLUSH_TIMEOUT) -> None:
    """Send this process's queued events and end the sender threads.

    The next event starts a sender again (see :func:`celery_leases.stop`).
    """
    for sender in _senders.forget_all():
        sender.stop(timeout)


def _on_shutdown(**_: Any) -> None:
    if not flush():
        logger.warning("some lease events were not sent before shutdown")


worker_process_shutdown.connect(
    _on_shutdown, weak=False, dispatch_uid="celery_leases.events.process_shutdown"
)
worker_shutdown.connect(_on_shutdown, weak=False, dispatch_uid="celery_leases.events.shutdown")
