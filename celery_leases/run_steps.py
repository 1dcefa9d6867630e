"""The store steps of a leased run that are not its main flow.

Completing and releasing with their retry rules, deferring a message whose
job is held or whose store is down, and answering a redelivery of a
completed job. :mod:`celery_leases.task` and :mod:`celery_leases.losses`
call them; each takes the running task as its first argument.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from celery.exceptions import Ignore
from celery.states import READY_STATES

from celery_leases import observe, signals
from celery_leases.backoff import backoff_delay, backoff_delays
from celery_leases.errors import (
    LeaseError,
    LeaseHeld,
    LeaseSkipped,
    ResultUnavailable,
    StoreUnavailable,
    TakeoverLimitExceeded,
)
from celery_leases.lease import Lease
from celery_leases.outcome import decode, encode_value
from celery_leases.publish import capped_countdown, deferrals_of, publish_again
from celery_leases.runtime import TaskOptions, settings_for, store_for
from celery_leases.stores.base import (
    AlreadyCompleted,
    Completed,
    CompleteResult,
    HeldElsewhere,
    LeaseState,
    Refusal,
    Released,
    ReleaseResult,
)
from celery_leases.stores.deadline import bounded
from celery_leases.wake import note_skipped, wait_for_holder, wake_waiters

__all__ = [
    "SEND_ENDED",
    "UNKNOWN_COMPLETION",
    "answer_completed",
    "answer_held",
    "complete",
    "complete_run",
    "defer_unavailable",
    "outcome_options",
    "release",
    "release_after_loss",
]

logger = logging.getLogger("celery_leases")

#: the loss reason of a run whose completion the store never confirmed nor
#: refused; the store was asked again (by a release) before it was given
UNKNOWN_COMPLETION = "completion-unknown"

#: the release reasons that end a send's attempt for good: a copy of the
#: same send and attempt that claims later is a duplicate. The others
#: (fenced out, a completion whose answer was lost, ``Ignore`` and
#: ``Reject``) run the send again.
SEND_ENDED = frozenset({"failure", "retry", "replaced", "duplicate"})


def outcome_options(task: Any, options: TaskOptions | None = None) -> dict[str, Any]:
    """How ``task``'s outcomes are encoded for the lease record (``options``:
    the task's, when the caller has them at hand)."""
    if options is None:
        options = task.lease_options()
    return {"serializer": options.result_serializer, "max_bytes": options.result_max_bytes}


def complete_run(
    task: Any, lease: Lease, value: object, options: TaskOptions
) -> CompleteResult | None:
    """The completion after the body returned ``value``; ``options`` are the task's.

    A run that completed in its own transaction (``exactly_once``) is not
    completed again: the store already keeps its outcome.
    """
    if lease.completed_in_transaction:
        result: CompleteResult | None = Completed(lease.job_id, lease.generation)
    else:
        result = complete(task, lease, encode_value(value, **outcome_options(task, options)))
    if isinstance(result, Completed):
        wake_waiters(task, lease)
    return result


def complete(task: Any, lease: Lease, outcome: bytes | None) -> CompleteResult | None:
    """Complete, retrying an unavailable store until the local deadline.

    No try waits for the store past that deadline (a store that bounds its
    waits, as the SQL store and the Redis store's own connections do, gives
    up then, and tries nothing more); the outcome is then settled by
    asking the store once more (:func:`_settle_completion`)::

        complete(g) ---> (no reply) ... deadline: give up -> release(g)?
            refused, completed by (owner, g): Completed
            released / refused otherwise / no answer: not a success

    Returns:
        The store's answer (a refusal that names this run as the job's
        completer is :class:`Completed`), or None when the outcome is unknown.
    """
    delays = backoff_delays(0.05, cap=1.0)
    while True:
        try:
            with bounded(lease.remaining()):
                result = lease.store.complete(
                    lease.job_id, lease.owner, lease.generation, outcome=outcome
                )
        except StoreUnavailable as exc:
            delay = next(delays)
            if lease.remaining() <= delay:
                return _settle_completion(task, lease, exc)
            time.sleep(delay)
            continue
        if isinstance(result, Completed):
            lease.finish()
        return result


