"""At most one queued job per key: the send side of ``lease_queue_unique``.

A task with ``lease_queue_unique`` (and a ``lease_key``) places a queued
mark in the lease store before it publishes (:meth:`LeaseStore.mark_queued`,
atomic): of the senders of one key, the one that places the mark publishes,
and every other gets the queued job's ``AsyncResult`` and publishes
nothing; that result's ``lease_coalesced`` attribute is ``True``. The run
that claims the key's lease takes the mark away (right after the claim), so
the next send publishes again; a revoked or expired message takes it away
when a worker discards it, and a call skipped under ``lease_on_busy="skip"``
when it is answered; each time the worker sends a ``lease-unqueued``
event (with task events on) that names the job and why, which Flower shows
as the task's ``lease_queued``. A mark that nobody takes away (a lost message, a
sender that died between the mark and the publish) runs out by itself:
until a message is published its mark lasts :data:`PUBLISH_WINDOW`, then the
task's bound.

Timeline of two senders and a worker::

    sender A                  store                 sender B          worker
    mark(k, a, 60 s) ----->   mark k: a
    publish a
    extend(k, a, bound) -->   mark k: a, longer (none if gone)
                              <-----------------  mark(k, b, 60 s): a
                                                  AsyncResult(a), coalesced
                              <-----------------------------------  claim k (a)
                              <-----------------------------------  unmark(k, a)
    mark(k, c, 60 s) ----->   mark k: c (publishes c)

What publishes without a mark: a send that names its task id (a retry,
``replace()``, the library's own deferred copies, a frozen signature such
as a step of a chain or a group), an eager call, and a producer that never
imported celery_leases; for them only the lease decides, when they run.
A store that cannot be reached at send time does not stop the send: it is
published without the check, and a warning says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, tzinfo
from typing import Any, TypeVar

from celery.signals import task_revoked
from celery.utils import uuid

from celery_leases import events
from celery_leases.errors import LeaseConfigurationError, LeaseError
from celery_leases.lease import Lease
from celery_leases.runtime import store_for
from celery_leases.settings import check_queue_unique
from celery_leases.signals import lease_claimed, lease_skipped
from celery_leases.stores.checks import MAX_TTL
from celery_leases.values import is_number

__all__ = [
    "COALESCED_ATTRIBUTE",
    "PUBLISH_WINDOW",
    "QUEUED_HEADER",
    "check_queue_unique_key",
    "queued_for",
    "send_unique",
]

logger = logging.getLogger("celery_leases")

T = TypeVar("T")

#: message header of a send that placed a queued mark: the mark's key
QUEUED_HEADER = "leases_queued"

#: seconds a mark lasts until its message is published (then it is marked
#: again for its full time): what a sender that dies in between blocks
PUBLISH_WINDOW = 60.0

#: attribute of the ``AsyncResult`` a send returns: ``True`` when the send
#: published nothing and the result is the queued job's
COALESCED_ATTRIBUTE = "lease_coalesced"


def queued_for(task: Any) -> float | None:
    """How long ``task``'s queued marks last at most (seconds); ``None``: off.

    Raises:
        LeaseConfigurationError: see :func:`check_queue_unique_key`.
    """
    return check_queue_unique_key(task.name, task.lease_queue_unique, type(task).lease_key)


def check_queue_unique_key(name: str, queue_unique: object, lease_key: object) -> float | None:
    """Check the ``lease_queue_unique`` of the task ``name`` with its ``lease_key``.

    Returns:
        How long its queued marks last at most (seconds); ``None``: off.

    Raises:
        LeaseConfigurationError: the option is invalid, or the task has no
            usable key: no ``lease_key`` (each send would be a key of its
            own), an empty one, or one that is neither a format string
            nor a callable (no send could build a key).
    """
    bound = check_queue_unique(queue_unique, f"{name}.lease_queue_unique")
    if bound is None:
        return None
    if lease_key is None:
        raise LeaseConfigurationError(
            f"task {name!r} sets lease_queue_unique but no lease_key: under the "
            "default key every send is a job of its own; set lease_key to what makes "
            "two calls the same job (for example lease_key='report-{user_id}')"
        )
    if lease_key == "" or not (isinstance(lease_key, str) or callable(lease_key)):
        raise LeaseConfigurationError(
            f"task {name!r} sets lease_queue_unique with lease_key={lease_key!r}, from which "
            "no send can build a key; set lease_key to a non-empty format string or a "
            "callable (for example lease_key='report-{user_id}')"
        )
    return bound


def send_unique(
    task: Any,
    send: Callable[..., Any],
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> Any:
    """Publish ``task`` through ``send`` (Celery's ``apply_async``), unless
    its key has a job queued: then that job's ``AsyncResult``.

    Raises:
        LeaseConfigurationError: the option or the key is invalid.
        Whatever ``send`` raises; the mark this send placed is taken away
        first.
    """
    bound = queued_for(task)
    if bound is None or options.get("task_id") or task.app.conf.task_always_eager:
        return _marked(send(args, kwargs, **options), coalesced=False)
    options.pop("task_id", None)
    job_id = task.lease_job_id(None, tuple(args or ()), dict(kwargs or {}))
    task_id = uuid()
    ttl = min(bound + _wait_before_run(options, task.app.timezone), MAX_TTL)
    try:
        store = store_for(task.app)
        # short until the message is out: a sender that dies before its
        # publish blocks the key for PUBLISH_WINDOW at most
        mark = store.mark_queued(job_id, task_id, min(ttl, PUBLISH_WINDOW))
    except LeaseConfigurationError:
        raise
    except LeaseError as exc:
        # the call must not be lost: publish it, unchecked
        logger.warning(
            "task %s: could not check whether job %r is queued already (%s); "
            "published without the check",
            task.name, job_id, exc,
        )  # fmt: skip
        return _marked(send(args, kwargs, task_id=task_id, **options), coalesced=False)
    if mark.task_id != task_id:
        logger.debug("task %s: job %r is queued as %s already", task.name, job_id, mark.task_id)
        return _marked(task.AsyncResult(mark.task_id), coalesced=True)
    headers = {**(options.pop("headers", None) or {}), QUEUED_HEADER: job_id}
    try:
        result = send(args, kwargs, task_id=task_id, headers=headers, **options)
    except BaseException:
        _take_back(store, job_id, task_id, "its publish failed")
        raise
    if ttl > PUBLISH_WINDOW:
        _mark_longer(store, job_id, task_id, ttl)
    return _marked(result, coalesced=False)


def _mark_longer(store: Any, job_id: str, task_id: str, ttl: float) -> None:
    """Make the published message's mark last ``ttl`` seconds from now.

    Only a mark still there is extended: the run may have claimed the job
    and taken the mark away since the publish, and a mark placed anew would
    send every call for the whole bound to a job that has started.
    """
    mark = _store_call(
        lambda: store.extend_queued(job_id, task_id, ttl),
        "could not extend the queued mark of job %r (task %s) after its publish; it runs "
        "out within %.0f s, and a send after that queues another job",
        job_id, task_id, PUBLISH_WINDOW,
    )  # fmt: skip
    if mark is not None and mark.task_id != task_id:
        logger.warning(
            "the queued mark of job %r (task %s) ran out before its publish ended; "
            "task %s of the same key is queued too",
            job_id, task_id, mark.task_id,
        )  # fmt: skip


def _store_call(call: Callable[[], T], failure: str, *args: Any) -> T | None:
    """``call()``; ``None`` after a warning (``failure % args``) when the store fails."""
    try:
        return call()
    except LeaseError as exc:
        logger.warning(failure + " (%s)", *args, exc)
        return None


def _marked(result: Any, *, coalesced: bool) -> Any:
    setattr(result, COALESCED_ATTRIBUTE, coalesced)
    return result


def _wait_before_run(options: dict[str, Any], zone: tzinfo) -> float:
    """Seconds the message waits on purpose (``countdown`` or ``eta``); a
    naive ``eta`` is in ``zone``, the app's timezone, as Celery reads it."""
    countdown = options.get("countdown")
    if is_number(countdown):
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=zone)
        return max(0.0, eta.timestamp() - time.time())
    return 0.0


