"""Waiting copies that the holder's end wakes (``lease_on_busy="wait"``).

A delivery that finds its job held by another run registers as a waiter
of the job in the store (:meth:`~celery_leases.stores.base.LeaseStore.add_waiter`,
keyed by its send id, with the copy to publish), then publishes one
fallback copy of itself for when the holder's lease would run out. The
holder's worker takes the job's waiters when its run ends (completes,
releases, or is fenced out and releases) and publishes each copy at once,
on its notifier thread::

    holder   |== runs ================================|end: take waiters, publish
    copy      r f                                        w claims
              r: registered   f: fallback copy, due at the holder's lease end
                                                        <= ~0.1 s after the end
    fallback                   (arrives: held, so r f again, about once per TTL;
                                the same send as w, so once w ran it is answered
                                as a duplicate of w)

The woken copy and the fallback are the same send (same send id): the
second to arrive finds the job completed by its own send and is answered
as a duplicate, or finds it held by its own send and waits for it. Since
another send may complete the job between the two, the copy whose run
ends the send's attempt (completes, fails, retries, is replaced) leaves a
*mark* of its send in the store, and a copy that claims later and finds it
releases the job without running (:func:`ran_already`). A copy killed
mid-run, fenced out, or released for a reason that runs it again leaves
none, so the send's next copy runs it.

Races, and what closes them:

- The holder ends between the refused claim and the registration: the
  copy reads the record after registering; a record no longer held by the
  generation it was refused by gets a copy that looks again at once (the
  holder's take may wake it too: the same send, answered as a duplicate).
- The holder dies (SIGKILL) or is paused past its lease, or its worker
  dies between the end and the wake: nobody takes the waiters; the
  fallback copy claims once the lease ran out, at most about a TTL late
  for a worker lost between the end and the wake.
- A run interrupted by its worker's shutdown (cold shutdown, terminate)
  releases its lease but wakes nobody: a process on its way out starts no
  thread; the waiters' fallback copies claim the job.
- A woken copy that finds the job held by another send again registers
  again and publishes no second fallback: the one it published first is
  still out (or was delivered and published its own), so a waiting send
  has one fallback copy at a time, plus one woken copy per holder end.
- The store is down at the registration, the message is too large for a
  waiter (:data:`~celery_leases.stores.waiters.MAX_WAITER_BYTES`), the
  job has :data:`~celery_leases.stores.waiters.MAX_WAITERS` waiters, or
  the payload cannot be serialized: the copy looks again every second, as
  :func:`~celery_leases.waiting.held_countdown` says; it never runs
  without a lease and is never dropped.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, NoReturn

from celery import signature as make_signature
from celery.exceptions import Ignore
from kombu.serialization import loads, prepare_accept_content

from celery_leases.errors import LeaseError
from celery_leases.lease import Lease
from celery_leases.notify import notify
from celery_leases.outcome import serialize
from celery_leases.publish import (
    DEFERRALS_HEADER,
    WOKEN_HEADER,
    capped_countdown,
    copy_signature,
    publish_again,
    send_copy,
)
from celery_leases.request import header_of
from celery_leases.runtime import store_for
from celery_leases.sending import message_send_id, send_id_for
from celery_leases.stores.base import TASK_ID_SEND_PREFIX, HeldElsewhere, LeaseState, LeaseStore
from celery_leases.stores.deadline import bounded
from celery_leases.stores.waiters import LAST_SKIPPED, MAX_WAITER_BYTES, SKIPPED_KEPT
from celery_leases.waiting import MIN_COUNTDOWN, fallback_countdown, held_countdown

__all__ = [
    "WAITER_GRACE",
    "WAITING_HEADER",
    "WAKE_BOUND",
    "note_skipped",
    "ran_already",
    "wait_for_holder",
    "wake_waiters",
]

logger = logging.getLogger("celery_leases")

#: message header of every copy of a send that waited as a waiter (its
#: fallback copies, its woken copies and their copies): such a copy that
#: claims the job first looks for its send's mark
WAITING_HEADER = "leases_waiting"

#: the key prefix of a send's mark: a copy of it claimed the job
MARK_PREFIX = "ran:"

#: seconds a waiter's entry outlives its fallback copy's countdown, so that
#: a holder that ends just before the fallback arrives still wakes it
WAITER_GRACE = 10.0

#: the longest wait (seconds) of one store call of the wake or the registration
WAKE_BOUND = 5.0


def wait_for_holder(
    task: Any,
    claim: HeldElsewhere,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    send_id: str | None,
    defer_max: float,
) -> NoReturn:
    """Register the running message as a waiter of the held job, then
    publish its fallback copy (or, when it cannot wait so, a copy that
    looks again in a second).

    Raises:
        Ignore: the message was published again, or need not be.
        Reject: publishing kept failing; the broker keeps the message.
    """
    countdown = held_countdown(claim.remaining, defer_max)
    fallback = capped_countdown(task, fallback_countdown(claim.remaining, defer_max))
    copy = copy_signature(
        task, request, args, kwargs, reason="held", headers={WOKEN_HEADER: 1, WAITING_HEADER: 1}
    )
    if _register(task, claim, request, copy, send_id, fallback):
        holder = _holder_now(task, claim, send_id, request.id)
        if holder is _Holder.ENDED:
            countdown = MIN_COUNTDOWN
        elif holder is _Holder.ANOTHER_SEND and _woken(request):
            # this send's fallback copy is still out: it looks again then
            raise Ignore()
        elif holder is not _Holder.UNKNOWN:
            countdown = fallback
    publish_again(
        task, request, args, kwargs, job_id=claim.job_id, reason="held", countdown=countdown,
        retry_for=defer_max, holder=claim.holder, headers={WAITING_HEADER: 1},
    )  # fmt: skip
    raise Ignore()


def _header(request: Any, name: str) -> bool:
    return bool(header_of(request, name))


def _woken(request: Any) -> bool:
    return _header(request, WOKEN_HEADER)


def _mark_id(request: Any, send_id: str | None) -> str:
    """The key of the mark of the running message's send and attempt (a
    ``retry()`` is the same send's next attempt, not a copy of this one)."""
    return f"{MARK_PREFIX}{send_id or request.id}:{request.retries or 0}"


