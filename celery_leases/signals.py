"""Signals sent by leased tasks, in the style of :mod:`celery.signals`.

The sender is always the task object (``app.tasks[name]``), also for the
signals sent from the heartbeat thread, so ``connect(sender=my_task)``
works for all of them. Receivers run in the thread that sends: for
``lease_renewed`` and ``lease_lost`` that is the notifier thread (never the
one that enforces deadlines), so they must not use ``task.request`` (it is
thread-local); ``lease.task_id`` and ``lease.hostname`` name the run.
A receiver that raises is logged and does not stop the others. Each
signal remembers its receivers per sender between sends (Celery's receiver
cache, emptied by every connect and disconnect): a leased run sends two of
them, and looking the receivers up again each time is a measurable part of a
trivial task.

Every signal provides ``lease`` (a :class:`~celery_leases.lease.Lease`,
or ``None`` when there is none yet) and ``job_id``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from celery.utils.dispatch import Signal

__all__ = [
    "duplicate_deferred",
    "lease_claimed",
    "lease_completed",
    "lease_fenced_out",
    "lease_lost",
    "lease_released",
    "lease_renewed",
    "lease_skipped",
]


class _ReceiverCache(weakref.WeakKeyDictionary[Any, Any]):
    """Celery's per-sender receiver cache, for senders it can refer to weakly;
    any other sender (``None``, for ``has_listeners()``) is looked up anew."""

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return super().get(key, default)
        except TypeError:
            return default

    def __setitem__(self, key: Any, value: Any) -> None:
        with contextlib.suppress(TypeError):
            super().__setitem__(key, value)


def _signal(**options: Any) -> Signal:
    signal = Signal(use_caching=True, **options)
    signal.sender_receivers_cache = _ReceiverCache()
    return signal


#: A claim succeeded; the body is about to run.
lease_claimed = _signal(name="lease_claimed", providing_args={"lease", "job_id", "takeovers"})

#: The heartbeat or ``lease.ensure()`` renewed the lease.
lease_renewed = _signal(name="lease_renewed", providing_args={"lease", "job_id"})

#: The lease was lost (refused renewal, passed deadline, heartbeat failure,
#: worker shutdown). ``reason`` is the :class:`LeaseLost` reason.
lease_lost = _signal(name="lease_lost", providing_args={"lease", "job_id", "reason", "error"})

#: A run finished but its lease was lost or its completion refused: nothing
#: was written to the result backend.
lease_fenced_out = _signal(name="lease_fenced_out", providing_args={"lease", "job_id", "reason"})

#: The body did not run and the message was published again with a delay.
#: ``reason`` is ``"held"`` (another worker holds the lease) or
#: ``"store-unavailable"`` or ``"fenced-out"``; ``countdown`` in seconds;
#: ``deferrals`` counts deferrals of this message so far, this one included.
duplicate_deferred = _signal(
    name="duplicate_deferred",
    providing_args={"lease", "job_id", "reason", "countdown", "deferrals", "holder"},
)

#: The fenced completion was accepted.
lease_completed = _signal(name="lease_completed", providing_args={"lease", "job_id"})

#: The lease was given up without completing (failure, retry, shutdown).
lease_released = _signal(name="lease_released", providing_args={"lease", "job_id", "reason"})

#: A delivery found its job completed by the same send (a redelivery) and
#: did not run; it answers with the stored result. ``generation`` is the
#: completing run's, ``task_id`` this delivery's; ``lease`` is ``None``.
lease_skipped = _signal(
    name="lease_skipped", providing_args={"lease", "job_id", "generation", "task_id"}
)
