"""The record a store keeps for a job and the results of store operations.

Times are integer milliseconds since the Unix epoch on the store's clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timezone

from celery_leases.errors import LeaseLost, LeaseRecordUnreadable

__all__ = [
    "Acquired",
    "AlreadyCompleted",
    "ClaimResult",
    "CompleteResult",
    "Completed",
    "HeldElsewhere",
    "LeaseRecord",
    "LeaseState",
    "Refusal",
    "RefusalReason",
    "ReleaseResult",
    "Released",
    "RenewRequest",
    "RenewResult",
    "Renewed",
    "TASK_ID_SEND_PREFIX",
    "ms_to_datetime",
    "refusal_for",
    "unreadable",
    "unreadable_refusal",
]


def ms_to_datetime(ms: int) -> datetime:
    """Convert store milliseconds since the epoch to an aware UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


#: The send id a claim gives for a message without one under a custom key:
#: this, then the message's task id. Such a claim is the same run as a
#: completion by a delivery with that task id, whatever its send id was.
TASK_ID_SEND_PREFIX = "task:"


class LeaseState(str, enum.Enum):
    """The ``state`` field of a record."""

    HELD = "held"
    RELEASED = "released"
    COMPLETED = "completed"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One job's record as the store keeps it (times in store milliseconds)."""

    job_id: str
    owner: str
    generation: int
    lease_until_ms: int
    state: LeaseState
    task_name: str = ""
    claimed_at_ms: int | None = None
    renewed_at_ms: int | None = None
    completed_at_ms: int | None = None
    renew_count: int = 0
    #: claims that found the previous holder's lease run out (not released)
    takeovers: int = 0
    #: the send (message) that the current run came from; "" when not given
    send_id: str = ""
    #: opaque bytes stored with the completion (the task layer's encoded result)
    outcome: bytes | None = None
    #: when the lease was last released (by its holder or by an operator)
    released_at_ms: int | None = None
    #: who forced the last release ("" for a release by the holder itself)
    released_by: str = ""
    #: why the last release was forced
    release_reason: str = ""
    #: the task id of the delivery the current run came from; "" when not given
    task_id: str = ""

    @property
    def lease_until(self) -> datetime:
        """``lease_until`` as an aware UTC datetime."""
        return ms_to_datetime(self.lease_until_ms)

    def is_live(self, store_now_ms: int) -> bool:
        """Whether this record is an unexpired holder at ``store_now_ms``."""
        return self.state is LeaseState.HELD and self.lease_until_ms > store_now_ms

    def is_same_run(self, send_id: str | None) -> bool:
        """Whether a claim with ``send_id`` is the run this completed record
        is of: no send id, the same one, or ``task:<task id>`` with the task id
        of the delivery that completed it."""
        return (
            send_id is None
            or send_id == self.send_id
            or (bool(self.task_id) and send_id == TASK_ID_SEND_PREFIX + self.task_id)
        )


# --- claim results ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Acquired:
    """The claim succeeded: the caller holds the lease with ``generation``."""

    job_id: str
    owner: str
    generation: int
    lease_until_ms: int
    store_now_ms: int
    #: how many claims of this job so far took over a lease that ran out
    #: while held (its holder died or stalled); this claim included
    takeovers: int = 0

    @property
    def lease_until(self) -> datetime:
        return ms_to_datetime(self.lease_until_ms)

    @property
    def ttl(self) -> float:
        """Seconds granted, by the store's clock."""
        return (self.lease_until_ms - self.store_now_ms) / 1000


@dataclass(frozen=True, slots=True)
class HeldElsewhere:
    """Another owner holds a live lease; ``remaining`` is in seconds."""

    job_id: str
    holder: str
    generation: int
    remaining: float


@dataclass(frozen=True, slots=True)
class AlreadyCompleted:
    """The job was completed (with ``generation``) by the same send; skip it.

    ``send_id`` is the send the completed run came from and ``outcome`` the
    bytes stored with its completion, if any.
    """

    job_id: str
    generation: int
    send_id: str = ""
    outcome: bytes | None = None


ClaimResult = Acquired | HeldElsewhere | AlreadyCompleted


