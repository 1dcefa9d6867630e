"""The lease store contract: the record, the results, and the base class.

A store implements a handful of atomic primitives (``_claim``, ``_renew``,
...); the argument checks and the rules above them live here, once. All
times inside a store are integer milliseconds since the Unix epoch on the
**store's** clock; a worker's clock is never compared with them.

Generations (fencing tokens). The first claim of a job that has no record
gets the store's clock in milliseconds as its generation; every later claim
adds one. A completed record is purged only when it is older than the
retention period *and* its generation is below the store's clock at purge
time, so a record made again for the same job starts above every generation
the job ever had (invariant I1), as long as the store's clock does not step
back across the purge.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from celery_leases.errors import LeaseConfigurationError, LeaseLost

__all__ = [
    "Acquired",
    "AlreadyCompleted",
    "ClaimResult",
    "CompleteResult",
    "Completed",
    "HeldElsewhere",
    "LeaseRecord",
    "LeaseState",
    "LeaseStore",
    "Refusal",
    "RefusalReason",
    "ReleaseResult",
    "Released",
    "RenewRequest",
    "RenewResult",
    "Renewed",
    "MIN_RETENTION",
]

#: Completed records younger than this are never purged (seconds).
MIN_RETENTION = 60.0


def ms_to_datetime(ms: int) -> datetime:
    """Convert store milliseconds since the epoch to an aware UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


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

    @property
    def lease_until(self) -> datetime:
        """``lease_until`` as an aware UTC datetime."""
        return ms_to_datetime(self.lease_until_ms)

    def is_live(self, store_now_ms: int) -> bool:
        """Whether this record is an unexpired holder at ``store_now_ms``."""
        return self.state is LeaseState.HELD and self.lease_until_ms > store_now_ms


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
    """The job was completed (with ``generation``); it must not run again."""

    job_id: str
    generation: int


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


# --- argument checks -------------------------------------------------------


def _check_job_id(job_id: object) -> str:
    if not isinstance(job_id, str) or not job_id:
        raise LeaseConfigurationError(f"job_id must be a non-empty string, got {job_id!r}")
    if len(job_id) > 255:
        raise LeaseConfigurationError(
            f"job_id is {len(job_id)} characters long; the limit is 255. "
            "Derive a shorter key (for example a hash of the arguments)."
        )
    return job_id


def _check_owner(owner: object) -> str:
    if not isinstance(owner, str) or not owner:
        raise LeaseConfigurationError(f"owner must be a non-empty string, got {owner!r}")
    return owner


def _check_generation(generation: object) -> int:
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise LeaseConfigurationError(f"generation must be a positive integer, got {generation!r}")
    return generation


def ttl_to_ms(ttl: object) -> int:
    """Check a TTL in seconds and convert it to whole milliseconds (>= 1)."""
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, (int, float))
        or not math.isfinite(ttl)
        or ttl <= 0
    ):
        raise LeaseConfigurationError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return max(1, round(ttl * 1000))


