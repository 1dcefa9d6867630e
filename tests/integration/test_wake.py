"""A waiting copy registers as a waiter and the holder's end wakes it.

A real Celery worker in this process (threads pool, two slots) on a real
redis-server broker; the lease store is the memory store, a real Redis or
SQLite store. The holder is a leased run in the same worker, held open by
an event the test sets.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_leases import LeasedTask, LeaseState, LeaseStore, StoreUnavailable
from celery_leases.stores.base import Waiter
from celery_leases.stores.waiters import MAX_WAITER_BYTES
from celery_leases.task import store_for
from celery_leases.waiting import POLL_INTERVAL
from tests.acceptance.harness import wait_until
from tests.integration.conftest import WAIT, Recorder, worker
from tests.integration.test_task_inprocess import store_url

pytestmark = pytest.mark.redis

#: the lease: far longer than any wait the tests allow, so only a wake
#: (not the lease running out) lets the waiting copy run in time
TTL = 30.0
#: how long the holder keeps the job after its copy registered
HOLD = 2.5


@pytest.fixture(params=["memory", "redis", "sqlite"])
def app(
    request: pytest.FixtureRequest,
    make_app: Callable[..., Celery],
    tmp_path: Path,
    unique: str,
) -> Celery:
    url, options = store_url(request.param, request, tmp_path, unique)
    app = make_app(url, leases_store_options=options, leases_ttl=TTL)
    app.conf.leases_defer_max = 60.0  # the fixture caps deferrals at 1 s
    return app


def _holding(app: Celery, recorder: Recorder, gates: dict[str, threading.Event]) -> Any:
    @app.task(shared=False, base=LeasedTask, bind=True, lease_key="wake-{key}")
    def hold(self: LeasedTask, key: str, gate: str) -> str:
        recorder.add("start", (self.request.id, time.monotonic()))
        if gate:
            assert gates[gate].wait(WAIT)
        recorder.add("done", (self.request.id, time.monotonic()))
        return self.request.id

    return hold


def _send_two(task: Any, recorder: Recorder, key: str) -> tuple[Any, Any]:
    """A holder held open by gate "a", then a second call that waits for it."""
    store = store_for(task.app)
    first = task.delay(key, "a")
    recorder.wait("start")
    second = task.delay(key, "")
    job_id = f"{task.lease_key.split('-')[0]}-{key}"
    wait_until(lambda: store.waiters(job_id), timeout=WAIT, message="a waiter")
    return first, second


def _waiting(store: LeaseStore, job_id: str) -> list[Waiter]:
    """The job's waiters, its marks left out."""
    return [w for w in store.waiters(job_id) if not w.is_mark]


def _deferred(recorder: Recorder, job_id: str) -> list[dict[str, Any]]:
    return [d for d in recorder.of("duplicate_deferred") if d["job_id"] == job_id]


def test_a_waiting_copy_registers_and_starts_right_after_the_holder_completes(
    app: Celery, recorder: Recorder
) -> None:
    gates = {"a": threading.Event()}
    hold = _holding(app, recorder, gates)
    store = store_for(app)
    with worker(app, pool="threads", concurrency=2):
        first, second = _send_two(hold, recorder, "k")
        [waiter] = store.waiters("wake-k")
        assert waiter.task_id == second.id
        time.sleep(HOLD)  # the holder's run goes on; the copy must not poll meanwhile
        gates["a"].set()
        assert first.get(timeout=WAIT) == first.id
        assert second.get(timeout=WAIT) == second.id
    (_, done), (_, started) = recorder.of("done")[0], recorder.of("start")[1]
    assert 0 <= started - done < TTL / 3  # woken, not the lease run out (30 s)
    # one fallback copy, due when the holder's lease would run out
    [fallback] = _deferred(recorder, "wake-k")
    assert fallback["countdown"] > TTL / 2
    # the waiter is gone; a mark of its send stays for its fallback copy
    [mark] = store.waiters("wake-k")
    assert mark.is_mark
    assert mark.task_id == second.id


def test_a_released_holder_wakes_its_waiting_copy(app: Celery, recorder: Recorder) -> None:
    gates = {"a": threading.Event()}

    @app.task(shared=False, base=LeasedTask, bind=True, lease_key="fail-{key}")
    def failing(self: LeasedTask, key: str, gate: str) -> str:
        recorder.add("start", (self.request.id, time.monotonic()))
        if gate:
            assert gates[gate].wait(WAIT)
            raise ValueError("the holder fails")
        return "ran"

    with worker(app, pool="threads", concurrency=2):
        first, second = _send_two(failing, recorder, "k")
        ended = time.monotonic()
        gates["a"].set()
        with pytest.raises(ValueError, match="the holder fails"):
            first.get(timeout=WAIT)
        assert second.get(timeout=WAIT) == "ran"
    assert recorder.of("start")[1][1] - ended < TTL / 3
    assert len(_deferred(recorder, "fail-k")) == 1


