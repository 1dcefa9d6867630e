"""Celery's own ways of running a task again, under LeasedTask.

``replace()``, ``retry()`` (also with ``throw=False``), recursion, eager
chains whose steps share a task id, copies that keep their parent, the
re-entrant claim, and :func:`celery_leases.stop`. Real worker in this
process, real Redis broker and result backend.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery, chain, current_task
from celery.signals import before_task_publish, task_postrun

import celery_leases
from celery_leases import LeaseConfigurationError, LeasedTask, LeaseState
from celery_leases.outcome import encode_value
from celery_leases.sending import SEND_ID_HEADER
from celery_leases.stores.memory import ManualClock
from celery_leases.task import store_for
from tests.integration.conftest import WAIT, Recorder, worker
from tests.proxy import Proxy
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


@contextmanager
def published_and_finished(
    app: Celery,
) -> Iterator[tuple[list[tuple[str, int]], list[str]]]:
    """The task ids and retry counts of the messages ``app``'s tasks publish,
    and the task ids of the runs that end (``task_postrun``), in this
    process, while the block lasts."""
    published: list[tuple[str, int]] = []
    finished: list[str] = []

    def on_publish(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender in app.tasks and headers:
            published.append((headers["id"], headers["retries"]))

    def on_postrun(sender: Any = None, task_id: str = "", **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            finished.append(task_id)

    before_task_publish.connect(on_publish, weak=False)
    task_postrun.connect(on_postrun, weak=False)
    try:
        yield published, finished
    finally:
        before_task_publish.disconnect(on_publish)
        task_postrun.disconnect(on_postrun)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT} s for {what}"
        time.sleep(0.02)


# --- replace ------------------------------------------------------------------------


def test_replace_in_eager_mode_runs_the_replacement(make_app: Callable[..., Celery]) -> None:
    app = make_app(task_always_eager=True, task_eager_propagates=True)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def add(self: LeasedTask, x: int, y: int) -> int:
        return x + y

    @app.task(shared=False, base=LeasedTask, bind=True)
    def outer(self: LeasedTask, x: int) -> Any:
        return self.replace(add.s(x, 1))

    # apply(), not apply_async(): Celery itself forbids the join of an eager
    # replacement inside apply_async() (plain tasks too)
    assert outer.apply((41,), task_id="replaced-1").get() == 42
    record = store_for(app).get("replaced-1")
    assert record is not None
    assert record.state is LeaseState.COMPLETED


def test_replace_in_a_worker_hands_the_job_to_the_replacement(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def add(self: LeasedTask, x: int, y: int) -> int:
        recorder.add("add", self.lease.generation)
        return x + y

    @app.task(shared=False, base=LeasedTask, bind=True)
    def outer(self: LeasedTask, x: int) -> Any:
        recorder.add("outer", self.lease.generation)
        return self.replace(add.s(x, 1))

    with worker(app):
        result = outer.delay(41)
        assert result.get(timeout=WAIT) == 42
    [outer_generation] = recorder.of("outer")
    [add_generation] = recorder.of("add")
    assert add_generation > outer_generation
    assert recorder.of("duplicate_deferred") == []  # released before the replacement went out


# --- recursion and re-entrant claims -----------------------------------------------------


def test_a_task_calling_itself_directly_runs_every_call(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def factorial(self: LeasedTask, n: int) -> int:
        recorder.add("call", (n, self.request.id))
        return 1 if n <= 1 else n * factorial(n - 1)

    with worker(app):
        result = factorial.delay(5)
        assert result.get(timeout=WAIT) == 120
    calls = recorder.of("call")
    assert [n for n, _ in calls] == [5, 4, 3, 2, 1]
    assert {task_id for _, task_id in calls} == {result.id}  # as in plain Celery
    assert recorder.of("duplicate_deferred") == []


def test_a_direct_call_is_the_current_task_as_in_plain_celery(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def leased(self: LeasedTask) -> bool:
        return current_task._get_current_object() is self

    @app.task(shared=False, bind=True)
    def plain(self: Any) -> bool:
        return current_task._get_current_object() is self

    assert plain() is True  # Celery's own Task.__call__
    assert leased() is True
    assert current_task._get_current_object() is None


def test_a_task_calling_itself_directly_runs_every_call_in_eager_mode(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(task_always_eager=True, task_eager_propagates=True)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def factorial(self: LeasedTask, n: int) -> int:
        return 1 if n <= 1 else n * factorial(n - 1)

    assert factorial.delay(6).get() == 720


def test_a_claim_on_a_job_this_thread_holds_is_reentrant(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, lease_key="tree:{root}")
    def walk(self: LeasedTask, root: str, depth: int) -> int:
        recorder.add("generation", self.lease.generation)
        return depth if depth == 0 else walk(root, depth - 1) + 1

    with worker(app):
        assert walk.delay("a", 3).get(timeout=WAIT) == 3
    generations = recorder.of("generation")
    assert len(generations) == 4
    assert len(set(generations)) == 1  # every nested call ran inside the same lease


def test_a_nested_call_never_starts_its_body_on_a_lost_lease(
    make_app: Callable[..., Celery], redis_server: RedisServer, recorder: Recorder, unique: str
) -> None:
    app = make_app(redis_server.url, leases_store_options={"prefix": f"nest{unique}:"})

    @app.task(
        shared=False, base=LeasedTask, bind=True, lease_key="tree:{root}", lease_on_lost="flag"
    )
    def walk(self: LeasedTask, root: str, depth: int) -> int:
        recorder.add("start", (depth, self.lease.generation))
        if depth == 0:
            return 0
        if len(recorder.of("start")) == 1:
            # an operator takes the job away: the next renewal is refused
            store_for(app).force_release(f"tree:{root}", by="test", reason="taken away")
            wait_until(lambda: self.lease.lost, "the refused renewal")
        return walk(root, depth - 1) + 1

    with worker(app):
        assert walk.delay(unique, 1).get(timeout=WAIT) == 1
    starts = recorder.of("start")
    # the nested call on the lost lease raised LeaseLost instead of running;
    # the run was fenced out, and its copy ran both levels on a live lease
    assert [depth for depth, _ in starts] == [1, 1, 0], starts
    assert starts[0][1] < starts[1][1] == starts[2][1]
    [fenced] = recorder.of("lease_fenced_out")
    assert fenced["reason"] == "superseded"


# --- chains --------------------------------------------------------------------------------


def test_an_eager_chain_whose_steps_share_a_task_id_runs_every_step(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(task_always_eager=True, task_eager_propagates=True)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def add(self: LeasedTask, x: int, y: int) -> int:
        return x + y

    steps = chain(add.s(1, 1), add.s(2), add.s(3))
    assert steps.apply_async(task_id="shared-id").get() == 7
    # applying the same chain object again is a new run of every step
    assert steps.apply_async(task_id="shared-id").get() == 7


# --- retry ---------------------------------------------------------------------------------


def test_retry_without_throw_still_retries(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, max_retries=1)
    def flaky(self: LeasedTask) -> str:
        recorder.add("attempt", (self.request.retries, self.lease.generation))
        if self.request.retries == 0:
            self.retry(countdown=0.2, throw=False)
            return "first attempt returned"
        return "retried"

    with worker(app):
        flaky.delay()
        attempts = recorder.wait("attempt", count=2)
    (first_try, first_generation), (second_try, second_generation) = attempts
    assert (first_try, second_try) == (0, 1)
    assert second_generation > first_generation


def test_a_stale_run_calling_retry_writes_nothing_and_sends_no_retry(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    clock = ManualClock()
    app = make_app(leases_store_options={"clock": clock})

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=30)
    def stale(self: LeasedTask) -> None:
        recorder.add("attempt", self.request.retries)
        clock.advance(31)  # the lease runs out by the store's clock; a redelivery takes it
        store_for(app).claim(
            self.lease.job_id, "successor:2:def", 600, send_id=self.request.get(SEND_ID_HEADER)
        )
        raise self.retry(countdown=0)

    with worker(app), published_and_finished(app) as (published, finished):
        result = stale.delay()
        [fenced] = recorder.wait("lease_fenced_out")
        # a retry is published by retry() itself, inside the run: once the run
        # has ended, every message it sent has been seen
        wait_until(lambda: result.id in finished, what="the stale run's end")
        meta = app.backend.get_task_meta(result.id, cache=False)
    # the send itself, then at most the library's deferred copy, never a retry
    assert [retries for _, retries in published] in ([0], [0, 0])
    assert fenced["reason"] == "superseded"
    assert meta["status"] == "PENDING"  # no RETRY over the holder's run
    assert recorder.of("attempt") == [0]


# --- copies --------------------------------------------------------------------------------


def test_a_deferred_copy_keeps_its_parent_and_root(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def child(self: LeasedTask) -> None:
        recorder.add("ids", (self.request.parent_id, self.request.root_id))

    held_id, orphan_id = uuid.uuid4().hex, uuid.uuid4().hex
    store = store_for(app)
    with worker(app):
        # held by another worker when the copies arrive (claimed once this
        # worker runs, for long enough that a loaded machine still finds
        # them held), so each copy is deferred before it runs
        store.claim(held_id, "another-worker:1:abc", 3.0)
        store.claim(orphan_id, "another-worker:1:abc", 3.0)
        adopted = child.apply_async(task_id=held_id, parent_id="parent-1", root_id="root-1")
        orphan = child.apply_async(task_id=orphan_id)
        adopted.get(timeout=WAIT)
        orphan.get(timeout=WAIT)
        assert len(recorder.of("duplicate_deferred")) >= 2
    assert sorted(recorder.of("ids"), key=str) == sorted(
        [("parent-1", "root-1"), (None, orphan_id)], key=str
    )
    assert adopted.children in (None, [])  # the copy is not a child of itself


# --- fenced-out runs ------------------------------------------------------------------------


def test_a_run_lost_by_its_deadline_releases_so_the_copy_runs_without_a_takeover(
    make_app: Callable[..., Celery], redis_server: RedisServer, recorder: Recorder, unique: str
) -> None:
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        app = make_app(
            f"redis://127.0.0.1:{proxy.port}/0",
            leases_store_options={"prefix": f"fo{unique}:", "socket_timeout": 1.0},
        )

        @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=1.5, lease_on_lost="flag")
        def job(self: LeasedTask) -> int:
            recorder.add("run", self.lease.generation)
            if len(recorder.of("run")) == 1:
                proxy.blackhole()  # renewals vanish: the lease is lost by the local clock
                time.sleep(self.lease.remaining() + 0.2)
                proxy.heal()
            return int(self.lease.generation)

        with worker(app):
            result = job.delay()
            generation = result.get(timeout=WAIT)
        [first, second] = recorder.of("run")
        [fenced] = recorder.of("lease_fenced_out")
        record = store_for(app).get(result.id)
    assert fenced["reason"] == "deadline"
    assert generation == second > first
    assert record is not None
    assert record.takeovers == 0  # the fenced-out run gave its lease back


# --- stop() ---------------------------------------------------------------------------------


def test_stop_ends_every_lease_thread_and_the_next_run_starts_them_again(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(task_always_eager=True)

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=3)
    def slow(self: LeasedTask) -> int:
        time.sleep(1.2)  # long enough for a renewal and a notification
        return int(self.lease.generation)

    def lease_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("celery-leases")]

    slow.delay().get()
    assert lease_threads()
    celery_leases.stop()
    assert lease_threads() == []
    celery_leases.stop()  # idempotent
    assert slow.delay().get() > 0
    celery_leases.stop()
    assert lease_threads() == []


# --- lease_on_lost="raise": what it does and does not guarantee -----------------------------


def test_raise_can_be_swallowed_by_a_catch_all_but_the_run_is_still_fenced_out(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    """An asynchronous LeaseLost lands in whatever Python code runs, here a
    catch-all like ``logging.Handler.emit``'s: the body runs on. What still
    holds is the completion fence: nothing of the stale run is stored."""
    clock = ManualClock()
    app = make_app(leases_store_options={"clock": clock})

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=3, lease_on_lost="raise")
    def swallowing(self: LeasedTask) -> str:
        clock.advance(4)  # by the store's clock the lease ran out; a redelivery takes it
        store_for(app).claim(
            self.lease.job_id, "successor:2:def", 600, send_id=self.request.get(SEND_ID_HEADER)
        )
        swallowed = 0
        end = time.monotonic() + 4
        while time.monotonic() < end:
            try:
                time.sleep(0.01)
            except Exception:  # the point: code that swallows everything
                swallowed += 1
        recorder.add("swallowed", swallowed)
        return "stale result"

    with worker(app):
        result = swallowing.delay()
        [fenced] = recorder.wait("lease_fenced_out", timeout=WAIT)
        meta = app.backend.get_task_meta(result.id, cache=False)
    assert recorder.of("swallowed") == [1]  # it landed once, and the body ran on
    assert fenced["reason"] == "superseded"
    assert meta["status"] == "PENDING"


# --- permanent errors ---------------------------------------------------------------------------


def test_a_job_key_the_store_cannot_hold_fails_the_task_at_once(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, lease_key="report:{name}")
    def report(self: LeasedTask, name: str) -> None:
        recorder.add("body", name)

    with worker(app):
        result = report.delay(name="bad\udcffkey")  # a lone surrogate: not UTF-8
        with pytest.raises(LeaseConfigurationError):
            result.get(timeout=WAIT)
    assert recorder.of("body") == []
    assert recorder.of("duplicate_deferred") == []  # failed, not deferred forever


def test_a_stale_run_whose_task_id_was_completed_meanwhile_publishes_no_copy(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    clock = ManualClock()
    app = make_app(leases_store_options={"clock": clock})

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=1.5, lease_on_lost="flag")
    def paused(self: LeasedTask) -> str:
        store = store_for(app)
        clock.advance(2)  # it stalls; a redelivery of its message takes the job over ...
        successor = store.claim(
            self.lease.job_id, "successor:2:def", 30, send_id=self.request.get(SEND_ID_HEADER)
        )
        outcome = encode_value("successor result", serializer="json", max_bytes=1024)
        store.complete(self.lease.job_id, "successor:2:def", successor.generation, outcome=outcome)
        time.sleep(self.lease.remaining() + 0.1)  # ... and completes it before this one wakes
        return "stale result"

    with worker(app), published_and_finished(app) as (published, finished):
        result = paused.delay()
        [fenced] = recorder.wait("lease_fenced_out")
        # a copy would be published inside the run: once it has ended, none can come
        wait_until(lambda: result.id in finished, what="the stale run's end")
    assert published == [(result.id, 0)]  # the send itself, and no copy
    # lost by its deadline, or told by a refused renewal that the job is completed
    assert fenced["reason"] in ("deadline", "completed")
    assert recorder.of("duplicate_deferred") == []  # the task id has its answer already
    assert app.backend.get_task_meta(result.id, cache=False)["status"] == "PENDING"