def ran_already(task: Any, lease: Lease, request: Any, send_id: str | None) -> bool:
    """Whether another copy of this waiting send ran to its end: the job's
    claim just succeeded, and a copy of the same send and attempt that
    completed or released its run marked it then (:func:`wake_waiters`).
    A copy that was killed or lost its lease left no mark, so the next
    copy runs the send: the mark is placed at a run's end, never at its
    claim.

    A waiting send has two copies out at once, its fallback and, after a
    holder's end, its woken copy; the one that comes second is a duplicate.
    The record cannot tell it when another send completed the job between
    the two (it keeps the last completion only)::

        w (woken) runs send s1, marks s1   s3 runs, completes
        f (fallback of s1) claims: mark of s1 found -> released, not run

    A message that is no such copy, or a store that cannot answer, runs.
    """
    if not _header(request, WAITING_HEADER):
        return False
    mark = _mark_id(request, send_id)
    store = lease.store
    try:
        with bounded(min(WAKE_BOUND, lease.remaining())):
            return any(w.send_id == mark and w.is_mark for w in store.waiters(lease.job_id))
    except LeaseError as exc:
        logger.warning(
            "task %s[%s]: could not look for the mark of its send on job %r (%s)",
            task.name, request.id, lease.job_id, exc,
        )  # fmt: skip
    return False


def _register(
    task: Any,
    claim: HeldElsewhere,
    request: Any,
    signature: Any,
    send_id: str | None,
    fallback: float,
) -> bool:
    """Whether the running message is now a waiter of the job, with
    ``signature`` (its copy) to publish when the holder ends."""
    if not request.id:
        return False
    payload = _encode(task, signature, message_send_id(request))
    if payload is None:
        return False
    waiter_id = send_id or f"{TASK_ID_SEND_PREFIX}{request.id}"
    try:
        with bounded(WAKE_BOUND):
            registered = store_for(task.app).add_waiter(
                claim.job_id, waiter_id, request.id, payload, fallback + WAITER_GRACE
            )
    except LeaseError as exc:
        logger.warning(
            "task %s[%s]: could not register as a waiter of job %r (%s); looking again "
            "every second instead",
            task.name, request.id, claim.job_id, exc,
        )  # fmt: skip
        return False
    return registered


def _encode(task: Any, signature: Any, send_id: str | None) -> bytes | None:
    """The waiter's payload: the copy's signature and send id, serialized
    with the message's own serializer; None when it cannot be kept."""
    serializer = signature.options.get("serializer") or task.app.conf.task_serializer
    try:
        payload = serialize({"signature": dict(signature), "send_id": send_id}, serializer)
    except Exception as exc:  # kombu's EncodeError, or a serializer's own error
        logger.info("a waiting copy of %s cannot be kept as a waiter (%r)", task.name, exc)
        return None
    return payload if len(payload) <= MAX_WAITER_BYTES else None


