"""LeasedTask in a real Celery worker running in this process.

The broker and result backend are a real redis-server; the lease store is
the in-process memory store (the worker shares this process), a real Redis
store, or SQLite. Each test has its own app, queue and store.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult

from celery_leases import (
    LeaseConfigurationError,
    LeasedTask,
    LeaseHeld,
    LeaseLost,
    LeaseState,
)
from celery_leases.outcome import encode_value
from celery_leases.sending import SEND_ID_HEADER, keeping_send_id
from celery_leases.task import DEFERRALS_HEADER, store_for
from celery_leases.worker import check_app
from tests.integration.conftest import WAIT, Recorder, worker
from tests.integration.test_observe import Records
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


def store_url(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> tuple[str, dict[str, Any]]:
    if kind == "memory":
        return "memory://", {}
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return server.url, {"prefix": f"t{unique}:"}
    return f"sqlite:///{tmp_path / 'leases.db'}", {"table_name": f"leases_{unique}"}


# --- the protocol in a worker -------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "redis", "sqlite"])
def test_claim_body_complete_records_success(
    kind: str,
    make_app: Callable[..., Celery],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    unique: str,
    recorder: Recorder,
) -> None:
    url, options = store_url(kind, request, tmp_path, unique)
    app = make_app(url, leases_store_options=options)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def add(self: LeasedTask, x: int, y: int) -> int:
        recorder.add("body", (self.lease.job_id, self.lease.generation, self.lease.idempotency_key))
        return x + y

    with worker(app):
        result = add.delay(2, 3)
        assert result.get(timeout=WAIT) == 5
    record = store_for(app).get(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    [(job_id, generation, key)] = recorder.of("body")
    assert job_id == result.id
    assert generation == record.generation
    assert key == f"{result.id}:{generation}"
    assert len(recorder.of("lease_claimed")) == 1
    assert len(recorder.of("lease_completed")) == 1


def test_a_failing_body_releases_and_records_failure(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def broken(self: LeasedTask) -> None:
        raise ValueError("broken on purpose")

    with worker(app):
        result = broken.delay()
        with pytest.raises(ValueError, match="broken on purpose"):
            result.get(timeout=WAIT)
    assert result.state == "FAILURE"
    record = store_for(app).get(result.id)
    assert record is not None
    assert record.state is LeaseState.RELEASED
    [released] = recorder.of("lease_released")
    assert released["reason"] == "failure"


def test_retry_releases_and_the_retry_claims_the_next_generation(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, max_retries=3)
    def flaky(self: LeasedTask) -> str:
        recorder.add("generation", self.lease.generation)
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return "done"

    with worker(app):
        result = flaky.delay()
        assert result.get(timeout=WAIT) == "done"
    first, second = recorder.of("generation")
    assert second > first
    assert [r["reason"] for r in recorder.of("lease_released")] == ["retry"]


def test_a_completed_job_delivered_again_is_skipped(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def echo(self: LeasedTask, value: str) -> str:
        recorder.add("body", value)
        return value

    task_id = uuid.uuid4().hex
    with worker(app):
        # the same send (same send id) delivered twice, as a broker redelivers it
        with keeping_send_id("send-1"):
            assert echo.apply_async(("first",), task_id=task_id).get(timeout=WAIT) == "first"
            echo.apply_async(("second",), task_id=task_id)
        [skipped] = recorder.wait("lease_skipped")
        assert skipped["task_id"] == task_id
        marker = echo.delay("marker")  # solo pool: runs after the duplicate
        assert marker.get(timeout=WAIT) == "marker"
    assert recorder.of("body") == ["first", "marker"]
    assert AsyncResult(task_id, app=app).get(timeout=WAIT) == "first"


def test_a_task_id_sent_again_after_completion_is_a_new_run(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def echo(self: LeasedTask, value: str) -> str:
        recorder.add("body", (value, self.lease.generation))
        return value

    task_id = uuid.uuid4().hex
    with worker(app):
        assert echo.apply_async(("first",), task_id=task_id).get(timeout=WAIT) == "first"
        echo.apply_async(("second",), task_id=task_id)  # a new send, as Celery sees it
        recorder.wait("body", count=2)  # (Celery keeps the first SUCCESS in the backend)
    (_, first), (_, second) = recorder.of("body")
    assert second > first  # serialized by the lease, fenced by a later generation


def test_a_duplicate_while_held_is_deferred_and_completes_once(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> str:
        recorder.add("body", self.request.get(DEFERRALS_HEADER))
        return "ran"

    task_id = uuid.uuid4().hex
    store = store_for(app)
    held = store.claim(task_id, "another-worker:1:abc", 1.5)  # another worker holds it
    with worker(app):
        result = job.apply_async(task_id=task_id)
        deferred = recorder.wait("duplicate_deferred")
        assert deferred[0]["reason"] == "held"
        assert deferred[0]["holder"] == "another-worker:1:abc"
        assert 0 < deferred[0]["countdown"] <= 1.0  # capped by leases_defer_max
        assert recorder.of("body") == []
        assert result.get(timeout=WAIT) == "ran"  # the holder's lease ran out
    [deferrals] = recorder.of("body")
    assert deferrals >= 1  # the run that completed was a re-published copy
    record = store.get(task_id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert record.generation == max(
        held.generation + 1,  # type: ignore[union-attr]
        record.claimed_at_ms,
    )


def outage_app(
    make_app: Callable[..., Celery], lease_server: RedisServer, unique: str, **conf: Any
) -> Celery:
    """An app whose lease store is ``lease_server``, which the test stops."""
    return make_app(
        lease_server.url,
        leases_store_options={"prefix": f"t{unique}:", "socket_timeout": 1},
        **conf,
    )


def test_store_down_at_claim_defers_until_it_is_back(
    make_app: Callable[..., Celery],
    recorder: Recorder,
    unique: str,
    lease_server: RedisServer,
) -> None:
    app = outage_app(make_app, lease_server, unique)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> str:
        recorder.add("body")
        return "ran"

    lease_server.stop()
    with worker(app):
        result = job.delay()
        deferred = recorder.wait("duplicate_deferred", count=2)
        assert {d["reason"] for d in deferred} == {"store-unavailable"}
        assert recorder.of("body") == []
        lease_server.start()
        assert result.get(timeout=WAIT) == "ran"
    assert len(recorder.of("body")) == 1
    record = store_for(app).get(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED


def test_a_deferral_capped_by_the_visibility_timeout_logs_the_countdown_it_gets(
    make_app: Callable[..., Celery],
    recorder: Recorder,
    unique: str,
    lease_server: RedisServer,
) -> None:
    # half the visibility timeout (1 s) is below the backoff's first countdown (3 s)
    app = outage_app(
        make_app, lease_server, unique, broker_transport_options={"visibility_timeout": 2}
    )
    app.conf.update(leases_defer_backoff=3.0, leases_defer_max=10.0)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> None:
        recorder.add("body")

    lease_server.stop()
    # the worker reconfigures the root logger (and its level)
    log, records = logging.getLogger("celery_leases"), Records()
    level = log.level
    log.addHandler(records)
    log.setLevel(logging.WARNING)
    try:
        with worker(app):
            result = job.delay()
            [deferred] = recorder.wait("duplicate_deferred")
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    assert recorder.of("body") == []
    assert deferred["countdown"] == 1.0
    [logged] = [
        float(m.group(1))
        for r in records.records
        if (
            m := re.search(
                rf"\[{result.id}\]: lease store .* deferring ([\d.]+) s \(deferral 1\)",
                r.getMessage(),
            )
        )
    ]
    assert logged == 1.0


def test_a_copy_made_for_a_store_outage_goes_to_the_republish_queue(
    make_app: Callable[..., Celery],
    recorder: Recorder,
    unique: str,
    lease_server: RedisServer,
    redis_server: RedisServer,
) -> None:
    again = f"again{unique}"
    app = outage_app(make_app, lease_server, unique, leases_republish_options={"queue": again})

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> str:
        recorder.add("body")
        return "ran"

    broker = redis.Redis.from_url(redis_server.url)
    lease_server.stop()
    with worker(app):  # consumes the app's default queue only
        result = job.delay()
        (deferred,) = recorder.wait("duplicate_deferred")
        assert deferred["reason"] == "store-unavailable"
    # the copy waits in its own queue, not behind the default queue's backlog
    assert broker.llen(again) == 1
    assert broker.llen(app.conf.task_default_queue) == 0
    assert recorder.of("body") == []
    lease_server.start()
    with worker(app, queues=[again]):
        assert result.get(timeout=WAIT) == "ran"
    assert len(recorder.of("body")) == 1
    broker.close()


def test_a_fenced_out_completion_writes_nothing(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    from celery_leases.stores.memory import ManualClock

    clock = ManualClock()
    app = make_app(leases_store_options={"clock": clock}, leases_on_lost="flag")

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=30)
    def stale(self: LeasedTask) -> str:
        # the lease runs out by the store's clock and another worker claims the job
        clock.advance(31)
        taken = store_for(app).claim(
            self.lease.job_id, "successor:2:def", 30, send_id=self.request.get(SEND_ID_HEADER)
        )  # a redelivery of the same message, on another worker
        recorder.add("taken", taken)
        return "stale result"

    with worker(app):
        result = stale.delay()
        [fenced] = recorder.wait("lease_fenced_out")
        assert fenced["reason"] == "superseded"
        # the message was published again so the job cannot be dropped
        copies = recorder.wait("duplicate_deferred", count=2)
        assert copies[0]["reason"] == "fenced-out"
        assert copies[1]["reason"] == "held"
        [successor] = recorder.of("taken")
        # the successor completes, keeping its outcome, then dies before storing it
        outcome = encode_value("successor result", serializer="json", max_bytes=65536)
        store_for(app).complete(result.id, "successor:2:def", successor.generation, outcome=outcome)
        # the next copy finds the job completed by its own send and answers with
        # the successor's outcome; the stale run's value is never stored
        assert result.get(timeout=WAIT) == "successor result"
    assert len(recorder.of("taken")) == 1  # the copy did not run the body again


def test_the_heartbeat_keeps_a_task_alive_for_several_ttls(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=1.5)
    def slow(self: LeasedTask) -> int:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            self.lease.check()
            time.sleep(0.05)
        return self.lease.generation

    with worker(app):
        result = slow.delay()
        generation = result.get(timeout=WAIT)
    record = store_for(app).get(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert record.generation == generation
    assert record.renew_count >= 5
    assert len(recorder.of("lease_renewed")) == record.renew_count


def test_blocked_renewals_raise_lease_lost_soon_after_the_deadline(
    make_app: Callable[..., Celery],
    recorder: Recorder,
    unique: str,
    lease_server: RedisServer,
) -> None:
    app = make_app(
        lease_server.url,
        leases_store_options={"prefix": f"t{unique}:", "socket_timeout": 0.5},
        leases_on_lost="raise",  # the default, "flag", raises nothing into the body
    )

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=1.5)
    def long_job(self: LeasedTask) -> str:
        if self.request.get(DEFERRALS_HEADER):
            recorder.add("second run")
            return "finished by the copy"
        deadline = self.lease.deadline
        recorder.add("deadline", deadline)
        lease_server.stop()
        try:
            while time.monotonic() < deadline + 10:
                time.sleep(0.01)
        except LeaseLost as exc:
            recorder.add("lost", (time.monotonic(), exc.reason))
            raise
        return "not reached"

    with worker(app):
        result = long_job.delay()
        [(noticed, reason)] = recorder.wait("lost")
        [deadline] = recorder.of("deadline")
        assert reason == "deadline"
        assert deadline <= noticed < deadline + 0.5 + 1.0  # one renew interval + slack
        assert recorder.wait("lease_fenced_out")[0]["reason"] == "deadline"
        lease_server.start()
        # the re-published copy waits out the stale lease, then finishes the job
        assert result.get(timeout=WAIT) == "finished by the copy"


@pytest.mark.parametrize("mode", ["flag", "raise"])
def test_on_lost_modes(mode: str, make_app: Callable[..., Celery], recorder: Recorder) -> None:
    from celery_leases.stores.memory import ManualClock

    clock = ManualClock()
    app = make_app(leases_store_options={"clock": clock})
    # the loss is acted on (the interrupt sent, in "raise" mode) before
    # on_lease_lost is called: once the hook has run, the interrupt, if any,
    # is pending and lands at the body's next bytecode
    hook_ran = threading.Event()

    class Watched(LeasedTask):
        def on_lease_lost(self, lease: Any) -> None:
            recorder.add("hook", lease.lost_reason)
            hook_ran.set()

    @app.task(shared=False, base=Watched, bind=True, lease_ttl=1.5, lease_on_lost=mode)
    def victim(self: LeasedTask) -> None:
        clock.advance(2)
        store_for(app).claim(self.lease.job_id, "successor:2:def", 60)  # next renewal is refused
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not self.lease.lost:
                time.sleep(0.01)
            recorder.add("flag seen", self.lease.lost)
            with pytest.raises(LeaseLost):
                self.lease.check()
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline and not hook_ran.is_set():
                time.sleep(0.01)  # an interrupt, if any, lands here
            recorder.add("finished", True)
        except LeaseLost as exc:
            recorder.add("interrupted", exc.reason)
            raise

    with worker(app):
        result = victim.delay()
        recorder.wait("lease_fenced_out")
    assert recorder.of("hook") == ["superseded"]
    assert [e["reason"] for e in recorder.of("lease_lost")] == ["superseded"]
    if mode == "flag":
        assert recorder.of("finished") == [True]
        assert recorder.of("interrupted") == []
    else:
        assert recorder.of("interrupted") == ["superseded"]
        assert recorder.of("finished") == []
    assert result.state == "PENDING"


def test_a_job_past_its_takeover_limit_is_failed_without_running(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    from celery_leases.stores.memory import ManualClock

    clock = ManualClock()
    app = make_app(leases_store_options={"clock": clock})

    @app.task(shared=False, base=LeasedTask, bind=True, lease_max_takeovers=1)
    def poison(self: LeasedTask) -> None:
        recorder.add("body")

    task_id = uuid.uuid4().hex
    store = store_for(app)
    for n in range(2):  # two workers died holding it
        store.claim(task_id, f"dead:{n}:x", 1)
        clock.advance(2)
    with worker(app):
        result = poison.apply_async(task_id=task_id)
        with pytest.raises(Exception, match="took over a run-out lease 2 times"):
            result.get(timeout=WAIT)
    assert recorder.of("body") == []
    record = store.get(task_id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED


def test_a_singleton_key_serializes_calls_and_each_gets_its_answer(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, lease_key="report:{customer_id}")
    def report(self: LeasedTask, customer_id: int, day: str) -> str:
        recorder.add("body", (self.lease.job_id, day, self.lease.generation))
        return f"{self.lease.job_id} on {day}"

    with worker(app):
        assert report.delay(customer_id=7, day="monday").get(timeout=WAIT) == "report:7 on monday"
        # Tuesday's call finds Monday's job completed: a new task id is a new run
        assert report.delay(customer_id=7, day="tuesday").get(timeout=WAIT) == (
            "report:7 on tuesday"
        )
        assert report.delay(customer_id=8, day="tuesday").get(timeout=WAIT) == (
            "report:8 on tuesday"
        )
    monday, tuesday, other = recorder.of("body")
    assert tuesday[2] > monday[2]
    assert other[0] == "report:8"


def test_concurrent_calls_on_one_key_are_deferred_and_each_gets_its_answer(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, lease_key="export:{name}")
    def export(self: LeasedTask, name: str, call: int) -> int:
        recorder.add("body", (call, time.monotonic()))
        time.sleep(0.3)
        recorder.add("end", (call, time.monotonic()))
        return call

    with worker(app, pool="threads", concurrency=3):
        results = [export.delay(name="daily", call=n) for n in range(3)]
        assert [r.get(timeout=WAIT) for r in results] == [0, 1, 2]
    assert len(recorder.of("duplicate_deferred")) >= 1
    spans = sorted(
        (start, end)
        for (call, start), (_, end) in zip(
            sorted(recorder.of("body")), sorted(recorder.of("end")), strict=True
        )
    )
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start  # never two bodies of one key at once


def test_threads_pool_runs_leased_tasks(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def square(self: LeasedTask, x: int) -> int:
        self.lease.check()
        return x * x

    with worker(app, pool="threads", concurrency=4):
        results = [square.delay(n) for n in range(8)]
        assert [r.get(timeout=WAIT) for r in results] == [n * n for n in range(8)]


# --- eager mode and direct calls -------------------------------------------------------


def test_eager_mode_follows_the_same_protocol(make_app: Callable[..., Celery]) -> None:
    app = make_app(task_always_eager=True)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def double(self: LeasedTask, x: int) -> int:
        return 2 * x + 0 * self.lease.generation

    result = double.apply_async((4,), task_id="eager-1")
    assert result.get() == 8
    record = store_for(app).get("eager-1")
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    # an eager call is a new run of the job, serialized by the lease
    again = double.apply((5,), task_id="eager-1")
    assert again.get() == 10
    record = store_for(app).get("eager-1")
    assert record is not None
    assert record.state is LeaseState.COMPLETED


def test_eager_mode_raises_lease_held_instead_of_deferring(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(task_always_eager=True, task_eager_propagates=True)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> None:
        raise AssertionError("must not run")

    store_for(app).claim("held-job", "another-worker:1:abc", 30)
    with pytest.raises(LeaseHeld, match="cannot be deferred") as info:
        job.apply_async(task_id="held-job")
    assert info.value.holder == "another-worker:1:abc"


def test_self_lease_outside_a_run_is_a_clear_error(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> None:
        pass

    with pytest.raises(Exception, match="only available inside the body"):
        _ = job.lease


# --- worker start checks -----------------------------------------------------------


def test_a_leased_task_without_acks_late_stops_the_worker(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, acks_late=False)
    def job(self: LeasedTask) -> None:
        pass

    with pytest.raises(LeaseConfigurationError, match="acks_late=False"), worker(app):
        pass


def test_a_missing_store_setting_stops_the_worker(make_app: Callable[..., Celery]) -> None:
    app = make_app(store="")

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> None:
        pass

    with pytest.raises(LeaseConfigurationError, match="leases_store"), worker(app):
        pass


def test_a_short_visibility_timeout_is_reported(make_app: Callable[..., Celery]) -> None:
    app = make_app(broker_transport_options={"visibility_timeout": 10})

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=30)
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    [warning] = check_app(app, pool="prefork")
    assert "visibility_timeout (10 s) is shorter than the lease ttl" in warning


def test_stop_mode_outside_prefork_is_reported(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, lease_on_lost="stop")
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    [warning] = check_app(app, pool="threads")
    assert "lease_on_lost='stop'" in warning


def test_cli_options_are_added_once_and_override_the_settings(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(store="memory://")

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> float:
        return self.lease.timing.ttl

    app.finalize()
    LeasedTask.on_bound(app)  # binding again does not add the options twice
    names = sorted(o.name for o in app.user_options["worker"])
    assert names == ["leases_metrics_port", "leases_store", "leases_ttl"]
    with start_worker(
        app, pool="solo", perform_ping_check=False, shutdown_timeout=30, leases_ttl=42.0
    ):
        assert job.delay().get(timeout=WAIT) == 42.0


def test_store_handle_is_reopened_in_a_forked_process(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    parent_store = store_for(app)
    assert store_for(app) is parent_store  # one handle per process
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() with threads; the child only checks and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        fresh = store_for(app) is not parent_store
        os.write(write, b"1" if fresh else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_a_named_key_field_is_filled_by_a_positional_argument(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, lease_key="report:{customer_id}:{day}")
    def build_report(self: LeasedTask, customer_id: int, day: str) -> str:
        return self.lease.job_id

    with worker(app):
        assert build_report.delay(42, "2026-12-01").get(timeout=WAIT) == "report:42:2026-12-01"
        assert build_report.delay(customer_id=43, day="2026-12-01").get(timeout=WAIT) == (
            "report:43:2026-12-01"
        )


def test_runs_of_one_task_share_their_lease_callbacks(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    # one pair of callbacks per task and mode, not a pair of closures per run:
    # a threads worker holding 1,000 leases would pay 400 bytes for each
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def note(self: LeasedTask, n: int) -> int:
        recorder.add("callbacks", (self.lease._on_lost, self.lease._on_renewed))
        return n

    with worker(app):
        assert note.delay(1).get(timeout=WAIT) == 1
        assert note.delay(2).get(timeout=WAIT) == 2
    first, second = recorder.of("callbacks")
    assert first[0] is second[0]
    assert first[1] is second[1]
    assert first[0] is not first[1]
