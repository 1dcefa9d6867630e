"""Lease transitions as log lines and as ``lease-*`` events on a real broker.

The worker runs in this process (``celery.contrib.testing``) on a real
redis-server; an event receiver on the same broker collects what is sent.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_leases import LeasedTask, events
from celery_leases.stores.memory import ManualClock
from celery_leases.task import forget_runtime, store_for
from tests.conftest import serve
from tests.integration.test_queue_unique import unique_task
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

WAIT = 30.0


@pytest.fixture
def make_app(redis_server: RedisServer, unique: str) -> Iterator[Callable[..., Celery]]:
    apps: list[Celery] = []

    def factory(broker: str | None = None, **conf: Any) -> Celery:
        url = broker or redis_server.url
        app = Celery(f"observe{unique}{len(apps)}", set_as_current=False)
        app.conf.update(
            broker_url=url,
            result_backend=redis_server.url,
            broker_connection_retry_on_startup=True,
            result_expires=None,
            task_default_queue=f"q{unique}{len(apps)}",
            leases_store="memory://",
            **conf,
        )
        apps.append(app)
        return app

    yield factory
    # AsyncResult objects sit in reference cycles; their __del__ talks to the
    # result backend, so let it run while the server is still up
    gc.collect()
    for app in apps:
        forget_runtime(app)
        app.close()


def leased_tasks(app: Celery) -> tuple[Any, Any]:
    @app.task(shared=False, base=LeasedTask, bind=True, name="observe.ok")
    def ok(self: LeasedTask) -> dict[str, Any]:
        return {"generation": self.lease.generation, "hostname": self.request.hostname}

    @app.task(shared=False, base=LeasedTask, bind=True, name="observe.broken")
    def broken(self: LeasedTask) -> None:
        raise ValueError("broken on purpose")

    return ok, broken


class Received:
    """Every event on ``app``'s broker while it runs, from a receiver thread."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._wait_ready()

    def _run(self) -> None:
        with self.app.connection_for_read() as connection:
            self._receiver = self.app.events.Receiver(connection, handlers={"*": self._add})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, prefix: str, uuid: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [
                e
                for e in self.events
                if e["type"].startswith(prefix) and (uuid is None or e.get("uuid") == uuid)
            ]

    def probe(self) -> None:
        """Send a marker event and wait until it comes back: what was sent before it is in."""
        marker = f"probe-{time.monotonic_ns()}"
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send("worker-probe", marker=marker)
            until = time.monotonic() + 0.5
            while time.monotonic() < until:
                if any(e.get("marker") == marker for e in self.of("worker-probe")):
                    return
                time.sleep(0.02)
        raise AssertionError("the event receiver got no probe")

    def _wait_ready(self) -> None:
        self.probe()

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=10)


@contextmanager
def receiving(app: Celery) -> Iterator[Received]:
    received = Received(app)
    try:
        yield received
    finally:
        received.close()


@contextmanager
def worker(app: Celery) -> Iterator[Any]:
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30) as running:
        yield running


def wait_for(probe: Callable[[], Any], message: str) -> Any:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"waited {WAIT} s for {message}")


