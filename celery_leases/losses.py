"""What happens when a run loses its lease, and when a run is fenced out.

:func:`react_to_loss` runs in whichever thread noticed the loss, often the
deadline thread, so it only does what cannot block: a flag (always), an
interrupt (``lease_on_lost="raise"``) or stopping the pool process
(``"stop"``). Log lines, signals, the task's ``on_lease_lost`` and the task
event go to the notifier thread.

:func:`fenced_out` ends a run whose lease is lost or whose completion was
refused: nothing reaches the result backend, the lease is released if the
store may still name this run, and the message is published again unless
the same task id already has its answer from another run. A record that
names this run's own owner and generation as the completer is this run's
answer (protocol duty 6); :func:`celery_leases.run_steps.complete` judges
it first, so a completion whose reply was lost stores its result.
:func:`reject_poison` records a poison job as failed, fenced out like any
run if its completion is refused.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, NoReturn

from celery.exceptions import Ignore

from celery_leases import signals
from celery_leases.errors import LeaseLost, TakeoverLimitExceeded
from celery_leases.lease import Lease
from celery_leases.notify import notify
from celery_leases.outcome import encode_error
from celery_leases.publish import publish_again
from celery_leases.run_steps import (
    UNKNOWN_COMPLETION,
    complete,
    outcome_options,
    release_after_loss,
)
from celery_leases.runtime import in_prefork_child
from celery_leases.settings import OnLost
from celery_leases.stores.base import Acquired, Refusal, RefusalReason

__all__ = ["fenced_out", "react_to_loss", "reject_poison"]

logger = logging.getLogger("celery_leases")

#: loss reasons that come from the store refusing this run
_REFUSALS = frozenset({"missing", "superseded", "released", "completed", "unreadable"})


def react_to_loss(task: Any, lease: Lease, mode: OnLost) -> None:
    """React to a lost lease; runs in whichever thread noticed, so it stays quick.

    The deadline thread calls it: only a flag, an interrupt or a signal
    to stop happen here; everything that can block goes to the notifier.
    """
    if lease.in_body and mode == "stop" and in_prefork_child():
        os.kill(os.getpid(), signal.SIGKILL)
    if lease.in_body and mode in ("raise", "stop"):
        lease.interrupt()
    notify(_announce, task, lease, mode)


def _announce(task: Any, lease: Lease, mode: OnLost) -> None:
    error, reason = lease.loss, lease.lost_reason
    if mode == "stop" and not in_prefork_child():
        logger.warning(
            "lease_on_lost='stop' needs the prefork pool; LeaseLost was raised in the "
            "task instead, since stopping this process would stop the whole worker"
        )
    signals.lease_lost.send(
        sender=task, lease=lease, job_id=lease.job_id, reason=reason, error=error
    )
    try:
        task.on_lease_lost(lease)
    except Exception:
        logger.exception("on_lease_lost of task %s[%s] failed", task.name, lease.task_id)


def fenced_out(
    task: Any,
    lease: Lease,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reason: str | None,
    cause: BaseException | None = None,
) -> NoReturn:
    reason = reason or "lost"
    signals.lease_fenced_out.send(sender=task, lease=lease, job_id=lease.job_id, reason=reason)
    # a refusal that names this run as the completer never gets here
    # (complete() returns Completed for it), so "completed" is another run's
    answered = reason == "completed"
    if reason not in _REFUSALS and reason != UNKNOWN_COMPLETION:
        # lost by the local clock or an outage: the store may still name
        # this run, and the next copy need not wait a whole TTL for it
        refusal = release_after_loss(task, lease)
        # completed by this very run: nobody answered its client yet, and
        # the copy does, with the outcome kept in the record
        answered = (
            refusal is not None
            and refusal.reason is RefusalReason.COMPLETED
            and not lease.is_own_completion(refusal)
        )
    lease.finish()
    if request.is_eager or request.called_directly:
        raise lease.loss or LeaseLost(
            f"run of job {lease.job_id!r} (generation {lease.generation}) was fenced "
            f"out: {reason}",
            job_id=lease.job_id, owner=lease.owner, generation=lease.generation,
            reason=reason,
        ) from cause  # fmt: skip
    if not (answered and lease.job_id == request.id):
        # unless this task id already has its answer, the job must not be dropped
        publish_again(
            task, request, args, kwargs, job_id=lease.job_id, reason="fenced-out",
            countdown=min(lease.timing.ttl, task.lease_options().defer_max),
            retry_for=task.lease_options().defer_max, lease=lease,
        )  # fmt: skip
    raise Ignore() from cause


def reject_poison(
    task: Any,
    lease: Lease,
    claim: Acquired,
    limit: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> NoReturn:
    """Record a poison job as failed without running it."""
    message = (
        f"job {claim.job_id!r} of task {task.name!r} took over a run-out lease "
        f"{claim.takeovers} times (limit {limit}): every worker that ran it died or "
        "stalled, so it is recorded as failed without running; fix the task, then "
        "send it with a new id, or raise lease_max_takeovers"
    )
    logger.error(message)
    error = TakeoverLimitExceeded(
        message,
        job_id=claim.job_id,
        owner=claim.owner,
        generation=claim.generation,
        takeovers=claim.takeovers,
        limit=limit,
    )
    result = complete(task, lease, encode_error(error, **outcome_options(task)))
    request = task.request
    if result is None:
        fenced_out(task, lease, request, args, kwargs, UNKNOWN_COMPLETION)
    if isinstance(result, Refusal):
        fenced_out(task, lease, request, args, kwargs, result.reason.value)
    signals.lease_completed.send(sender=task, lease=lease, job_id=lease.job_id)
    raise error