# --- renew / complete / release results ------------------------------------


class RefusalReason(str, enum.Enum):
    """Why a renew, complete or release was refused."""

    #: no record exists for the job
    MISSING = "missing"
    #: another owner or a newer generation holds the record
    SUPERSEDED = "superseded"
    #: the lease was released (owner cleared)
    RELEASED = "released"
    #: the job is completed
    COMPLETED = "completed"
    #: the job's record cannot be read (written by something else); only an
    #: operator can fix it
    UNREADABLE = "unreadable"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A renew, complete or release was refused: the caller is stale.

    ``current_owner`` and ``current_generation`` describe the record as the
    store saw it, when it exists.
    """

    job_id: str
    owner: str
    generation: int
    reason: RefusalReason
    current_owner: str | None = None
    current_generation: int | None = None

    def error(self, action: str = "renew") -> LeaseLost:
        """A :class:`LeaseLost` describing this refusal, ready to raise."""
        detail = {
            RefusalReason.MISSING: "the store has no record of the job",
            RefusalReason.SUPERSEDED: (f"generation {self.current_generation} now holds it"),
            RefusalReason.RELEASED: "the lease was released",
            RefusalReason.COMPLETED: (
                f"the job was completed by generation {self.current_generation}"
            ),
            RefusalReason.UNREADABLE: (
                "the store's record of the job is unreadable (not written by "
                "celery-leases); inspect it, then fix or delete it"
            ),
        }[self.reason]
        return LeaseLost(
            f"{action} of job {self.job_id!r} with generation {self.generation} "
            f"was refused: {detail}",
            job_id=self.job_id,
            owner=self.owner,
            generation=self.generation,
            reason=self.reason.value,
        )


@dataclass(frozen=True, slots=True)
class Renewed:
    """The renewal succeeded; the lease now runs until ``lease_until_ms``."""

    job_id: str
    generation: int
    lease_until_ms: int
    store_now_ms: int

    @property
    def lease_until(self) -> datetime:
        return ms_to_datetime(self.lease_until_ms)


@dataclass(frozen=True, slots=True)
class Completed:
    """The fenced completion was accepted."""

    job_id: str
    generation: int


@dataclass(frozen=True, slots=True)
class Released:
    """The lease was given up; the generation is kept."""

    job_id: str
    generation: int


RenewResult = Renewed | Refusal
CompleteResult = Completed | Refusal
ReleaseResult = Released | Refusal


@dataclass(frozen=True, slots=True)
class RenewRequest:
    """One lease to renew in a batched :meth:`LeaseStore.renew_many`."""

    job_id: str
    owner: str
    generation: int
    ttl: float


def unreadable(job_id: str, store: str, problem: str) -> LeaseRecordUnreadable:
    """The error for a record of ``job_id`` that cannot be read."""
    return LeaseRecordUnreadable(
        f"the lease record of job {job_id!r} in {store} is unreadable ({problem}); it was "
        "not written by celery-leases. Inspect it, then fix or delete it: until then "
        "the job cannot be claimed, renewed, completed or released.",
        job_id=job_id,
    )


def unreadable_refusal(job_id: str, owner: str, generation: int) -> Refusal:
    """The refusal of a batched renewal whose record cannot be read."""
    return Refusal(job_id, owner, generation, RefusalReason.UNREADABLE)


def refusal_for(record: LeaseRecord | None, job_id: str, owner: str, generation: int) -> Refusal:
    """Describe why an operation by (``owner``, ``generation``) was refused.

    Used by stores after a conditional write matched nothing.
    """
    if record is None:
        reason = RefusalReason.MISSING
    elif record.state is LeaseState.COMPLETED:
        reason = RefusalReason.COMPLETED
    elif record.state is LeaseState.RELEASED and record.generation == generation:
        reason = RefusalReason.RELEASED
    else:
        reason = RefusalReason.SUPERSEDED
    return Refusal(
        job_id=job_id,
        owner=owner,
        generation=generation,
        reason=reason,
        current_owner=record.owner if record else None,
        current_generation=record.generation if record else None,
    )