def _decode(app: Any, payload: bytes) -> tuple[Any, str | None]:
    """The signature and send id a payload of :func:`_encode` keeps.

    Only the app's ``accept_content`` decodes it: the trust of a message
    from the broker, which is what the payload was.

    Raises:
        Exception: the payload cannot be read (kombu's DecodeError, ...).
    """
    content_type, encoding, body = payload.split(b"\n", 2)
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    data = loads(  # type: ignore[no-untyped-call]
        body, content_type.decode(), encoding.decode(), accept=accept
    )
    return make_signature(data["signature"], app=app), data.get("send_id")


class _Holder(enum.Enum):
    """The run a claim was refused by, read again after the registration."""

    ENDED = "ended"
    SAME_SEND = "same-send"
    ANOTHER_SEND = "another-send"
    UNKNOWN = "unknown"


def _holder_now(
    task: Any, claim: HeldElsewhere, send_id: str | None, task_id: str | None
) -> _Holder:
    try:
        with bounded(WAKE_BOUND):
            record = store_for(task.app).get(claim.job_id)
    except LeaseError:
        return _Holder.UNKNOWN
    if (
        record is None
        or record.state is not LeaseState.HELD
        or record.generation != claim.generation
    ):
        return _Holder.ENDED
    if record.is_same_run(send_id) or record.task_id == task_id:
        return _Holder.SAME_SEND
    return _Holder.ANOTHER_SEND


def wake_waiters(task: Any, lease: Lease, *, send_ended: bool = True) -> None:
    """After ``lease``'s run ended: publish the job's waiters, soon, on the
    notifier thread (never on the thread that keeps lease deadlines).

    ``send_ended``: the run ended its send's attempt (it completed, failed,
    retried or was replaced). A run of a waiting send that did marks its
    send first, so that the mark outlasts every copy of it still on its way
    (:func:`ran_already`). A run released for another reason (fenced out,
    a completion whose answer was lost, ``Ignore`` or ``Reject``) leaves no
    mark: its send is to run again, and a copy that found a mark would
    release the job without running it.
    """
    request = task.request
    own = send_id_for(request, lease.job_id)
    mark = None
    if send_ended and _header(request, WAITING_HEADER):
        mark = (_mark_id(request, own), request.id, task.lease_options().defer_max)
    notify(_wake, task, lease.store, lease.job_id, own, mark)


def _wake(
    task: Any,
    store: LeaseStore,
    job_id: str,
    own_send_id: str | None,
    mark: tuple[str, str, float] | None,
) -> None:
    """Take the job's waiters from ``store`` (the one its lease was held in)
    and publish them."""
    try:
        with bounded(WAKE_BOUND):
            if mark is not None:
                mark_id, task_id, defer_max = mark
                store.add_waiter(job_id, mark_id, task_id, b"", defer_max + WAITER_GRACE)
            waiters = store.take_waiters(job_id)
    except LeaseError as exc:
        logger.warning(
            "job %r ended, but its waiters could not be taken (%s); they claim it when "
            "their fallback copies come",
            job_id, exc,
        )  # fmt: skip
        return
    for waiter in waiters:
        if own_send_id is not None and waiter.send_id == own_send_id:
            continue  # the run that ended is that send: nothing waits for it
        try:
            signature, send_id = _decode(task.app, waiter.payload)
            send_copy(signature, send_id)
        except Exception as exc:
            logger.warning(
                "job %r ended, but its waiting copy %s could not be woken (%r); its "
                "fallback copy claims the job instead",
                job_id, waiter.task_id, exc,
            )  # fmt: skip
            continue
        logger.info(
            "lease waiter woken: job=%s task_id=%s deferrals=%s",
            job_id, waiter.task_id, signature.options.get("headers", {}).get(DEFERRALS_HEADER),
        )  # fmt: skip


def note_skipped(task: Any, job_id: str, task_id: str) -> None:
    """Name ``task_id`` as ``job_id``'s last skipped call in the store (a
    mark under :data:`~celery_leases.stores.waiters.LAST_SKIPPED`, kept
    :data:`~celery_leases.stores.waiters.SKIPPED_KEPT` seconds), soon, on
    the notifier thread: the skip's answer does not wait for it, and a
    store that cannot take it only leaves the job's last skip unnamed."""
    notify(_note_skipped, task, job_id, task_id)


def _note_skipped(task: Any, job_id: str, task_id: str) -> None:
    try:
        with bounded(WAKE_BOUND):
            store_for(task.app).add_waiter(job_id, LAST_SKIPPED, task_id, b"", SKIPPED_KEPT)
    except LeaseError as exc:
        logger.warning("job %r: its skipped call %s could not be noted (%s)", job_id, task_id, exc)
