"""An in-process lease store, **a testing aid only**.

It keeps records in a dict guarded by a lock, in one process. Two worker
processes never share it, so it cannot protect a real deployment; use it for
unit tests and eager-mode tests. Its clock is injectable, so tests can make
time pass without sleeping.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

from celery_leases import unpatched
from celery_leases.errors import LeaseRecordUnreadable
from celery_leases.stores.base import (
    MAX_WAITERS,
    Acquired,
    AlreadyCompleted,
    ClaimResult,
    Completed,
    CompleteResult,
    HeldElsewhere,
    LeaseRecord,
    LeaseState,
    LeaseStore,
    QueuedMark,
    Released,
    ReleaseResult,
    Renewed,
    RenewRequest,
    RenewResult,
    Waiter,
    refusal_for,
    ttl_to_ms,
)

__all__ = ["MemoryStore", "ManualClock"]


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class ManualClock:
    """A clock for tests: starts at ``start_ms`` and moves only when told."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = start_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now_ms += round(seconds * 1000)


class MemoryStore(LeaseStore):
    """Lease store in a dict, for tests. Not shared between processes.

    Args:
        clock: returns the store's time in integer milliseconds since the
            epoch; defaults to the wall clock. Pass a :class:`ManualClock`
            to control time in tests.
    """

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        self.url = "memory://"
        self._clock = clock or _wall_clock_ms
        self._lock = unpatched.lock()  # the heartbeat's OS threads take it too
        self._data: dict[str, LeaseRecord] = {}
        self._marks: dict[str, QueuedMark] = {}
        self._waiting: dict[str, dict[str, Waiter]] = {}

    @property
    def renews_outside_the_hub(self) -> bool:
        return True  # no I/O: a renewal only takes an OS lock

    def _now_ms(self) -> int:
        return self._clock()

    def _claim(
        self,
        job_id: str,
        owner: str,
        ttl_ms: int,
        task_name: str,
        send_id: str | None,
        task_id: str,
    ) -> ClaimResult:
        with self._lock:
            now = self._clock()
            record = self._data.get(job_id)
            takeovers = 0
            if record is None:
                generation = now
            elif record.state is LeaseState.COMPLETED:
                if record.is_same_run(send_id):
                    return AlreadyCompleted(
                        job_id, record.generation, record.send_id, record.outcome
                    )
                # a new send of a completed job: a new run
                generation = max(record.generation + 1, now)
            elif record.is_live(now):
                return HeldElsewhere(
                    job_id, record.owner, record.generation, (record.lease_until_ms - now) / 1000
                )
            else:
                generation = max(record.generation + 1, now)
                # a held record whose lease ran out: its holder died or stalled
                takeovers = record.takeovers + (record.state is LeaseState.HELD)
            self._data[job_id] = LeaseRecord(
                job_id=job_id,
                owner=owner,
                generation=generation,
                lease_until_ms=now + ttl_ms,
                state=LeaseState.HELD,
                task_name=task_name,
                claimed_at_ms=now,
                renew_count=0,
                takeovers=takeovers,
                send_id=send_id or "",
                task_id=task_id,
            )
            return Acquired(job_id, owner, generation, now + ttl_ms, now, takeovers)

    def _matching(self, job_id: str, owner: str, generation: int) -> LeaseRecord | None:
        record = self._data.get(job_id)
        if (
            record is not None
            and record.owner == owner
            and record.generation == generation
            and record.state is LeaseState.HELD
        ):
            return record
        return None

    def _renew_locked(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        record = self._matching(job_id, owner, generation)
        if record is None:
            return refusal_for(self._data.get(job_id), job_id, owner, generation)
        now = self._clock()
        self._data[job_id] = dataclasses.replace(
            record,
            lease_until_ms=now + ttl_ms,
            renewed_at_ms=now,
            renew_count=record.renew_count + 1,
        )
        return Renewed(job_id, generation, now + ttl_ms, now)

    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        with self._lock:
            return self._renew_locked(job_id, owner, generation, ttl_ms)

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        with self._lock:
            return [
                self._renew_locked(r.job_id, r.owner, r.generation, ttl_to_ms(r.ttl))
                for r in requests
            ]

    def _complete(
        self, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        with self._lock:
            record = self._matching(job_id, owner, generation)
            if record is None:
                return refusal_for(self._data.get(job_id), job_id, owner, generation)
            self._data[job_id] = dataclasses.replace(
                record,
                state=LeaseState.COMPLETED,
                completed_at_ms=self._clock(),
                outcome=outcome,
            )
            return Completed(job_id, generation)

    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        with self._lock:
            record = self._matching(job_id, owner, generation)
            if record is None:
                return refusal_for(self._data.get(job_id), job_id, owner, generation)
            now = self._clock()
            self._data[job_id] = dataclasses.replace(
                record, state=LeaseState.RELEASED, owner="", lease_until_ms=now, released_at_ms=now
            )
            return Released(job_id, generation)

    def _force_release(self, job_id: str, by: str, reason: str) -> LeaseRecord | None:
        with self._lock:
            record = self._data.get(job_id)
            if record is None or record.state is LeaseState.COMPLETED:
                return record
            now = self._clock()
            released = dataclasses.replace(
                record,
                generation=record.generation + 1,
                state=LeaseState.RELEASED,
                owner="",
                lease_until_ms=now,
                released_at_ms=now,
                released_by=by,
                release_reason=reason,
            )
            self._data[job_id] = released
            return released

    def _get(self, job_id: str) -> LeaseRecord | None:
        with self._lock:
            return self._data.get(job_id)

    def _records(self, state: LeaseState | None) -> Iterator[LeaseRecord | LeaseRecordUnreadable]:
        with self._lock:
            snapshot = list(self._data.values())
        return iter([r for r in snapshot if state is None or r.state is state])

    def _purge(self, older_than_ms: int) -> int:
        with self._lock:
            now = self._clock()
            doomed = [
                job_id
                for job_id, r in self._data.items()
                if (finished := _finished_at(r)) is not None and finished <= now - older_than_ms
            ]
            for job_id in doomed:
                del self._data[job_id]
            for job_id in list(self._waiting):
                self._live_waiters(job_id, now)
            return len(doomed)

    def _live_mark(self, job_id: str, now: int) -> QueuedMark | None:
        mark = self._marks.get(job_id)
        return mark if mark is not None and mark.queued_until_ms > now else None

    def _mark_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark:
        with self._lock:
            now = self._clock()
            mark = self._live_mark(job_id, now)
            if mark is None:
                mark = self._marks[job_id] = QueuedMark(job_id, task_id, now, now + ttl_ms)
            elif mark.task_id == task_id:
                mark = self._marks[job_id] = dataclasses.replace(mark, queued_until_ms=now + ttl_ms)
            return mark

    def _extend_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark | None:
        with self._lock:
            now = self._clock()
            mark = self._live_mark(job_id, now)
            if mark is not None and mark.task_id == task_id:
                mark = self._marks[job_id] = dataclasses.replace(mark, queued_until_ms=now + ttl_ms)
            return mark

    def _unmark_queued(self, job_id: str, task_id: str) -> bool:
        with self._lock:
            mark = self._marks.get(job_id)
            if mark is None or mark.task_id != task_id:
                return False
            del self._marks[job_id]
            return mark.queued_until_ms > self._clock()

    def _queued(self, job_id: str) -> QueuedMark | None:
        with self._lock:
            return self._live_mark(job_id, self._clock())

    def _live_waiters(self, job_id: str, now: int) -> dict[str, Waiter]:
        """The job's live entries, those that ran out swept (lock held)."""
        entries = {
            send_id: waiter
            for send_id, waiter in self._waiting.pop(job_id, {}).items()
            if waiter.waiting_until_ms > now
        }
        if entries:
            self._waiting[job_id] = entries
        return entries

    def _add_waiter(
        self, job_id: str, send_id: str, task_id: str, payload: bytes, ttl_ms: int
    ) -> bool:
        with self._lock:
            now = self._clock()
            entries = self._live_waiters(job_id, now)
            if len(entries.keys() - {send_id}) >= MAX_WAITERS:
                return False
            entries.pop(send_id, None)  # a new registration goes last
            entries[send_id] = Waiter(job_id, send_id, task_id, payload, now, now + ttl_ms)
            self._waiting[job_id] = entries
            return True

    def _take_waiters(self, job_id: str) -> list[Waiter]:
        with self._lock:
            entries = self._live_waiters(job_id, self._clock())
            marks = {key: w for key, w in entries.items() if w.is_mark}
            self._waiting.pop(job_id, None)
            if marks:
                self._waiting[job_id] = marks
            return [w for w in entries.values() if not w.is_mark]

    def _waiters(self, job_id: str) -> list[Waiter]:
        with self._lock:
            return list(self._live_waiters(job_id, self._clock()).values())


def _finished_at(record: LeaseRecord) -> int | None:
    """When a completed or released record finished, else ``None``."""
    if record.state is LeaseState.COMPLETED:
        return record.completed_at_ms
    if record.state is LeaseState.RELEASED:
        return record.released_at_ms
    return None
