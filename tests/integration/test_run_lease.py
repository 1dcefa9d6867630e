"""The lease as the body sees it: after a hand-over, and after a slow claim.

Real worker in this process, real Redis broker, result backend and store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_leases import LeasedTask, LeaseLost
from celery_leases.fencing import check_token
from tests.integration.conftest import WAIT, Recorder, worker
from tests.proxy import Proxy
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


def _what_the_lease_says(task: LeasedTask) -> dict[str, Any]:
    lease = task.lease
    seen: dict[str, Any] = {
        "lost": lease.lost,
        "reason": lease.lost_reason,
        "remaining": lease.remaining(),
    }
    for step, call in (("check", lease.check), ("fenced", lambda: check_token(lease))):
        try:
            call()
        except LeaseLost as exc:
            seen[step] = exc.reason
        else:
            seen[step] = "passed"
    return seen


HANDED_OVER = {
    "lost": True,
    "reason": "handed-over",
    "remaining": 0.0,
    "check": "handed-over",
    "fenced": "handed-over",
}


def test_a_lease_handed_over_by_retry_without_throw_reads_lost(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True, max_retries=1, lease_ttl=10)
    def flaky(self: LeasedTask) -> str:
        if self.request.retries == 0:
            self.retry(countdown=0.2, throw=False)
            recorder.add("after-retry", _what_the_lease_says(self))
            return "first attempt returned"
        recorder.add("second", _what_the_lease_says(self))
        return "retried"

    with worker(app):
        flaky.delay()
        [second] = recorder.wait("second")
    [first] = recorder.of("after-retry")
    assert first == HANDED_OVER
    assert second["lost"] is False  # the retry run holds the job
    assert second["check"] == second["fenced"] == "passed"
    assert recorder.of("lease_lost") == []  # a hand-over is no loss to announce


def test_a_lease_handed_over_by_replace_reads_lost(
    make_app: Callable[..., Celery], recorder: Recorder
) -> None:
    app = make_app()

    @app.task(shared=False, base=LeasedTask, bind=True)
    def add(self: LeasedTask, x: int, y: int) -> int:
        return x + y

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=10)
    def outer(self: LeasedTask, x: int) -> Any:
        try:
            return self.replace(add.s(x, 1))
        finally:  # replace() raises Ignore once the replacement is sent
            recorder.add("after-replace", _what_the_lease_says(self))

    with worker(app):
        assert outer.delay(41).get(timeout=WAIT) == 42
    assert recorder.of("after-replace") == [HANDED_OVER]


def test_a_slow_claim_shortens_the_body_s_deadline(
    make_app: Callable[..., Celery], redis_server: RedisServer, recorder: Recorder, unique: str
) -> None:
    """The deadline counts from before the claim was sent: a claim whose
    request and reply each wait 1 s leaves the body at least 2 s less."""
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        app = make_app(
            f"redis://127.0.0.1:{proxy.port}/0", leases_store_options={"prefix": f"sc{unique}:"}
        )

        @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=10)
        def job(self: LeasedTask) -> None:
            recorder.add("remaining", (self.lease.remaining(), self.lease.timing.safe_duration))
            proxy.heal()

        proxy.delay(1.0)
        with worker(app):
            job.delay().get(timeout=WAIT)
    [(remaining, safe_duration)] = recorder.of("remaining")
    assert 0 < remaining <= safe_duration - 1.9
