"""``lease_on_busy="skip"`` in a real Celery worker running in this process.

The broker and result backend are a real redis-server; the lease store is
the memory store or a real Redis store. Another send's hold on the job is
made with a claim of the store, as another worker's would be.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import Acquired, LeasedTask, LeaseSkipped, LeaseState, Released
from celery_leases.sending import keeping_send_id
from celery_leases.task import store_for
from tests.acceptance.harness import wait_until
from tests.integration.conftest import WAIT, Recorder, worker
from tests.integration.test_task_inprocess import store_url
from tests.proxy import Proxy
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

#: the holder's lease: long enough that only a skip answers within it
HOLD = 30.0


def _skipping(app: Celery, recorder: Recorder) -> Any:
    @app.task(
        shared=False, base=LeasedTask, bind=True, lease_key="beat-{key}", lease_on_busy="skip"
    )
    def beat(self: LeasedTask, key: str) -> str:
        recorder.add("body", self.request.id)
        return "ran"

    return beat


@pytest.fixture(params=["memory", "redis"])
def app(
    request: pytest.FixtureRequest,
    make_app: Callable[..., Celery],
    tmp_path: Path,
    unique: str,
) -> Celery:
    """An app on the memory store or a real Redis store."""
    url, options = store_url(request.param, request, tmp_path, unique)
    return make_app(url, leases_store_options=options)


def test_a_call_whose_key_another_send_holds_is_answered_at_once_with_lease_skipped(
    app: Celery, recorder: Recorder
) -> None:
    beat = _skipping(app, recorder)
    store = store_for(app)
    store.claim("beat-k", "other-worker:1:abc", HOLD, send_id="holder-send", task_id="holder")
    with worker(app):
        result = beat.delay("k")
        started = time.monotonic()
        with pytest.raises(LeaseSkipped, match=r"held by task holder \(generation \d+") as raised:
            result.get(timeout=WAIT)
        raised.value.with_traceback(None)  # its frames would keep the result alive
        answered = time.monotonic() - started
    assert answered < HOLD / 2  # not after the holder's lease ran out
    assert result.state == "FAILURE"
    assert recorder.of("body") == []
    assert recorder.of("duplicate_deferred") == []  # not published again
    [skipped] = recorder.of("lease_skipped")
    assert (skipped["reason"], skipped["holder_task_id"]) == ("busy", "holder")
    assert skipped["task_id"] == result.id
    record = store.get("beat-k")
    assert record is not None
    assert (record.owner, record.state) == ("other-worker:1:abc", LeaseState.HELD)
    # named in the store as the job's last skipped call, after its answer
    noted = wait_until(
        lambda: next((e for e in store.waiters("beat-k") if e.is_last_skipped), None),
        timeout=WAIT,
        message="the last skipped call's mark",
    )
    assert noted.task_id == result.id
    assert store.take_waiters("beat-k") == []  # a mark: nothing to publish
    broker = redis.Redis.from_url(app.conf.broker_url)
    try:  # acknowledged: nothing left in the queue or among the unacked
        assert broker.llen(app.conf.task_default_queue) == 0
        assert broker.hlen("unacked") == 0
    finally:
        broker.close()


def test_a_delivery_of_the_holders_own_send_waits_and_takes_the_job_over(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()
    beat = _skipping(app, recorder)
    store = store_for(app)
    # the holder (a worker since gone) came from the send this message repeats
    store.claim("beat-k", "gone-worker:1:abc", 1.5, send_id="send-1", task_id="holder")
    with worker(app), keeping_send_id("send-1"):
        result = beat.apply_async(("k",), task_id="holder")
        assert result.get(timeout=WAIT) == "ran"  # once the holder's lease ran out
    assert recorder.of("lease_skipped") == []
    assert recorder.wait("duplicate_deferred")[0]["reason"] == "held"
    assert recorder.of("body") == ["holder"]


def test_an_eager_call_whose_key_is_held_raises_lease_skipped(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()
    beat = _skipping(app, recorder)
    store_for(app).claim("beat-k", "other-worker:1:abc", HOLD, task_id=uuid.uuid4().hex)
    with pytest.raises(LeaseSkipped) as raised:
        beat.apply(("k",), throw=True)
    assert raised.value.job_id == "beat-k"
    assert raised.value.holder == "other-worker:1:abc"
    assert recorder.of("body") == []


def test_a_new_send_of_the_holders_own_task_id_waits_instead_of_being_skipped(
    app: Celery, recorder: Recorder
) -> None:
    """A ``retry()`` or ``replace()`` whose release never reached the store
    (the store's connection dropped), or the same task id sent again, is a
    new send of the task id that holds the job. Skipped, its ``LeaseSkipped``
    would be stored as that task id's result, and the retry that should run
    the job again would be lost; it waits for the lease instead."""
    beat = _skipping(app, recorder)
    store = store_for(app)
    # the state such a retry finds: its own task id holds the job from the
    # first attempt's send, until that lease runs out
    holder = uuid.uuid4().hex
    store.claim("beat-k", "gone-worker:1:abc", 1.5, send_id="first-attempt", task_id=holder)
    with worker(app):
        result = beat.apply_async(("k",), task_id=holder)  # a new send id
        assert result.get(timeout=WAIT) == "ran"
    assert recorder.of("lease_skipped") == []
    assert recorder.of("body") == [holder]
    record = store.get("beat-k")
    assert record is not None
    assert (record.state, record.task_id) == (LeaseState.COMPLETED, holder)


def test_a_store_that_fails_at_the_skip_decision_defers_the_call_and_skips_it_later(
    make_app: Callable[..., Celery], redis_server: RedisServer, recorder: Recorder, unique: str
) -> None:
    """The claim is refused, then the read of the holder's record loses its
    reply: whether the holder is another send is unknown, so the call is
    neither skipped nor failed for good nor run; it waits and asks again."""
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        app = make_app(
            f"redis://127.0.0.1:{proxy.port}/0", leases_store_options={"prefix": f"t{unique}:"}
        )
        beat = _skipping(app, recorder)
        store = store_for(app)
        store.claim("beat-k", "other-worker:1:abc", HOLD, send_id="holder-send", task_id="holder")
        proxy.drop_reply_to(b"HGETALL")  # the record read after the refused claim
        with worker(app):
            result = beat.delay("k")
            with pytest.raises(LeaseSkipped) as raised:
                result.get(timeout=WAIT)
            raised.value.with_traceback(None)
        assert proxy.dropped_replies == 1
    [deferred] = recorder.of("duplicate_deferred")
    assert deferred["reason"] == "held"
    assert len(recorder.of("lease_skipped")) == 1
    assert recorder.of("body") == []


def test_a_duplicate_sent_with_a_countdown_is_judged_when_it_runs(
    app: Celery, recorder: Recorder
) -> None:
    """The skip is decided at the claim, when the countdown has ended: a
    call whose countdown ends while the job is held is skipped, one whose
    countdown ends after the holder released it runs."""
    beat = _skipping(app, recorder)
    store = store_for(app)
    held = store.claim("beat-k", "other-worker:1:abc", HOLD, send_id="holder-send", task_id="h")
    assert isinstance(held, Acquired)
    with worker(app):
        early = beat.apply_async(("k",), countdown=0.5)
        with pytest.raises(LeaseSkipped) as raised:
            early.get(timeout=WAIT)
        raised.value.with_traceback(None)
        late = beat.apply_async(("k",), countdown=2.0)
        assert isinstance(store.release("beat-k", held.owner, held.generation), Released)
        assert late.get(timeout=WAIT) == "ran"
    assert recorder.of("body") == [late.id]
    [skipped] = recorder.of("lease_skipped")
    assert skipped["task_id"] == early.id


def test_a_retry_whose_release_never_reached_the_store_runs_the_job_again(
    make_app: Callable[..., Celery], redis_server: RedisServer, recorder: Recorder, unique: str
) -> None:
    """The first attempt calls ``retry()`` while the lease store cannot be
    reached: its release fails, the retry message goes out (a new send of
    the same task id), and the first attempt's lease stays held until it
    runs out. The retry waits for it and runs; skipped, it would store
    ``LeaseSkipped`` as the task's result and the job would never run again."""
    gate = threading.Event()
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        app = make_app(
            f"redis://127.0.0.1:{proxy.port}/0", leases_store_options={"prefix": f"t{unique}:"}
        )

        @app.task(
            shared=False, base=LeasedTask, bind=True, lease_key="retry-{key}",
            lease_on_busy="skip", lease_ttl=6.0,
        )  # fmt: skip
        def flaky(self: LeasedTask, key: str) -> str:
            recorder.add("attempt", self.request.retries)
            if self.request.retries == 0:
                assert gate.wait(WAIT)
                raise self.retry(countdown=0.1, max_retries=1)
            return "ran"

        with worker(app):
            result = flaky.delay("k")
            recorder.wait("attempt")
            proxy.refuse()  # the store goes away under the first attempt
            gate.set()
            # the retry message is delivered and deferred: the store is down
            recorder.wait("duplicate_deferred")
            proxy.heal()
            assert result.get(timeout=WAIT) == "ran"
    assert recorder.of("attempt") == [0, 1]
    assert recorder.of("lease_skipped") == []
    assert recorder.of("lease_released") == []  # the release never reached the store