def test_a_run_sends_claimed_and_completed_events_when_the_worker_sends_task_events(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(worker_send_task_events=True)
    ok, _ = leased_tasks(app)
    with receiving(app) as received, worker(app):
        result = ok.delay()
        value = result.get(timeout=WAIT)
        wait_for(lambda: received.of("lease-completed", result.id), "lease-completed")
    claimed = received.of("lease-claimed", result.id)
    completed = received.of("lease-completed", result.id)
    assert len(claimed) == len(completed) == 1
    for event in (claimed[0], completed[0]):
        assert event["job_id"] == result.id
        assert event["generation"] == value["generation"]
        assert event["owner"]
        assert event["lease_until"]
        # the run's node name, so monitors file the event under its worker
        assert event["hostname"] == value["hostname"]
    assert claimed[0]["takeovers"] == 0
    assert received.of("task-lease-") == [], "lease events must not look like task states"


def test_the_run_of_a_queued_job_sends_lease_unqueued(make_app: Callable[..., Celery]) -> None:
    """The run that claims a ``lease_queue_unique`` job takes its queued mark
    away and says so (Flower shows it as the task's ``lease_queued``)."""
    app = make_app(worker_send_task_events=True)
    report = unique_task(app)
    with receiving(app) as received, worker(app):
        queued = report.delay(7, note="queued")
        queued.get(timeout=WAIT)
        [event] = wait_for(lambda: received.of("lease-unqueued", queued.id), "lease-unqueued")
    assert (event["job_id"], event["reason"]) == ("report-7", "claimed")
    assert event["hostname"] == received.of("lease-claimed", queued.id)[0]["hostname"]


def test_no_lease_event_goes_out_when_the_worker_sends_no_task_events(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    ok, broken = leased_tasks(app)
    with receiving(app) as received, worker(app):
        ok.delay().get(timeout=WAIT)
        with pytest.raises(ValueError, match="broken on purpose"):
            broken.delay().get(timeout=WAIT)
        assert events.flush(5.0)
        received.probe()
    assert received.of("lease-") == []


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def transitions() -> Iterator[Records]:
    """The transitions logger's records (the worker reconfigures the root logger)."""
    handler = Records()
    log = logging.getLogger("celery_leases.transitions")
    saved = (log.level, log.disabled)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.disabled = False
    yield handler
    log.removeHandler(handler)
    log.level, log.disabled = saved


def test_each_transition_logs_one_line_with_its_fields(
    make_app: Callable[..., Celery], transitions: Records
) -> None:
    app = make_app()
    ok, broken = leased_tasks(app)
    with worker(app):
        done = ok.delay()
        generation = done.get(timeout=WAIT)["generation"]
        failed = broken.delay()
        with pytest.raises(ValueError, match="broken on purpose"):
            failed.get(timeout=WAIT)
    lines = transitions.records
    seen = [(r.lease_transition, r.task_id) for r in lines]  # type: ignore[attr-defined]
    assert seen == [
        ("claimed", done.id),
        ("completed", done.id),
        ("claimed", failed.id),
        ("released", failed.id),
    ]
    claimed = lines[0]
    assert claimed.job_id == done.id  # type: ignore[attr-defined]
    assert claimed.generation == generation  # type: ignore[attr-defined]
    assert claimed.owner.count(":") == 2  # type: ignore[attr-defined]
    message = claimed.getMessage()
    assert f"job={done.id} task={done.id} generation={generation} owner={claimed.owner}" in message  # type: ignore[attr-defined]
    assert lines[3].reason == "failure"  # type: ignore[attr-defined]


def _send_many(app: Celery, sent: threading.Event) -> None:
    for n in range(events.QUEUE_SIZE + 20):
        events.emit(app, events.LEASE_RENEWED, task_id=f"t{n}", hostname="w@h")
    sent.set()


def test_a_hanging_broker_never_blocks_whoever_sends_an_event(
    make_app: Callable[..., Celery],
) -> None:
    for server in serve(RedisServer):
        app = make_app(broker=server.url, worker_send_task_events=True)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            sent = threading.Event()
            thread = threading.Thread(target=_send_many, args=(app, sent), daemon=True)
            thread.start()
            thread.join(timeout=WAIT)
            assert sent.is_set(), "emit blocked on a hanging broker"
            # the sender thread holds one in its stuck publish; the queue took 1000 more
            assert events._senders.get(app).dropped >= 19
            assert not events.flush(0.2)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert events.flush(WAIT)


def test_a_lease_lost_in_the_heartbeat_thread_names_its_task(
    make_app: Callable[..., Celery], transitions: Records
) -> None:
    """The lost notice comes from the heartbeat, where ``task.request`` is empty."""
    clock = ManualClock()
    app = make_app(
        leases_store_options={"clock": clock},
        leases_on_lost="flag",
        worker_send_task_events=True,
    )

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=1.5, name="observe.victim")
    def victim(self: LeasedTask) -> None:
        clock.advance(2)
        store_for(app).claim(self.lease.job_id, "successor:2:def", 60)  # next renewal is refused
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not self.lease.lost:
            time.sleep(0.01)

    with receiving(app) as received, worker(app):
        result = victim.delay()
        wait_for(lambda: received.of("lease-fenced-out", result.id), "lease-fenced-out")
        wait_for(lambda: received.of("lease-lost", result.id), "lease-lost")
    by_transition = {r.lease_transition: r for r in transitions.records}  # type: ignore[attr-defined]
    lost, claimed = by_transition["lost"], by_transition["claimed"]
    assert lost.threadName != claimed.threadName
    assert lost.task_id == result.id  # type: ignore[attr-defined]
    assert lost.reason == "superseded"  # type: ignore[attr-defined]
    (lost_event,) = received.of("lease-lost", result.id)
    (fenced_event,) = received.of("lease-fenced-out", result.id)
    assert lost_event["reason"] == "superseded"
    assert lost_event["hostname"] == fenced_event["hostname"]
    assert lost_event["generation"] == fenced_event["generation"]


def test_a_broker_that_is_down_is_logged_once_not_per_event(
    make_app: Callable[..., Celery],
) -> None:
    for server in serve(RedisServer):
        app = make_app(broker=server.url, worker_send_task_events=True)
        server.kill()  # connections are refused from now on
        handler = Records()
        log = logging.getLogger("celery_leases")
        # an earlier in-process worker may have set up logging its own way
        saved = (log.level, log.disabled)
        log.setLevel(logging.INFO)
        log.disabled = False
        log.addHandler(handler)
        try:
            for n in range(3):
                events.emit(app, events.LEASE_RENEWED, task_id=f"t{n}", hostname="w@h")
            assert events.flush(WAIT)
        finally:
            log.removeHandler(handler)
            log.level, log.disabled = saved
        failures = [r for r in handler.records if "could not send" in r.getMessage()]
        assert len(failures) == 1
        assert events._senders.get(app).failures == 3