def _settle_completion(task: Any, lease: Lease, exc: StoreUnavailable) -> CompleteResult | None:
    """The deadline came before the store answered a completion: ask it once more.

    The completion may have been applied with its reply lost. A release
    finds out (protocol duty 6): refused because this very run (owner and
    generation) completed the job, the run completed; released, it did not.
    It is asked once, past the deadline, so it waits no longer than the
    drift margin (:func:`_give_up`).

    Returns:
        Completed, the store's refusal (another run has the job), or None
        when the outcome stays unknown (the lease is then released or runs out).
    """
    result = _give_up(task, lease, UNKNOWN_COMPLETION, after_loss=True)
    if isinstance(result, Refusal) and lease.is_own_completion(result):
        lease.finish()
        logger.warning(
            "job %r (generation %d): the reply to its completion was lost (%s), and the "
            "store records this run's completion; its result stands",
            lease.job_id, lease.generation, exc,
        )  # fmt: skip
        return Completed(lease.job_id, lease.generation)
    if isinstance(result, Refusal):
        return result
    logger.error(
        "could not complete job %r (generation %d): %s; the body ran but the completion "
        "is unknown, so the message is published again",
        lease.job_id, lease.generation, exc,
    )  # fmt: skip
    return None


def release(task: Any, lease: Lease, reason: str) -> bool:
    """Give the lease up, fenced; False if the store refused (this run is stale).

    The store is not waited for past the lease's local deadline: a release
    that has no answer by then leaves the lease to run out. A lease already
    lost (a body that raised ``Ignore`` or ``Reject`` after its deadline)
    waits the drift margin instead, as :func:`release_after_loss` does: the
    store may still name this run, and the release frees the job at once.
    """
    result = _give_up(task, lease, reason, after_loss=lease.lost)
    if isinstance(result, Refusal):
        lease.mark_lost(result.error("release"))
        return False
    return True


def release_after_loss(task: Any, lease: Lease) -> Refusal | None:
    """Give up a lease known lost, in case the store still names this run.

    Returns:
        The store's refusal (it says who has the job now), or None.
    """
    result = _give_up(task, lease, "fenced-out", after_loss=True)
    return result if isinstance(result, Refusal) else None


def _give_up(
    task: Any, lease: Lease, reason: str, *, after_loss: bool = False
) -> ReleaseResult | None:
    """Release, waiting for the store until the lease's local deadline, or
    (``after_loss``: the deadline is past or near, and the question is what
    the store recorded) for at most the drift margin: for that long after
    the local deadline the store's own lease still names this run."""
    within = lease.timing.drift_margin if after_loss else lease.remaining()
    try:
        with bounded(within):
            result = lease.store.release(lease.job_id, lease.owner, lease.generation)
    except StoreUnavailable as exc:
        logger.warning(
            "could not release job %r (generation %d) after %s: %s; it runs out in %g s",
            lease.job_id, lease.generation, reason, exc, lease.timing.ttl,
        )  # fmt: skip
        return None
    if isinstance(result, Released):
        lease.finish()
        observe.send(signals.lease_released, task, lease=lease, job_id=lease.job_id, reason=reason)
        if reason != "interrupted":
            # a worker shutting down (cold shutdown, terminate) starts no
            # thread and publishes nothing: its waiters' fallback copies claim
            wake_waiters(task, lease, send_ended=reason in SEND_ENDED)
    return result


def answer_completed(task: Any, request: Any, claim: AlreadyCompleted) -> Any:
    """Answer a redelivery of a completed job without running it.

    The result backend's answer stays if it has one; otherwise the outcome
    kept with the completion is returned (or raised) as this run's own.

    Raises:
        Ignore: the backend has the result already, or results are ignored.
        ResultUnavailable: the result can be found nowhere.
        LeaseRecordUnreadable: the kept outcome is not one this app's result
            serializer wrote (it is never decoded).
    """
    signals.lease_skipped.send(
        sender=task, lease=None, job_id=claim.job_id, generation=claim.generation,
        task_id=request.id, reason="completed",
    )  # fmt: skip
    ignored = bool(request.ignore_result or task.ignore_result)
    if not ignored and _stored_state(task, request.id) in READY_STATES:
        raise Ignore()
    outcome = getattr(claim, "outcome", None)
    if outcome is not None:
        app = task.app
        kind, value = decode(
            outcome,
            serializer=app.conf.result_serializer,
            accept=app.conf.result_accept_content,
            job_id=claim.job_id,
        )
        logger.info(
            "task %s[%s]: job %r was completed by generation %d; answering with the "
            "outcome kept in its lease record",
            task.name, request.id, claim.job_id, claim.generation,
        )  # fmt: skip
        if kind == "ok":
            return value
        error_type = (
            TakeoverLimitExceeded if value["type"] == "TakeoverLimitExceeded" else LeaseError
        )
        raise error_type(str(value["message"]), job_id=claim.job_id, generation=claim.generation)
    if ignored:
        raise Ignore()
    raise ResultUnavailable(
        f"job {claim.job_id!r} was completed by generation {claim.generation}, but its result "
        "is neither in the result backend nor kept with the completion (too large for "
        "leases_result_max_bytes, or not serializable); send the task again with a new id "
        "to run it again",
        job_id=claim.job_id,
        generation=claim.generation,
    )


