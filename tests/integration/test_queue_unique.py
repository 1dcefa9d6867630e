"""lease_queue_unique in-process: real Redis broker, a worker thread where needed.

The lease store is the memory store (this process's sends and worker share
it) or, where the store's own failure is the point, a Redis store.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery, group
from kombu.exceptions import OperationalError

from celery_leases import LeaseConfigurationError, LeasedTask, LeaseSkipped
from celery_leases.queue_unique import QUEUED_HEADER
from celery_leases.task import store_for
from tests.integration.conftest import WAIT, Recorder, worker
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

KEY = "report-{user_id}"


def queue_length(app: Celery, server: RedisServer) -> int:
    client = redis.Redis.from_url(server.url)
    try:
        return int(client.llen(app.conf.task_default_queue))
    finally:
        client.close()


def unique_task(app: Celery, recorder: Recorder | None = None, **options: Any) -> Any:
    @app.task(
        **{
            "base": LeasedTask,
            "shared": False,
            "bind": True,
            "name": f"{app.main}.report",
            "lease_key": KEY,
            "lease_queue_unique": True,
            **options,
        }
    )
    def report(self: Any, user_id: int, note: str = "") -> str:
        if recorder is not None:
            recorder.add("ran", (self.request.id, note))
        return f"report {user_id} {note}"

    return report


def first_waits(app: Celery, recorder: Recorder, release: threading.Event, **options: Any) -> Any:
    """A queue-unique task whose call with note "first" runs until ``release`` is set."""

    @app.task(
        base=LeasedTask, bind=True, shared=False, name=f"{app.main}.slow", lease_key=KEY,
        lease_queue_unique=True, **options,
    )  # fmt: skip
    def slow(self: Any, user_id: int, note: str) -> str:
        recorder.add("ran", note)
        if note == "first":
            assert release.wait(WAIT)
        return note

    return slow


def test_a_send_while_one_is_queued_gets_the_queued_job(
    make_app: Callable[..., Celery], redis_server: RedisServer
) -> None:
    app = make_app()
    report = unique_task(app)
    first = report.delay(7, note="first")
    second = report.apply_async((7,), {"note": "second"})
    third = report.s(7, note="third").delay()
    assert first.lease_coalesced is False
    assert second.lease_coalesced is True
    assert third.lease_coalesced is True
    assert second.id == first.id == third.id
    assert queue_length(app, redis_server) == 1
    mark = store_for(app).queued("report-7")
    assert mark is not None
    assert mark.task_id == first.id
    other = report.delay(8)
    assert other.lease_coalesced is False
    assert other.id != first.id
    assert queue_length(app, redis_server) == 2


def test_the_run_takes_the_mark_away_and_the_next_send_publishes(
    make_app: Callable[..., Celery], redis_server: RedisServer, recorder: Recorder
) -> None:
    app = make_app()
    report = unique_task(app, recorder)
    first = report.delay(7, note="first")
    assert report.delay(7).id == first.id
    with worker(app):
        assert first.get(timeout=WAIT) == "report 7 first"
        assert store_for(app).queued("report-7") is None
        again = report.delay(7, note="again")
        assert again.lease_coalesced is False
        assert again.id != first.id
        assert again.get(timeout=WAIT) == "report 7 again"
    assert [note for _, note in recorder.of("ran")] == ["first", "again"]


def test_a_failed_publish_takes_its_mark_away(make_app: Callable[..., Celery], unique: str) -> None:
    app = make_app(task_publish_retry=False)
    app.conf.broker_url = "redis://127.0.0.1:1/0"  # nothing listens there
    report = unique_task(app)
    with pytest.raises(OperationalError):
        report.delay(7)
    assert store_for(app).queued("report-7") is None


def test_a_store_that_is_down_at_send_time_publishes_unchecked(
    make_app: Callable[..., Celery],
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(store="redis://127.0.0.1:1/0", leases_store_options={"check_config": False})
    report = unique_task(app)
    with caplog.at_level(logging.WARNING, logger="celery_leases"):
        first = report.delay(7)
        second = report.delay(7)
    assert first.lease_coalesced is False
    assert second.lease_coalesced is False
    assert first.id != second.id
    assert queue_length(app, redis_server) == 2
    assert "published without the check" in caplog.text


def test_a_send_that_names_its_task_id_is_published_and_takes_no_mark(
    make_app: Callable[..., Celery], redis_server: RedisServer
) -> None:
    app = make_app()
    report = unique_task(app)
    first = report.delay(7)
    named = report.apply_async((7,), task_id="chosen-id")
    assert named.id == "chosen-id"
    assert named.lease_coalesced is False
    assert queue_length(app, redis_server) == 2
    mark = store_for(app).queued("report-7")
    assert mark is not None
    assert mark.task_id == first.id


def test_a_queue_unique_option_set_on_a_task_without_a_lease_key_is_refused_at_send(
    make_app: Callable[..., Celery], redis_server: RedisServer
) -> None:
    # set at the decorator, the option is refused there
    # (tests/unit/test_queue_unique_definition.py); set later, at the send
    app = make_app()

    @app.task(base=LeasedTask, bind=True, shared=False, name=f"{app.main}.keyless")
    def keyless(self: Any) -> None:
        pass

    keyless.lease_queue_unique = True
    with pytest.raises(LeaseConfigurationError, match="lease_key"):
        keyless.delay()
    assert queue_length(app, redis_server) == 0


@pytest.mark.parametrize("value", [0, -1, float("nan"), "yes", 86401])
def test_a_bad_lease_queue_unique_is_refused_at_send(
    make_app: Callable[..., Celery], redis_server: RedisServer, value: object
) -> None:
    app = make_app()

    @app.task(base=LeasedTask, bind=True, shared=False, name=f"{app.main}.bad", lease_key="k")
    def bad(self: Any) -> None:
        pass

    bad.lease_queue_unique = value  # set at the decorator, it is refused there
    with pytest.raises(LeaseConfigurationError, match="lease_queue_unique"):
        bad.delay()
    assert queue_length(app, redis_server) == 0


def test_an_expired_message_discarded_by_the_worker_takes_its_mark_away(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()
    report = unique_task(app, recorder)
    first = report.apply_async((7,), expires=0.5)
    store = store_for(app)
    mark = store.queued("report-7")
    assert mark is not None
    # the message has expired before the worker reads it
    wait_for(lambda: store.now_ms() > mark.queued_at_ms + 1000)
    with worker(app):
        wait_for(lambda: store.queued("report-7") is None)
    assert first.state == "REVOKED"
    assert recorder.of("ran") == []


def test_a_send_carries_the_key_of_its_mark_in_a_header(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(
        base=LeasedTask, bind=True, shared=False, name=f"{app.main}.header", lease_key=KEY,
        lease_queue_unique=True,
    )  # fmt: skip
    def report(self: Any, user_id: int) -> Any:
        return (self.request.headers or {}).get(QUEUED_HEADER) or getattr(
            self.request, QUEUED_HEADER, None
        )

    result = report.delay(7)
    with worker(app):
        assert result.get(timeout=WAIT) == "report-7"


def wait_for(condition: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "waited in vain"
        time.sleep(0.05)


#: a sender that is killed (SIGKILL) after it placed its mark, before its
#: publish: argv broker, store URL, store prefix, queue
_DYING_SENDER = """
import os, signal, sys
from celery import Celery, Task
import celery_leases.queue_unique
from celery_leases import LeasedTask