def _take_back(store: Any, job_id: str, task_id: str, why: str) -> bool:
    """Take the mark of ``task_id`` away; a store error leaves it to run out.

    Returns:
        Whether a mark of ``task_id`` was there and was taken away.
    """
    return bool(_store_call(
        lambda: store.unmark_queued(job_id, task_id),
        "could not take the queued mark of job %r (task %s) away after %s; it runs out "
        "by itself",
        job_id, task_id, why,
    ))  # fmt: skip


def _unqueued(sender: Any, request: Any, job_id: str, task_id: str, reason: str) -> None:
    """Send ``lease-unqueued``: the mark of ``job_id`` that ``task_id``'s
    message placed was taken away on this worker (``reason``: ``claimed``,
    ``revoked`` or ``skipped``)."""
    hostname = getattr(request, "hostname", None)
    events.emit(
        sender.app, events.LEASE_UNQUEUED, task_id=task_id, hostname=hostname,
        job_id=job_id, reason=reason,
    )  # fmt: skip


def _queued_key(request: Any) -> str | None:
    """The key of the queued mark the message of ``request`` placed, if any."""
    if request is None:
        return None
    value = getattr(request, QUEUED_HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(QUEUED_HEADER)
    return str(value) if value else None


def _on_claimed(sender: Any = None, lease: Lease | None = None, **_: Any) -> None:
    # the queued job has started: the next send of its key publishes again
    if lease is None or not lease.task_id or sender is None:
        return
    key = _queued_key(sender.request)
    if key == lease.job_id and _take_back(
        lease.store, key, lease.task_id, "its run claimed the lease"
    ):
        _unqueued(sender, sender.request, key, lease.task_id, "claimed")


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    # a revoked or expired message is discarded: it will never claim
    _take_back_ended(
        sender, request, getattr(request, "id", None), "revoked", "its message was revoked"
    )


def _on_skipped(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    # a call skipped under lease_on_busy="skip" is answered: it will never claim
    request = getattr(sender, "request", None)
    _take_back_ended(sender, request, task_id, "skipped", "its call was skipped")


def _take_back_ended(sender: Any, request: Any, task_id: str | None, reason: str, why: str) -> None:
    """Take the mark of a message that ended without claiming away."""
    key = _queued_key(request)
    if not key or not task_id or sender is None:
        return
    try:
        store = store_for(sender.app)
    except LeaseError as exc:
        logger.warning("could not open the lease store to unmark job %r: %s", key, exc)
        return
    if _take_back(store, key, task_id, why):
        _unqueued(sender, request, key, task_id, reason)


lease_claimed.connect(_on_claimed, weak=False, dispatch_uid="celery_leases.queue_unique.claimed")
task_revoked.connect(_on_revoked, weak=False, dispatch_uid="celery_leases.queue_unique.revoked")
lease_skipped.connect(_on_skipped, weak=False, dispatch_uid="celery_leases.queue_unique.skipped")
