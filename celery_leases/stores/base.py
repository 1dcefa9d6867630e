"""The lease store contract: the record, the results, and the base class.

A store implements a handful of atomic primitives (``_claim``, ``_renew``,
...); the argument checks and the rules above them live here, once. All
times inside a store are integer milliseconds since the Unix epoch on the
**store's** clock; a worker's clock is never compared with them.

Generations (fencing tokens). Every claim takes ``max(previous + 1, store
clock in milliseconds)``; a job without a record starts at the clock. A
store that lost its last writes (a restart from an older file, a promoted
replica) or purged a finished record therefore still hands out generations
above every one it handed out before (invariant I1), as long as its clock
did not step back across the loss by more than the loss took to recover
(docs/guarantees.md states the condition exactly). Generations stay far
below 2**53, so Lua numbers and JSON keep them exact.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterator, Sequence

from celery_leases.errors import LeaseConfigurationError, LeaseRecordUnreadable
from celery_leases.redact import mask
from celery_leases.stores.checks import (
    MAX_OUTCOME_BYTES,
    MAX_TTL,
    MIN_RETENTION,
    REASON_LIMIT,
    check_generation,
    check_job_id,
    check_outcome,
    check_owner,
    check_retention,
    check_text,
    ttl_to_ms,
)
from celery_leases.stores.queued import QueuedMark
from celery_leases.stores.results import (
    TASK_ID_SEND_PREFIX,
    Acquired,
    AlreadyCompleted,
    ClaimResult,
    Completed,
    CompleteResult,
    HeldElsewhere,
    LeaseRecord,
    LeaseState,
    Refusal,
    RefusalReason,
    Released,
    ReleaseResult,
    Renewed,
    RenewRequest,
    RenewResult,
    ms_to_datetime,
    refusal_for,
    unreadable,
    unreadable_refusal,
)
from celery_leases.stores.waiters import MAX_WAITERS, Waiter, check_payload
from celery_leases.values import is_whole

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
    "TASK_ID_SEND_PREFIX",
    "Renewed",
    "MAX_OUTCOME_BYTES",
    "MAX_TTL",
    "MAX_WAITERS",
    "MIN_RETENTION",
    "QueuedMark",
    "Waiter",
    "ms_to_datetime",
    "refusal_for",
    "ttl_to_ms",
    "unreadable",
    "unreadable_refusal",
]

logger = logging.getLogger("celery_leases.stores")


# --- argument checks ---------------------------------------------------------


def _check_state(state: object) -> LeaseState | None:
    if state is None or isinstance(state, LeaseState):
        return state
    if isinstance(state, str):
        try:
            return LeaseState(state)
        except ValueError:
            pass
    choices = ", ".join(repr(s.value) for s in LeaseState)
    raise LeaseConfigurationError(f"state must be a LeaseState or one of {choices}, got {state!r}")


def _check_send_id(send_id: object) -> str | None:
    return None if send_id is None else check_text(send_id, "send_id", empty=True)


class LeaseStore(abc.ABC):
    """Base class of every lease store.

    Public methods check their arguments, then call the backend hook of the
    same name with a leading underscore. Each hook is one atomic operation
    in the store, in one round trip. It wraps driver errors that mean the
    store cannot be reached in :class:`~celery_leases.errors.StoreUnavailable`,
    and the permanent ones (credentials, rights, a value the store cannot
    keep) in :class:`~celery_leases.errors.LeaseConfigurationError`. A record
    it cannot read raises :class:`~celery_leases.errors.LeaseRecordUnreadable`
    (a refusal with reason ``UNREADABLE`` in :meth:`renew_many`).
    """

    #: the URL scheme(s) this store was opened from, for messages
    url: str = ""

    @property
    def renews_outside_the_hub(self) -> bool:
        """Whether :meth:`renew_many` waits in its own OS thread under gevent
        or eventlet monkey-patching (never in the hub a task greenlet may hold).

        The worker refuses a green pool with a store that cannot.
        """
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {mask(self.url)}>"

    # -- public API ---------------------------------------------------------

    def claim(
        self,
        job_id: str,
        owner: str,
        ttl: float,
        *,
        task_name: str = "",
        send_id: str | None = None,
        task_id: str | None = None,
    ) -> ClaimResult:
        """Claim the lease on ``job_id`` for ``owner`` for ``ttl`` seconds.

        Succeeds if there is no record, it is released, or its lease has run
        out by the store's clock (at ``lease_until`` exactly, it has); the
        generation then goes up by one. A completed record answers
        :class:`AlreadyCompleted` when the claim is of the run that
        completed it (:meth:`LeaseRecord.is_same_run`): ``send_id`` is
        ``None``, the send id it was completed under (a redelivery of the
        same send), or ``task:<task id>`` (a message without a send id) with
        the ``task_id`` of the delivery that completed it. Any other
        ``send_id`` is a new run of the job and is acquired like a released
        record (takeovers start again at 0, the completion and its outcome
        are cleared). The record keeps ``send_id`` and ``task_id`` ("" for
        ``None``).

        Returns:
            :class:`Acquired`, :class:`HeldElsewhere` or :class:`AlreadyCompleted`.

        Raises:
            StoreUnavailable: the store could not be asked; no lease was given.
            LeaseConfigurationError: an argument is invalid, or the store
                refused for good (credentials, rights).
            LeaseRecordUnreadable: the job's record cannot be read.
        """
        return self._claim(
            check_job_id(job_id),
            check_owner(owner),
            ttl_to_ms(ttl),
            check_text(task_name, "task_name", empty=True),
            _check_send_id(send_id),
            "" if task_id is None else check_text(task_id, "task_id", empty=True),
        )

    def renew(self, job_id: str, owner: str, generation: int, ttl: float) -> RenewResult:
        """Extend the lease to ``ttl`` seconds from now (store clock).

        Succeeds only if ``owner`` and ``generation`` still match and the job
        is not completed. A lease that ran out but that nobody claimed since
        can still be renewed.
        """
        return self._renew(
            check_job_id(job_id), check_owner(owner), check_generation(generation), ttl_to_ms(ttl)
        )

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """Renew many leases in one round trip; results are in request order.

        A job whose record cannot be read gets a :class:`Refusal` with reason
        ``UNREADABLE``; the others are answered as usual.
        """
        checked = list(requests)
        # a worker's leases share one owner and mostly one ttl: check each once
        owners: set[str] = set()
        ttls: set[float] = set()
        for r in checked:
            check_job_id(r.job_id)
            check_generation(r.generation)
            if type(r.owner) is not str or r.owner not in owners:
                owners.add(check_owner(r.owner))
            if type(r.ttl) not in (int, float) or r.ttl not in ttls:
                ttl_to_ms(r.ttl)
                ttls.add(r.ttl)
        if not checked:
            return []
        return self._renew_many(checked)

    def complete(
        self, job_id: str, owner: str, generation: int, *, outcome: bytes | None = None
    ) -> CompleteResult:
        """Mark the job completed, fenced by ``owner`` and ``generation``.

        ``outcome`` (at most :data:`MAX_OUTCOME_BYTES`) is stored with the
        completion, in the same atomic write. The record keeps its
        generation; a stale completion is refused.

        A completion whose reply was lost is judged by the record (protocol
        rule 6): when the store refuses because the job is completed *by
        this owner and generation*, the first try was applied and this
        returns :class:`Completed`::

            worker               store
            complete(g7) ----->  completed by (A, 7)
                 x<-------------  reply lost: StoreUnavailable
            complete(g7) ----->  refused: completed by (A, 7)
            -> Completed
        """
        result = self._complete(
            check_job_id(job_id),
            check_owner(owner),
            check_generation(generation),
            check_outcome(outcome),
        )
        if (
            isinstance(result, Refusal)
            and result.reason is RefusalReason.COMPLETED
            and result.current_owner == owner
            and result.current_generation == generation
        ):
            return Completed(job_id, generation)
        return result

    def release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        """Give the lease up without completing; the generation is kept."""
        return self._release(check_job_id(job_id), check_owner(owner), check_generation(generation))

    def force_release(self, job_id: str, *, by: str, reason: str) -> LeaseRecord:
        """Release the job's lease whoever holds it: an operator's action.

        Atomically, on the store's clock: the generation goes up by one (so
        the holder, if any, is fenced out of every renew, complete and
        fenced write), the state becomes released, the owner "", the lease
        ends now, and the record keeps ``by``, ``reason`` and the time.

        Returns:
            The record as it is after the release.

        Raises:
            LeaseConfigurationError: there is no record for the job, or the
                job is completed (its record is left as it is), or ``by`` /
                ``reason`` cannot be stored.
            LeaseRecordUnreadable: the job's record cannot be read.
            StoreUnavailable: the store could not be asked.
        """
        job_id = check_job_id(job_id)
        by = check_text(by, "by")
        reason = check_text(reason, "reason", empty=True, limit=REASON_LIMIT)
        record = self._force_release(job_id, by, reason)
        if record is None:
            raise LeaseConfigurationError(
                f"no lease record for job {job_id!r} in {self.url}: nothing to release",
                job_id=job_id,
            )
        if record.state is LeaseState.COMPLETED:
            raise LeaseConfigurationError(
                f"job {job_id!r} is completed (generation {record.generation}); a "
                "completed job is not released. Its record is kept as it is.",
                job_id=job_id,
                generation=record.generation,
            )
        return record

    def get(self, job_id: str) -> LeaseRecord | None:
        """The record of ``job_id``, or ``None`` when there is none.

        Raises:
            LeaseRecordUnreadable: the job's record cannot be read.
        """
        return self._get(check_job_id(job_id))

    def records(
        self, *, state: LeaseState | str | None = None, limit: int | None = None
    ) -> Iterator[LeaseRecord]:
        """Iterate over records, optionally only those in ``state``.

        ``state`` is a :class:`LeaseState` or its value (``"held"``, ...);
        the arguments are checked at the call, before iterating. A record
        that cannot be read is skipped with a logged warning. Not a
        snapshot: records changed during the iteration may or may not be
        seen in their new form.
        """
        wanted = _check_state(state)
        if limit is not None and not is_whole(limit, 0):
            raise LeaseConfigurationError(f"limit must be an integer >= 0, got {limit!r}")
        return self._readable_records(wanted, limit)

    def _readable_records(
        self, state: LeaseState | None, limit: int | None
    ) -> Iterator[LeaseRecord]:
        if limit == 0:
            return
        count = 0
        for record in self._records(state):
            if isinstance(record, LeaseRecordUnreadable):
                logger.warning(
                    "skipping the unreadable lease record of job %r in %s: %s",
                    record.job_id,
                    self.url,
                    record,
                )
                continue
            yield record
            count += 1
            if limit is not None and count >= limit:
                return

    def purge(self, older_than: float) -> int:
        """Delete completed and released records older than ``older_than`` s.

        A record's age counts from its completion or release. A record made
        again later starts at the store's clock, above the deleted one's
        generation (I1). ``older_than`` is at least :data:`MIN_RETENTION`: a
        late duplicate must still find a job completed.

        Returns:
            How many records were deleted.
        """
        return self._purge(check_retention(older_than))

    def now_ms(self) -> int:
        """The store's clock, in milliseconds since the epoch."""
        return self._now_ms()

    # -- queued marks (``lease_queue_unique``) -------------------------------

    def mark_queued(self, job_id: str, task_id: str, ttl: float) -> QueuedMark:
        """Mark ``job_id`` as having the message ``task_id`` queued, for
        ``ttl`` seconds, unless a mark of another task id that has not run
        out is there. A live mark of ``task_id`` itself runs out ``ttl``
        seconds from now instead (its ``queued_at`` is kept).

        Atomic: of many senders at once, one places its mark and the
        others get it. The mark lives apart from the lease record, which it
        never changes.

        Returns:
            The live mark after the call: this one (its ``task_id`` is the
            one passed) or the one that was there.

        Raises:
            StoreUnavailable: the store could not be asked; whether the mark
                was placed is unknown (it runs out after ``ttl``).
            LeaseConfigurationError: an argument is invalid.
        """
        return self._mark_queued(
            check_job_id(job_id), check_text(task_id, "task_id"), ttl_to_ms(ttl)
        )

    def extend_queued(self, job_id: str, task_id: str, ttl: float) -> QueuedMark | None:
        """Make the live mark of ``task_id`` run out ``ttl`` seconds from now
        (its ``queued_at`` is kept); place none.

        A sender marks for a short while, publishes, then extends its mark:
        by then the run may have claimed the job and taken the mark away,
        and the key must stay free, so a mark that is gone stays gone.

        Returns:
            The live mark after the call: this one, extended; another task
            id's (this one ran out and another sender marked); or ``None``.

        Raises:
            StoreUnavailable: the store could not be asked.
            LeaseConfigurationError: an argument is invalid.
        """
        return self._extend_queued(
            check_job_id(job_id), check_text(task_id, "task_id"), ttl_to_ms(ttl)
        )

    def unmark_queued(self, job_id: str, task_id: str) -> bool:
        """Take the mark of ``job_id`` away if it names ``task_id``.

        Returns:
            Whether a mark of ``task_id`` was taken away (a mark of another
            task id is left as it is).
        """
        return self._unmark_queued(check_job_id(job_id), check_text(task_id, "task_id"))

    def queued(self, job_id: str) -> QueuedMark | None:
        """The mark of ``job_id`` that has not run out, or ``None``."""
        return self._queued(check_job_id(job_id))

    # -- waiters (``lease_on_busy="wait"``) -----------------------------------

    def add_waiter(
        self, job_id: str, send_id: str, task_id: str, payload: bytes, ttl: float
    ) -> bool:
        """Register the send ``send_id`` as a waiter of ``job_id`` for ``ttl``
        seconds, keeping ``payload`` (at most :data:`MAX_WAITER_BYTES`).

        A live entry of the same send is replaced (a redelivery, or a copy
        that waits again). Entries that ran out may be swept on the way.
        An empty ``payload`` makes the entry a *mark*: :meth:`waiters`
        reads it, :meth:`take_waiters` leaves it.

        Returns:
            Whether the send is registered: False when the job has
            :data:`MAX_WAITERS` live waiters of other sends already (the
            bound is kept exactly by Redis, SQLite and the memory store,
            and within a few entries by concurrent senders elsewhere).

        Raises:
            StoreUnavailable: the store could not be asked; whether the
                entry was placed is unknown (it runs out after ``ttl``).
            LeaseConfigurationError: an argument is invalid, or the
                waiters' table is missing (SQL).
        """
        return self._add_waiter(
            check_job_id(job_id),
            check_text(send_id, "send_id"),
            check_text(task_id, "task_id", empty=True),
            check_payload(payload),
            ttl_to_ms(ttl),
        )

    def take_waiters(self, job_id: str) -> list[Waiter]:
        """Delete the waiters of ``job_id`` and return the live ones, in
        the order they registered; atomic: of two callers at once, each
        entry goes to one. An entry with an empty payload is a *mark* (see
        :meth:`add_waiter`): it is left, and runs out by itself.

        Raises:
            StoreUnavailable: the store could not be asked; whether the
                entries were taken is unknown (if so, they are lost, and
                their sends' fallback copies claim the job instead).
        """
        return self._take_waiters(check_job_id(job_id))

    def waiters(self, job_id: str) -> list[Waiter]:
        """The live waiters of ``job_id``, in the order they registered; a read."""
        return self._waiters(check_job_id(job_id))

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release connections held by the store."""

    def __enter__(self) -> LeaseStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- backend hooks ------------------------------------------------------

    @abc.abstractmethod
    def _claim(
        self,
        job_id: str,
        owner: str,
        ttl_ms: int,
        task_name: str,
        send_id: str | None,
        task_id: str,
    ) -> ClaimResult: ...

    @abc.abstractmethod
    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult: ...

    @abc.abstractmethod
    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]: ...

    @abc.abstractmethod
    def _complete(
        self, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult: ...

    @abc.abstractmethod
    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult: ...

    @abc.abstractmethod
    def _force_release(self, job_id: str, by: str, reason: str) -> LeaseRecord | None:
        """Release as :meth:`force_release` does; ``None`` when there is no
        record, the record untouched when it is completed."""

    @abc.abstractmethod
    def _get(self, job_id: str) -> LeaseRecord | None: ...

    @abc.abstractmethod
    def _records(self, state: LeaseState | None) -> Iterator[LeaseRecord | LeaseRecordUnreadable]:
        """Records (in ``state``), and an error in place of each unreadable one."""

    @abc.abstractmethod
    def _purge(self, older_than_ms: int) -> int: ...

    @abc.abstractmethod
    def _now_ms(self) -> int: ...

    @abc.abstractmethod
    def _mark_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark: ...

    @abc.abstractmethod
    def _extend_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark | None: ...

    @abc.abstractmethod
    def _unmark_queued(self, job_id: str, task_id: str) -> bool: ...

    @abc.abstractmethod
    def _queued(self, job_id: str) -> QueuedMark | None: ...

    @abc.abstractmethod
    def _add_waiter(
        self, job_id: str, send_id: str, task_id: str, payload: bytes, ttl_ms: int
    ) -> bool:
        """Register as :meth:`add_waiter` does, keeping at most
        :data:`MAX_WAITERS` live entries of other sends."""

    @abc.abstractmethod
    def _take_waiters(self, job_id: str) -> list[Waiter]: ...

    @abc.abstractmethod
    def _waiters(self, job_id: str) -> list[Waiter]: ...
