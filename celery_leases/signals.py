"""Signals sent by leased tasks, in the style of :mod:`celery.signals`.

The sender is always the task object (``app.tasks[name]``), also for the
signals sent from the heartbeat thread, so ``connect(sender=my_task)``
works for all of them. Receivers run in the thread that sends: for
``lease_renewed`` and ``lease_lost`` that is the notifier thread (never the
one that enforces deadlines), so they must not use ``task.request`` (it is
thread-local); ``lease.task_id`` and ``lease.hostname`` name the run.
A receiver that raises is logged and does not stop the others.

Every signal provides ``lease`` (a :class:`~celery_leases.lease.Lease`,
or ``None`` when there is none yet) and ``job_id``.
"""

from __future__ import annotations

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


#: A claim succeeded; the body is about to run.
lease_claimed = Signal(name="lease_claimed", providing_args={"lease", "job_id", "takeovers"})

#: The heartbeat or ``lease.ensure()`` renewed the lease.
lease_renewed = Signal(name="lease_renewed", providing_args={"lease", "job_id"})

#: The lease was lost (refused renewal, passed deadline, heartbeat failure,
#: worker shutdown). ``reason`` is the :class:`LeaseLost` reason.
lease_lost = Signal(name="lease_lost", providing_args={"lease", "job_id", "reason", "error"})

#: A run finished but its lease was lost or its completion refused: nothing
#: was written to the result backend.
lease_fenced_out = Signal(name="lease_fenced_out", providing_args={"lease", "job_id", "reason"})

#: The body did not run and the message was published again with a delay.
#: ``reason`` is ``"held"`` (another worker holds the lease) or
#: ``"store-unavailable"`` or ``"fenced-out"``; ``countdown`` in seconds;
#: ``deferrals`` counts deferrals of this message so far, this one included.
duplicate_deferred = Signal(
    name="duplicate_deferred",
    providing_args={"lease", "job_id", "reason", "countdown", "deferrals", "holder"},
)

#: The fenced completion was accepted.
lease_completed = Signal(name="lease_completed", providing_args={"lease", "job_id"})

#: The lease was given up without completing (failure, retry, shutdown).
lease_released = Signal(name="lease_released", providing_args={"lease", "job_id", "reason"})

#: A delivery did not run and was not published again; ``lease`` is
#: ``None`` and ``task_id`` is this delivery's. ``reason`` is
#: ``"completed"`` (its job was completed by the same send, a redelivery:
#: it answers with the stored result; ``generation`` is the completing
#: run's) or ``"busy"`` (``lease_on_busy="skip"`` and another send holds
#: the job: its result is ``LeaseSkipped``; ``generation``, ``holder`` and
#: ``holder_task_id`` are the holder's).
lease_skipped = Signal(
    name="lease_skipped",
    providing_args={
        "lease",
        "job_id",
        "generation",
        "task_id",
        "reason",
        "holder",
        "holder_task_id",
    },
)