def test_a_store_down_at_registration_falls_back_to_looking_every_second(
    app: Celery, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_for(app)

    def down(*args: Any, **kwargs: Any) -> bool:
        raise StoreUnavailable("the store is down (test)")

    monkeypatch.setattr(store, "add_waiter", down)
    job_id = uuid.uuid4().hex
    holder = store.claim(job_id, "another-worker:1:abc", 1.5)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> str:
        return "ran"

    with worker(app):
        result = job.apply_async(task_id=job_id)
        deferred = recorder.wait("duplicate_deferred")
        assert deferred[0]["countdown"] <= POLL_INTERVAL
        assert result.get(timeout=WAIT) == "ran"  # the holder's lease ran out
    record = store.get(job_id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert record.generation > holder.generation  # type: ignore[union-attr]


def test_a_holder_that_ends_before_the_registration_lets_the_copy_look_again_at_once(
    app: Celery, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_for(app)
    job_id = uuid.uuid4().hex
    holder = store.claim(job_id, "another-worker:1:abc", TTL)
    register = store.add_waiter

    def ended_first(*args: Any, **kwargs: Any) -> bool:
        # the holder completes between the refused claim and the registration:
        # nobody wakes this waiter
        store.complete(job_id, "another-worker:1:abc", holder.generation)  # type: ignore[union-attr]
        return register(*args, **kwargs)

    monkeypatch.setattr(store, "add_waiter", ended_first)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> str:
        return "ran"

    with worker(app):
        result = job.apply_async(task_id=job_id, headers={"leases_send_id": "new-send"})
        deferred = recorder.wait("duplicate_deferred")
        assert deferred[0]["countdown"] < POLL_INTERVAL  # not the holder's whole lease
        assert result.get(timeout=WAIT) == "ran"


def test_a_woken_copy_that_finds_the_job_held_again_waits_without_a_second_fallback(
    app: Celery, recorder: Recorder
) -> None:
    gates = {"a": threading.Event(), "b": threading.Event()}
    hold = _holding(app, recorder, gates)
    store = store_for(app)
    with worker(app, pool="threads", concurrency=2):
        first = hold.delay("k", "a")
        recorder.wait("start")
        others = [hold.delay("k", "b"), hold.delay("k", "b")]
        wait_until(lambda: len(_waiting(store, "wake-k")) == 2, timeout=WAIT, message="2 waiters")
        gates["a"].set()
        # both are woken; one claims and holds the job on gate "b", the
        # other finds it held by another send and registers again
        recorder.wait("start", count=2)
        wait_until(lambda: len(_waiting(store, "wake-k")) == 1, timeout=WAIT, message="a waiter")
        gates["b"].set()
        assert first.get(timeout=WAIT) == first.id
        assert [r.get(timeout=WAIT) for r in others] == [r.id for r in others]
    starts = [at for _, at in recorder.of("start")]
    dones = sorted(at for _, at in recorder.of("done"))
    assert starts[-1] - dones[1] < TTL / 3  # woken again, not after the lease ran out
    # one fallback copy per waiting send: the woken copy that waited again
    # published none (its first fallback is still out)
    assert len(_deferred(recorder, "wake-k")) == 2


def test_a_message_too_large_for_a_waiter_looks_again_every_second(
    app: Celery, recorder: Recorder
) -> None:
    store = store_for(app)
    job_id = uuid.uuid4().hex
    holder = store.claim(job_id, "another-worker:1:abc", 1.5)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask, blob: str) -> int:
        return len(blob)

    blob = "x" * (MAX_WAITER_BYTES + 1)
    with worker(app):
        result = job.apply_async((blob,), task_id=job_id)
        deferred = recorder.wait("duplicate_deferred")
        assert deferred[0]["countdown"] <= POLL_INTERVAL
        assert store.waiters(job_id) == []
        assert result.get(timeout=WAIT) == len(blob)  # the holder's lease ran out
    record = store.get(job_id)
    assert record is not None
    assert record.generation > holder.generation  # type: ignore[union-attr]


def test_the_fallback_copy_of_a_send_its_woken_copy_ran_does_not_run_it_again(
    app: Celery, recorder: Recorder
) -> None:
    # a short lease: the fallback copy comes back within seconds
    app.conf.leases_ttl = 3.0
    gates = {"a": threading.Event()}
    hold = _holding(app, recorder, gates)
    with worker(app, pool="threads", concurrency=2):
        first, second = _send_two(hold, recorder, "k")
        gates["a"].set()  # the holder completes and wakes the second send
        assert first.get(timeout=WAIT) == first.id
        assert second.get(timeout=WAIT) == second.id
        # another send completes the job after it: the record no longer
        # names the second send
        third = hold.delay("k", "")
        assert third.get(timeout=WAIT) == third.id
        # the second send's fallback copy comes, claims, finds its mark
        [released] = recorder.wait("lease_released")
        assert released["reason"] == "duplicate"
    ran = [task_id for task_id, _ in recorder.of("start")]
    assert ran.count(second.id) == 1