def _stored_state(task: Any, task_id: str | None) -> str | None:
    try:
        meta = task.backend.get_task_meta(task_id)
    except Exception:  # a disabled or unreachable backend: use the kept outcome
        return None
    return str(meta.get("status")) if meta else None


def answer_held(
    task: Any,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    claim: HeldElsewhere,
    send_id: str | None,
    options: TaskOptions,
) -> NoReturn:
    """The claim found the job held: skip the call, or publish it again to
    look at the job in a second, or when its lease runs out.

    Under ``lease_on_busy="skip"`` a call is skipped when another send holds
    the job (:func:`_holder_of_another_send`); a delivery of the holder's own
    send (a redelivery, or the library's copy of it) waits as under
    ``"wait"``: if the holder dies, that copy takes the job over. So does a
    new send of the holder's own task id (a ``retry()`` or ``replace()``
    whose release did not reach the store): its answer would be the
    holder's result, and it is the job's next run.

    Raises:
        LeaseSkipped: skipped; it is the call's result, and the message is
            acknowledged, not published again.
        LeaseHeld: an eager or direct call, which cannot wait.
        Ignore: the message was published again.
    """
    if options.on_busy == "skip":
        holder_task_id = _holder_of_another_send(task, claim, send_id, request.id)
        if holder_task_id is not None:
            _skip(task, request, claim, holder_task_id)
    if request.is_eager or request.called_directly:
        raise LeaseHeld(
            f"job {claim.job_id!r} is held by {claim.holder} (generation "
            f"{claim.generation}) for {claim.remaining:.1f} s more; an eager or direct "
            "call cannot be deferred, so try again later",
            job_id=claim.job_id,
            holder=claim.holder,
            generation=claim.generation,
            remaining=claim.remaining,
        )
    wait_for_holder(
        task, claim, request, args, kwargs, send_id=send_id, defer_max=options.defer_max
    )


def _holder_of_another_send(
    task: Any, claim: HeldElsewhere, send_id: str | None, task_id: str | None
) -> str | None:
    """The task id of the holder ("" if unknown) when it came from another
    send than ``send_id`` with another task id than ``task_id``; None when
    it is the same send or task id, or not known.

    The claim does not say which send holds the job, so the record is read
    (a refused claim only). A record that changed since the claim, or a
    store that cannot be read now, is not known: the call waits and looks
    again.
    """
    try:
        record = store_for(task.app).get(claim.job_id)
    except StoreUnavailable:
        return None
    if (
        record is None
        or record.state is not LeaseState.HELD
        or record.generation != claim.generation
        or record.is_same_run(send_id)
        or (task_id is not None and record.task_id == task_id)
    ):
        return None
    return record.task_id


def _skip(task: Any, request: Any, claim: HeldElsewhere, holder_task_id: str) -> NoReturn:
    note_skipped(task, claim.job_id, request.id)
    signals.lease_skipped.send(
        sender=task, lease=None, job_id=claim.job_id, generation=claim.generation,
        task_id=request.id, reason="busy", holder=claim.holder, holder_task_id=holder_task_id,
    )  # fmt: skip
    raise LeaseSkipped(
        f"task {task.name}[{request.id}] was skipped: job {claim.job_id!r} is held by "
        f"task {holder_task_id or '(unknown id)'} (generation {claim.generation}, "
        f"{claim.remaining:.1f} s left on its lease), and lease_on_busy is 'skip'",
        job_id=claim.job_id,
        holder=claim.holder,
        generation=claim.generation,
        remaining=claim.remaining,
        holder_task_id=holder_task_id,
    )


def defer_unavailable(
    task: Any,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    job_id: str,
    defer_max: float,
    exc: StoreUnavailable,
) -> NoReturn:
    """Publish the message again with exponential backoff, capped at ``defer_max``."""
    if request.is_eager or request.called_directly:
        raise exc
    settings = settings_for(task.app)
    countdown = backoff_delay(
        settings.defer_backoff, deferrals_of(request), cap=defer_max, jitter=0.2
    )
    logger.warning(
        "task %s[%s]: lease store unavailable at claim (%s); deferring %.1f s (deferral %d)",
        task.name, request.id, exc, capped_countdown(task, countdown), deferrals_of(request) + 1,
    )  # fmt: skip
    publish_again(
        task, request, args, kwargs, job_id=job_id, reason="store-unavailable",
        countdown=countdown, retry_for=defer_max,
    )  # fmt: skip
    raise Ignore() from exc
