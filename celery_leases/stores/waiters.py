"""Waiters: the sends of a job that wait for its holder to end.

A delivery under ``lease_on_busy="wait"`` that finds the job held by
another run registers itself as a waiter: one entry per (job, send),
holding the message to publish again (``payload``, opaque to the store)
and running out by itself at ``waiting_until_ms`` on the store's clock.
The holder's worker takes the job's waiters when its run ends (one atomic
call that returns and deletes them) and publishes each; an entry whose
holder died just runs out, and the waiting send's fallback copy claims
the job instead. An entry without a payload is a *mark*: a copy of the
send claimed the job, so that its other copies know; it is never taken,
and runs out by itself. The mark under :data:`LAST_SKIPPED` names the job's
last call skipped under ``lease_on_busy="skip"``, for ``celery leases
show`` and the Django admin.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_leases.errors import LeaseConfigurationError

__all__ = [
    "LAST_SKIPPED",
    "MAX_WAITERS",
    "MAX_WAITER_BYTES",
    "SKIPPED_KEPT",
    "Waiter",
    "check_payload",
]

#: the largest payload a waiter may keep (64 KiB); a larger message waits
#: by looking at the job again instead
MAX_WAITER_BYTES = 64 * 1024

#: the most live waiters of other sends a job takes; a send past it waits
#: by looking at the job again instead
MAX_WAITERS = 100

#: the key (send id) of the mark that names a job's last skipped call
#: (``lease_on_busy="skip"``); each skip replaces it
LAST_SKIPPED = "last-skipped"

#: how long the mark of a job's last skipped call is kept (seconds)
SKIPPED_KEPT = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Waiter:
    """A send waiting for ``job_id``'s holder (times in store milliseconds).

    Attributes:
        job_id: the lease key.
        send_id: the waiting send (the key of the entry within the job).
        task_id: the Celery task id of its message.
        payload: what publishes it again, as the run path encoded it.
        waiting_since_ms: when it registered (the latest registration).
        waiting_until_ms: when the entry runs out by itself.
    """

    job_id: str
    send_id: str
    task_id: str
    payload: bytes
    waiting_since_ms: int
    waiting_until_ms: int

    @property
    def is_mark(self) -> bool:
        """Whether this entry is a mark (no payload): a run of the send
        claimed the job; nothing publishes it."""
        return not self.payload

    @property
    def is_last_skipped(self) -> bool:
        """Whether this entry names the job's last skipped call (its
        ``task_id``, skipped at ``waiting_since_ms``)."""
        return self.send_id == LAST_SKIPPED and self.is_mark


def check_payload(payload: object) -> bytes:
    """``payload`` if a store can keep it as a waiter's, else a configuration error."""
    if not isinstance(payload, bytes):
        raise LeaseConfigurationError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_WAITER_BYTES:
        raise LeaseConfigurationError(
            f"a waiter's payload is {len(payload)} bytes; the limit is {MAX_WAITER_BYTES}"
        )
    return payload