class LeaseStore(abc.ABC):
    """Base class of every lease store.

    Public methods check their arguments, then call the backend hook of the
    same name with a leading underscore. Each hook is one atomic operation
    in the store, in one round trip, and wraps driver errors in
    :class:`~celery_leases.errors.StoreUnavailable`.
    """

    #: the URL scheme(s) this store was opened from, for messages
    url: str = ""

    # -- public API ---------------------------------------------------------

    def claim(self, job_id: str, owner: str, ttl: float, *, task_name: str = "") -> ClaimResult:
        """Claim the lease on ``job_id`` for ``owner`` for ``ttl`` seconds.

        Succeeds only if there is no record, it is released, or its lease has
        run out by the store's clock; the generation then goes up by one.

        Returns:
            :class:`Acquired`, :class:`HeldElsewhere` or :class:`AlreadyCompleted`.

        Raises:
            StoreUnavailable: the store could not be asked; no lease was given.
            LeaseConfigurationError: an argument is invalid.
        """
        return self._claim(
            _check_job_id(job_id), _check_owner(owner), ttl_to_ms(ttl), str(task_name)
        )

    def renew(self, job_id: str, owner: str, generation: int, ttl: float) -> RenewResult:
        """Extend the lease to ``ttl`` seconds from now (store clock).

        Succeeds only if ``owner`` and ``generation`` still match and the job
        is not completed. A lease that ran out but that nobody claimed since
        can still be renewed.
        """
        return self._renew(
            _check_job_id(job_id),
            _check_owner(owner),
            _check_generation(generation),
            ttl_to_ms(ttl),
        )

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """Renew many leases in one round trip; results are in request order."""
        checked = [
            RenewRequest(
                _check_job_id(r.job_id),
                _check_owner(r.owner),
                _check_generation(r.generation),
                r.ttl,
            )
            for r in requests
        ]
        for r in checked:
            ttl_to_ms(r.ttl)
        if not checked:
            return []
        return self._renew_many(checked)

    def complete(self, job_id: str, owner: str, generation: int) -> CompleteResult:
        """Mark the job completed, fenced by ``owner`` and ``generation``.

        The record keeps its generation; a stale completion is refused.
        """
        return self._complete(
            _check_job_id(job_id), _check_owner(owner), _check_generation(generation)
        )

    def release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        """Give the lease up without completing; the generation is kept."""
        return self._release(
            _check_job_id(job_id), _check_owner(owner), _check_generation(generation)
        )

    def get(self, job_id: str) -> LeaseRecord | None:
        """The record of ``job_id``, or ``None`` when there is none."""
        return self._get(_check_job_id(job_id))

    def records(
        self, *, state: LeaseState | None = None, limit: int | None = None
    ) -> Iterator[LeaseRecord]:
        """Iterate over records, optionally only those in ``state``.

        Not a snapshot: records changed during the iteration may or may not
        be seen in their new form.
        """
        if limit is not None and limit < 0:
            raise LeaseConfigurationError(f"limit must be >= 0, got {limit!r}")
        for count, record in enumerate(self._records(state)):
            if limit is not None and count >= limit:
                return
            yield record

    def purge_completed(self, older_than: float) -> int:
        """Delete completed records whose completion is older than ``older_than`` s.

        A record is kept while its generation is not below the store's clock
        in milliseconds, so a record made again later starts above it (I1).

        Returns:
            How many records were deleted.
        """
        if (
            isinstance(older_than, bool)
            or not isinstance(older_than, (int, float))
            or not math.isfinite(older_than)
            or older_than < MIN_RETENTION
        ):
            raise LeaseConfigurationError(
                f"older_than must be at least {MIN_RETENTION:g} seconds, got "
                f"{older_than!r}: a late duplicate must still find the job completed"
            )
        return self._purge_completed(round(older_than * 1000))

    def now_ms(self) -> int:
        """The store's clock, in milliseconds since the epoch."""
        return self._now_ms()

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release connections held by the store."""

    def __enter__(self) -> LeaseStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- backend hooks ------------------------------------------------------

    @abc.abstractmethod
    def _claim(self, job_id: str, owner: str, ttl_ms: int, task_name: str) -> ClaimResult: ...

    @abc.abstractmethod
    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult: ...

    @abc.abstractmethod
    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]: ...

    @abc.abstractmethod
    def _complete(self, job_id: str, owner: str, generation: int) -> CompleteResult: ...

    @abc.abstractmethod
    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult: ...

    @abc.abstractmethod
    def _get(self, job_id: str) -> LeaseRecord | None: ...

    @abc.abstractmethod
    def _records(self, state: LeaseState | None) -> Iterator[LeaseRecord]: ...

    @abc.abstractmethod
    def _purge_completed(self, older_than_ms: int) -> int: ...

    @abc.abstractmethod
    def _now_ms(self) -> int: ...


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
