"""A lease store that records every operation in the history, and the
broken store variants the checker must catch.

:class:`RecordingStore` wraps the real store of a worker process. Each
backend hook writes a ``call`` record before the request is sent and a
``result`` (or ``error``) record after the answer came back, so the
checker sees every claim, renew, complete and release with its interval
on the host's monotonic clock. The variants below change what the store
does, the way a buggy lock library would; they exist only in this harness.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from celery_leases import (
    Acquired,
    Completed,
    LeaseRecord,
    LeaseState,
    LeaseStore,
    Renewed,
    RenewRequest,
)
from celery_leases.errors import LeaseRecordUnreadable
from celery_leases.stores.base import (
    ClaimResult,
    CompleteResult,
    QueuedMark,
    ReleaseResult,
    RenewResult,
    Waiter,
)
from celery_leases.stores.checks import ttl_to_ms
from chaos.history import History

__all__ = ["STORE_VARIANTS", "RecordingStore"]

#: variants that change the store's behaviour
STORE_VARIANTS = frozenset(
    {
        "complete-without-generation",
        "renew-without-owner",
        "expiring-generation",
        "worker-clock-claim",
    }
)

R = TypeVar("R")


def _describe(result: object) -> dict[str, Any]:
    if not dataclasses.is_dataclass(result) or isinstance(result, type):
        return {"type": type(result).__name__}
    fields = dataclasses.asdict(result)
    fields.pop("outcome", None)
    return {"type": type(result).__name__, **{k: v for k, v in fields.items() if k != "job_id"}}


class RecordingStore(LeaseStore):
    """Delegates to ``inner``, recording each operation; ``variant`` breaks it on purpose.

    Args:
        inner: the real store.
        history: where records go.
        variant: one of :data:`STORE_VARIANTS`, or "" for the real behaviour.
        counter: for ``expiring-generation``, a function that returns the
            next number of an expiring per-job counter (job_id, ttl_ms).
    """

    def __init__(
        self,
        inner: LeaseStore,
        history: History,
        variant: str = "",
        counter: Callable[[str, int], int] | None = None,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.history = history
        self.variant = variant
        self._counter = counter
        # expiring-generation: (job, token handed out) -> generation in the store
        self._real: dict[tuple[str, int], int] = {}

    def _op(
        self, op: str, job_id: str, owner: str, generation: int | None, call: Callable[[], R]
    ) -> R:
        call_id = self.history.record("call", op=op, job=job_id, owner=owner, generation=generation)
        try:
            result = call()
        except Exception as exc:
            self.history.record("error", call=call_id, op=op, job=job_id, error=type(exc).__name__)
            raise
        self.history.record(
            "result", call=call_id, op=op, job=job_id, owner=owner, generation=generation,
            answer=_describe(result),
        )  # fmt: skip
        return result

    # -- expiring-generation: the token handed out is an expiring counter ----

    def _to_store(self, job_id: str, generation: int) -> int:
        return self._real.get((job_id, generation), generation)

    def _to_worker(self, job_id: str, result: R) -> R:
        if self.variant != "expiring-generation":
            return result
        for (job, token), real in list(self._real.items()):  # claims add meanwhile
            if job == job_id and getattr(result, "generation", None) == real:
                return dataclasses.replace(result, generation=token)  # type: ignore[type-var]
        return result

    # -- hooks ----------------------------------------------------------------

    def _claim(
        self,
        job_id: str,
        owner: str,
        ttl_ms: int,
        task_name: str,
        send_id: str | None,
        task_id: str,
    ) -> ClaimResult:
        def claim() -> ClaimResult:
            if self.variant == "worker-clock-claim":
                self._expire_by_worker_clock(job_id)
            result = self.inner._claim(job_id, owner, ttl_ms, task_name, send_id, task_id)
            if self.variant == "expiring-generation" and isinstance(result, Acquired):
                assert self._counter is not None
                token = self._counter(job_id, ttl_ms)
                self._real[(job_id, token)] = result.generation
                return dataclasses.replace(result, generation=token)
            return result

        return self._op("claim", job_id, owner, None, claim)

    def _expire_by_worker_clock(self, job_id: str) -> None:
        # the bug: "has the lease run out?" asked of this worker's wall clock
        record = self.inner._get(job_id)
        if (
            record is not None
            and record.state is LeaseState.HELD
            and record.lease_until_ms <= time.time() * 1000
        ):
            self.inner._force_release(job_id, "worker-clock", "expired by the worker's clock")

    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        def renew() -> RenewResult:
            if self.variant == "renew-without-owner":
                record = self.inner._get(job_id)
                if record is not None and record.state is LeaseState.HELD:
                    result = self.inner._renew(job_id, record.owner, record.generation, ttl_ms)
                    if isinstance(result, Renewed):
                        return dataclasses.replace(result, generation=generation)
                    return result
            real = self._to_store(job_id, generation)
            return self._to_worker(job_id, self.inner._renew(job_id, owner, real, ttl_ms))

        return self._op("renew", job_id, owner, generation, renew)

    @property
    def renews_outside_the_hub(self) -> bool:
        """The real store's answer: its :meth:`_renew_many` is the one sent.

        ``renew-without-owner`` renews each request on the task client, so
        it cannot renew outside a green pool's hub.
        """
        return self.variant != "renew-without-owner" and self.inner.renews_outside_the_hub

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """The real store's one round trip (under gevent or eventlet, on its
        unpatched renewal connections), recorded as one renew per request
        that all share the batch's interval.

        The heartbeat calls it from its own thread (an OS thread under
        monkey-patching): :class:`~chaos.history.History` takes only an OS
        lock and writes with ``os.write``, so nothing here waits in the hub.
        """
        if self.variant == "renew-without-owner":
            # one round trip per request, each reading the record first
            return [
                self._renew(r.job_id, r.owner, r.generation, ttl_to_ms(r.ttl)) for r in requests
            ]
        calls = [
            self.history.record(
                "call", op="renew", job=r.job_id, owner=r.owner, generation=r.generation
            )
            for r in requests
        ]
        sent = [
            dataclasses.replace(r, generation=self._to_store(r.job_id, r.generation))
            for r in requests
        ]
        try:
            results = [
                self._to_worker(r.job_id, result)
                for r, result in zip(requests, self.inner._renew_many(sent), strict=True)
            ]
        except Exception as exc:
            for call_id, r in zip(calls, requests, strict=True):
                self.history.record(
                    "error", call=call_id, op="renew", job=r.job_id, error=type(exc).__name__
                )
            raise
        for call_id, r, result in zip(calls, requests, results, strict=True):
            self.history.record(
                "result", call=call_id, op="renew", job=r.job_id, owner=r.owner,
                generation=r.generation, answer=_describe(result),
            )  # fmt: skip
        return results

    def _complete(
        self, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        def complete() -> CompleteResult:
            if self.variant == "complete-without-generation":
                record = self.inner._get(job_id)
                if record is not None and record.state is LeaseState.HELD:
                    result = self.inner._complete(job_id, record.owner, record.generation, outcome)
                    if isinstance(result, Completed):
                        return Completed(job_id, generation)
                    return result
            real = self._to_store(job_id, generation)
            return self._to_worker(job_id, self.inner._complete(job_id, owner, real, outcome))

        return self._op("complete", job_id, owner, generation, complete)

    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        real = self._to_store(job_id, generation)
        return self._op(
            "release", job_id, owner, generation,
            lambda: self._to_worker(job_id, self.inner._release(job_id, owner, real)),
        )  # fmt: skip

    # -- exactly_once: the SQL store's statements on the task's connection ------

    @property
    def table(self) -> Any:
        return getattr(self.inner, "table")  # noqa: B009  # only a SqlStore has one

    @property
    def dialect_name(self) -> str:
        return str(getattr(self.inner, "dialect_name"))  # noqa: B009

    def lock_in(self, conn: Any, job_id: str, owner: str, generation: int) -> bool:
        inner: Any = self.inner
        return self._op(
            "lock-in-transaction", job_id, owner, generation,
            lambda: bool(inner.lock_in(conn, job_id, owner, generation)),
        )  # fmt: skip

    def complete_in(
        self, conn: Any, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        # recorded apart from "complete": it counts only if its transaction
        # commits, which the effects table shows
        inner: Any = self.inner

        def complete() -> CompleteResult:
            result: CompleteResult = inner.complete_in(conn, job_id, owner, generation, outcome)
            return result

        return self._op("complete-in-transaction", job_id, owner, generation, complete)

    def _force_release(self, job_id: str, by: str, reason: str) -> LeaseRecord | None:
        return self.inner._force_release(job_id, by, reason)

    def _get(self, job_id: str) -> LeaseRecord | None:
        return self.inner._get(job_id)

    def _records(self, state: LeaseState | None) -> Iterator[LeaseRecord | LeaseRecordUnreadable]:
        return self.inner._records(state)

    def _purge(self, older_than_ms: int) -> int:
        return self.inner._purge(older_than_ms)

    def _now_ms(self) -> int:
        return self.inner._now_ms()

    def _mark_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark:
        return self.inner.mark_queued(job_id, task_id, ttl_ms / 1000)

    def _extend_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark | None:
        return self.inner.extend_queued(job_id, task_id, ttl_ms / 1000)

    def _unmark_queued(self, job_id: str, task_id: str) -> bool:
        return self.inner.unmark_queued(job_id, task_id)

    def _queued(self, job_id: str) -> QueuedMark | None:
        return self.inner.queued(job_id)

    def _add_waiter(
        self, job_id: str, send_id: str, task_id: str, payload: bytes, ttl_ms: int
    ) -> bool:
        return self.inner.add_waiter(job_id, send_id, task_id, payload, ttl_ms / 1000)

    def _take_waiters(self, job_id: str) -> list[Waiter]:
        return self.inner.take_waiters(job_id)

    def _waiters(self, job_id: str) -> list[Waiter]:
        return self.inner.waiters(job_id)

    def close(self) -> None:
        self.inner.close()
