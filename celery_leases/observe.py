"""Lease transitions become log lines and events.

:func:`connect` hooks one receiver onto each lease signal of
:mod:`celery_leases.signals`. Per transition it writes one log line on the
``celery_leases.transitions`` logger and queues one ``lease-*`` event
(see :mod:`celery_leases.events`).

Each log line reads ``lease <transition>: job=... task=... generation=...
owner=...`` (generation and owner left out where there are none, as for a
copy deferred because another worker holds the job) and carries the same
values as ``extra`` fields on the record (``lease_transition``, ``job_id``,
``task_id``, ``generation``, ``owner``, and ``reason``, ``takeovers``,
``lease_until`` ... where they apply), so a JSON or structlog formatter can
take them as fields. Renewals log at DEBUG, lost and fenced-out runs at
WARNING, everything else at INFO.

Receivers never raise and never block: the lost and renewed notices may come
from the heartbeat or a notifier thread.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from celery_leases import events, signals
from celery_leases.lease import Lease

__all__ = ["connect", "lease_fields", "send"]

logger = logging.getLogger("celery_leases.transitions")

#: what a signal's receiver cannot read from a non-task thread, for leases
#: made without their task id and hostname (a task's leases carry both)
_claims: weakref.WeakKeyDictionary[Lease, tuple[str | None, str | None]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()
_connected = False


def lease_fields(lease: Lease) -> dict[str, Any]:
    """The fields every event and log line of ``lease`` carries."""
    return {
        "job_id": lease.job_id,
        "generation": lease.generation,
        "owner": lease.owner,
        "lease_until": lease.lease_until.isoformat(),
        "renewals": getattr(lease, "renewals", 0),
    }


def _task_ids(sender: Any, lease: Lease | None) -> tuple[str | None, str | None]:
    """The task id and worker hostname of a run, from any thread."""
    task_id = getattr(lease, "task_id", None)
    hostname = getattr(lease, "hostname", None)
    if task_id is not None and hostname is not None:
        return task_id, hostname
    if lease is not None:
        with _lock:
            known = _claims.get(lease)
        if known is not None:
            return task_id or known[0], hostname or known[1]
    # only right in the task's own thread: the request is thread-local
    request = getattr(sender, "request", None)
    return (
        task_id or getattr(request, "id", None),
        hostname or getattr(request, "hostname", None),
    )


def _record(
    sender: Any,
    transition: str,
    event_type: str,
    level: int,
    lease: Lease | None,
    job_id: str,
    *,
    task_id: str | None = None,
    **extra: Any,
) -> None:
    log = logger.isEnabledFor(level)
    # nobody reads the fields: building them (and the lease's datetime) is
    # a measurable part of a trivial task's run
    if not log and not _events_enabled(sender):
        return
    found_task_id, hostname = _task_ids(sender, lease)
    task_id = task_id or found_task_id
    fields: dict[str, Any] = lease_fields(lease) if lease is not None else {"job_id": job_id}
    fields.update({k: v for k, v in extra.items() if v is not None})
    if log:
        generation = fields.get("generation")
        owner = fields.get("owner")
        # a copy deferred before any claim has no generation or owner of its
        # own: the line leaves them out rather than print None
        shown = {"generation": generation, "owner": owner, **fields}
        details = "".join(
            f" {key}={value}"
            for key, value in shown.items()
            if key != "job_id" and value is not None
        )
        logger.log(
            level,
            "lease %s: job=%s task=%s%s",
            transition, job_id, task_id, details,
            extra={
                **fields, "lease_transition": transition, "task_id": task_id,
                "worker": hostname, "generation": generation, "owner": owner,
            },
        )  # fmt: skip
    events.emit(sender.app, event_type, task_id=task_id, hostname=hostname, **fields)


def _events_enabled(sender: Any) -> bool:
    try:
        return events.task_events_enabled(sender.app)
    except Exception:
        return True  # emit() tries, and logs what went wrong


def _knows_its_run(lease: Lease) -> bool:
    """Whether ``lease`` carries its task id and hostname (a task's leases do)."""
    return lease.task_id is not None and lease.hostname is not None


def send(signal: Any, sender: Any, **named: Any) -> None:
    """``signal.send(sender=sender, **named)``."""
    signal.send(sender=sender, **named)


def _safe(receiver: Callable[..., None]) -> Callable[..., None]:
    def guarded(sender: Any = None, **kwargs: Any) -> None:
        try:
            receiver(sender, **kwargs)
        except Exception:
            logger.exception("could not record a lease transition of %r", sender)

    guarded.__name__ = receiver.__name__
    return guarded


#: the level of each signal's log line
_LEVELS: dict[str, int] = {
    "lease_claimed": logging.INFO,
    "lease_renewed": logging.DEBUG,
    "lease_completed": logging.INFO,
    "lease_released": logging.INFO,
    "lease_lost": logging.WARNING,
    "lease_fenced_out": logging.WARNING,
    "duplicate_deferred": logging.INFO,
    "lease_skipped": logging.INFO,
}


def _claimed(sender: Any, lease: Lease, job_id: str, takeovers: int = 0, **_: Any) -> None:
    if lease is not None and not _knows_its_run(lease):
        request = getattr(sender, "request", None)
        with _lock:
            _claims[lease] = (getattr(request, "id", None), getattr(request, "hostname", None))
    _record(sender, "claimed", events.LEASE_CLAIMED, _LEVELS["lease_claimed"], lease, job_id,
            takeovers=takeovers)  # fmt: skip


def _renewed(sender: Any, lease: Lease, job_id: str, **_: Any) -> None:
    _record(sender, "renewed", events.LEASE_RENEWED, _LEVELS["lease_renewed"], lease, job_id)


def _completed(sender: Any, lease: Lease, job_id: str, **_: Any) -> None:
    _record(sender, "completed", events.LEASE_COMPLETED, _LEVELS["lease_completed"], lease, job_id)


def _released(sender: Any, lease: Lease, job_id: str, reason: str = "", **_: Any) -> None:
    _record(sender, "released", events.LEASE_RELEASED, _LEVELS["lease_released"], lease, job_id,
            reason=reason)  # fmt: skip


def _lost(sender: Any, lease: Lease, job_id: str, reason: str | None = None, **_: Any) -> None:
    _record(sender, "lost", events.LEASE_LOST, _LEVELS["lease_lost"], lease, job_id, reason=reason)


def _fenced_out(sender: Any, lease: Lease, job_id: str, reason: str = "", **_: Any) -> None:
    _record(sender, "fenced-out", events.LEASE_FENCED_OUT, _LEVELS["lease_fenced_out"], lease,
            job_id, reason=reason)  # fmt: skip


def _deferred(
    sender: Any,
    job_id: str,
    lease: Lease | None = None,
    reason: str = "",
    countdown: float | None = None,
    deferrals: int | None = None,
    holder: str | None = None,
    **_: Any,
) -> None:
    _record(sender, "deferred", events.LEASE_DEFERRED, _LEVELS["duplicate_deferred"], lease, job_id,
            reason=reason, countdown=countdown, deferrals=deferrals, holder=holder)  # fmt: skip


def _skipped(
    sender: Any,
    job_id: str,
    generation: int | None = None,
    task_id: str | None = None,
    reason: str | None = None,
    holder_task_id: str | None = None,
    **_: Any,
) -> None:
    _record(sender, "skipped", events.LEASE_SKIPPED, _LEVELS["lease_skipped"], None, job_id,
            task_id=task_id, generation=generation, reason=reason,
            holder_task_id=holder_task_id or None)  # fmt: skip


_RECEIVERS: dict[str, Callable[..., None]] = {
    "lease_claimed": _claimed,
    "lease_renewed": _renewed,
    "lease_completed": _completed,
    "lease_released": _released,
    "lease_lost": _lost,
    "lease_fenced_out": _fenced_out,
    "duplicate_deferred": _deferred,
    "lease_skipped": _skipped,
}


def connect() -> None:
    """Connect the receivers to the lease signals; idempotent."""
    global _connected
    if _connected:
        return
    _connected = True
    for name, receiver in _RECEIVERS.items():
        signal = getattr(signals, name, None)
        if signal is not None:
            uid = f"celery_leases.observe.{name}"
            signal.connect(_safe(receiver), weak=False, dispatch_uid=uid)