broker, store, prefix, queue = sys.argv[1:5]
celery_leases.queue_unique.PUBLISH_WINDOW = 1.0
app = Celery("dying", broker=broker, set_as_current=False)
app.conf.update(
    task_default_queue=queue, leases_store=store, leases_store_options={"prefix": prefix}
)


@app.task(base=LeasedTask, bind=True, name="dying.report", lease_key="report-{user_id}",
          lease_queue_unique=True)
def report(self, user_id):
    pass


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


Task.apply_async = die  # the publish Celery would make next
report.delay(7)
"""


def test_a_sender_killed_before_its_publish_blocks_the_key_for_the_publish_window_only(
    make_app: Callable[..., Celery], redis_server: RedisServer, unique: str
) -> None:
    prefix = f"t{unique}:"
    app = make_app(store=redis_server.url, leases_store_options={"prefix": prefix})
    queue = app.conf.task_default_queue
    dying = subprocess.run(
        [sys.executable, "-c", _DYING_SENDER, redis_server.url, redis_server.url, prefix, queue],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )
    assert dying.returncode == -signal.SIGKILL, dying.stderr
    store = store_for(app)
    mark = store.queued("report-7")
    assert mark is not None  # placed, and nothing was published
    assert mark.queued_until_ms - mark.queued_at_ms == 1000
    assert queue_length(app, redis_server) == 0
    wait_for(lambda: store.now_ms() >= mark.queued_until_ms)
    report = unique_task(app)
    sent = report.delay(7)
    assert sent.lease_coalesced is False
    assert sent.id != mark.task_id
    assert queue_length(app, redis_server) == 1


def test_a_published_message_is_marked_for_the_full_bound(
    make_app: Callable[..., Celery], redis_server: RedisServer
) -> None:
    app = make_app()
    report = unique_task(app, lease_queue_unique=900)
    sent = report.apply_async((7,), countdown=100)
    mark = store_for(app).queued("report-7")
    assert mark is not None
    assert mark.task_id == sent.id
    assert mark.queued_until_ms - mark.queued_at_ms >= 1_000_000


def test_a_queued_job_deferred_behind_a_running_one_keeps_its_mark(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()
    release = threading.Event()
    slow = first_waits(app, recorder, release)
    store = store_for(app)
    with worker(app, pool="threads", concurrency=2):
        first = slow.delay(7, "first")
        recorder.wait("ran")
        second = slow.delay(7, "second")
        # the second is delivered, finds the key held, and is deferred: a
        # copy with its task id, still queued, still marked
        recorder.wait("duplicate_deferred")
        mark = store.queued("report-7")
        assert mark is not None
        assert mark.task_id == second.id
        third = slow.delay(7, "third")
        assert third.lease_coalesced is True
        assert third.id == second.id
        release.set()
        assert first.get(timeout=WAIT) == "first"
        assert third.get(timeout=WAIT) == "second"
        assert store.queued("report-7") is None
    assert recorder.of("ran") == ["first", "second"]


def test_a_queued_job_skipped_behind_a_running_one_takes_its_mark_away(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    # "at most one queued and one running": the queued send is skipped, so
    # its mark must go, or later sends would be answered with the skipped job
    app = make_app()
    release = threading.Event()
    slow = first_waits(app, recorder, release, lease_on_busy="skip")
    store = store_for(app)
    with worker(app, pool="threads", concurrency=2):
        first = slow.delay(7, "first")
        recorder.wait("ran")
        second = slow.delay(7, "second")
        assert second.lease_coalesced is False
        with pytest.raises(LeaseSkipped):
            second.get(timeout=WAIT)
        assert store.queued("report-7") is None
        third = slow.delay(7, "third")
        assert third.lease_coalesced is False
        assert third.id != second.id
        with pytest.raises(LeaseSkipped):
            third.get(timeout=WAIT)  # published, and skipped in its turn
        release.set()
        assert first.get(timeout=WAIT) == "first"
    assert recorder.of("ran") == ["first"]


def test_a_revoked_message_discarded_by_the_worker_takes_its_mark_away(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()
    report = unique_task(app, recorder)
    store = store_for(app)
    with worker(app):
        # the worker holds the message until its countdown ends
        queued = report.apply_async((7,), countdown=2)
        assert report.delay(7).id == queued.id
        app.control.revoke(queued.id)
        wait_for(lambda: store.queued("report-7") is None)
        assert queued.state == "REVOKED"
        again = report.delay(7)
        assert again.lease_coalesced is False
        assert again.get(timeout=WAIT) == "report 7 "
    assert [task_id for task_id, _ in recorder.of("ran")] == [again.id]


def test_group_members_and_send_task_publish_without_a_mark_and_leave_the_queued_one(
    make_app: Callable[..., Celery], redis_server: RedisServer, recorder: Recorder
) -> None:
    """The send paths the option does not check: a group's (or chain's)
    members are frozen signatures with their task ids, and ``send_task``
    by name never goes through the task's ``apply_async``. Each publishes;
    the key's mark keeps naming the queued job, and the lease still runs
    every one of them alone."""
    app = make_app()
    report = unique_task(app, recorder)
    queued = report.delay(7, note="queued")
    members = group(report.s(7, note="g1"), report.s(7, note="g2")).apply_async()
    by_name = app.send_task(report.name, args=(7,), kwargs={"note": "by-name"})
    assert queue_length(app, redis_server) == 4
    store = store_for(app)
    mark = store.queued("report-7")
    assert mark is not None
    assert mark.task_id == queued.id
    with worker(app):
        assert members.get(timeout=WAIT) == ["report 7 g1", "report 7 g2"]
        assert by_name.get(timeout=WAIT) == "report 7 by-name"
        assert queued.get(timeout=WAIT) == "report 7 queued"
    assert sorted(note for _, note in recorder.of("ran")) == ["by-name", "g1", "g2", "queued"]
    assert store.queued("report-7") is None


def test_a_naive_eta_keeps_the_mark_as_long_as_celery_holds_the_message(
    make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery reads a naive ``eta`` in the app's timezone (UTC unless set),
    not the machine's: the mark must last until that eta plus the bound."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")  # the machine's clock at UTC+9
    time.tzset()
    try:
        app = make_app()
        report = unique_task(app, lease_queue_unique=900)
        eta = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(seconds=600)
        sent = report.apply_async((7,), eta=eta)
        mark = store_for(app).queued("report-7")
    finally:
        monkeypatch.undo()
        time.tzset()
    assert mark is not None
    assert mark.task_id == sent.id
    assert mark.queued_until_ms - mark.queued_at_ms >= (900 + 590) * 1000
