"""Publishing a leased message again: deferred duplicates, outages, fenced-out runs.

A copy is the same send as the message it copies: same task id, arguments,
options, headers, serializer, parent and root, and the same send id (see
:mod:`celery_leases.sending`), with a countdown and a deferral count. It is
published from outside the running task's context, so it does not become a
child of itself.

When publishing fails (the broker cannot be written to), the worker waits
and tries again with exponential backoff up to ``leases_defer_max`` seconds
in all, then rejects the message back to the queue: it never spins.

A copy made after a store outage or a fenced-out run (whose completion is
in doubt) goes where ``leases_republish_options`` says (a ``queue``, a
``priority``), so that it need not wait behind the whole backlog of its
queue: the job is free, and has waited already. A copy deferred because
another worker holds the job keeps its route: it only looks again.

The countdown is capped below RabbitMQ's consumer timeout and below the
visibility timeout of Redis and SQS
(:func:`celery_leases.broker_checks.countdown_cap`), since the worker that
receives the copy holds it unacknowledged until the countdown ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from celery._state import _task_stack  # no public API; tests/unit/test_layout.py pins it
from celery.exceptions import Reject
from kombu.serialization import registry

from celery_leases import signals
from celery_leases.backoff import backoff_delays
from celery_leases.broker_checks import countdown_cap
from celery_leases.lease import Lease
from celery_leases.request import CONTENT_TYPE_KEY, header_of, headers_of
from celery_leases.runtime import settings_for
from celery_leases.sending import keeping_send_id, message_send_id

__all__ = [
    "DEFERRALS_HEADER",
    "WOKEN_HEADER",
    "ROUTED_REASONS",
    "capped_countdown",
    "copy_signature",
    "deferrals_of",
    "publish_again",
    "send_copy",
]

logger = logging.getLogger("celery_leases")

#: message header counting how often a message was deferred
DEFERRALS_HEADER = "leases_deferrals"

#: message header of a copy that a holder's end woke (:mod:`celery_leases.wake`);
#: a copy of that copy is not woken, so it never inherits the header
WOKEN_HEADER = "leases_woken"

#: first wait after a failed publish (seconds); it doubles up to the cap
FIRST_PUBLISH_RETRY = 0.5

#: reasons whose copy follows ``leases_republish_options``
ROUTED_REASONS = ("store-unavailable", "fenced-out")


def deferrals_of(request: Any) -> int:
    """How often the running message was deferred before."""
    value = header_of(request, DEFERRALS_HEADER, 0)
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


@contextlib.contextmanager
def _outside_task_context() -> Iterator[None]:
    # Celery makes the running task the parent of whatever it sends, and
    # adds it to its children; a copy of the message is neither.
    # Celery has no public way to send from a running task without making the
    # message its child (send_task fills a missing parent_id from the current
    # task); tests/integration/test_task_semantics.py pins it (a copy is no child).
    saved = []
    while _task_stack.top is not None:
        saved.append(_task_stack.pop())
    try:
        yield
    finally:
        for task in reversed(saved):
            _task_stack.push(task)


def capped_countdown(task: Any, countdown: float) -> float:
    """``countdown``, capped below the broker's consumer or visibility timeout
    (:func:`~celery_leases.broker_checks.countdown_cap`): the copy is held
    unacknowledged until its countdown ends."""
    cap = countdown_cap(task.app)
    return countdown if cap is None else min(countdown, cap)


def copy_signature(
    task: Any,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    reason: str,
    headers: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """The signature of a copy of the running message: the same send, with
    one more deferral counted, ``headers`` added, the message's serializer,
    the route ``reason`` asks for, and ``options`` (a ``countdown``)."""
    inherited = {k: v for k, v in headers_of(request).items() if k != WOKEN_HEADER}
    headers = {**inherited, DEFERRALS_HEADER: deferrals_of(request) + 1, **(headers or {})}
    options["headers"] = headers
    serializer = registry.type_to_name.get(getattr(request, CONTENT_TYPE_KEY, None) or "")
    if serializer:
        options["serializer"] = serializer
    route = settings_for(task.app).republish_options if reason in ROUTED_REASONS else {}
    if route.get("priority") is not None:
        options["priority"] = route["priority"]
    return task.signature_from_request(request, args, kwargs, queue=route.get("queue"), **options)


def send_copy(signature: Any, send_id: str | None) -> None:
    """Publish ``signature``, a copy of a message, under the send id ``send_id``,
    as no task's child.

    Raises:
        Exception: whatever publishing raised (the broker cannot be written to).
    """
    with _outside_task_context(), keeping_send_id(send_id):
        signature.apply_async(add_to_parent=False)


def publish_again(
    task: Any,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    job_id: str,
    reason: str,
    countdown: float,
    retry_for: float,
    holder: str | None = None,
    lease: Lease | None = None,
    headers: dict[str, Any] | None = None,
) -> None:
    """Publish the running message again after ``countdown`` seconds.

    Args:
        retry_for: how long to keep trying when publishing fails (seconds).
        headers: headers the copy has besides the message's own.

    Raises:
        Reject: publishing kept failing; the broker keeps the message (requeue).
    """
    countdown = capped_countdown(task, countdown)
    deferrals = deferrals_of(request) + 1
    signature = copy_signature(
        task, request, args, kwargs, reason=reason, headers=headers, countdown=countdown
    )
    send_id = message_send_id(request)  # a copy is the same send
    waits, waited = backoff_delays(FIRST_PUBLISH_RETRY), 0.0
    while True:
        try:
            send_copy(signature, send_id)
            break
        except Exception as exc:
            if waited >= retry_for:
                logger.error(
                    "task %s[%s]: could not publish job %r again (%r) for %.1f s; "
                    "rejecting the message back to the queue",
                    task.name, request.id, job_id, exc, waited,
                )  # fmt: skip
                raise Reject(exc, requeue=True) from exc
            wait = min(next(waits), retry_for - waited)
            logger.warning(
                "task %s[%s]: could not publish job %r again (%r); trying again in %.1f s",
                task.name, request.id, job_id, exc, wait,
            )  # fmt: skip
            time.sleep(wait)
            waited += wait
    signals.duplicate_deferred.send(
        sender=task, lease=lease, job_id=job_id, reason=reason, countdown=countdown,
        deferrals=deferrals, holder=holder,
    )  # fmt: skip
