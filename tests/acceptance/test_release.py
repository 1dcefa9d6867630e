"""Every way a run can end gives the lease up, or lets it run out within the
TTL: retry, failure, revoke with terminate, soft time limit, warm shutdown.
Nothing is held past the TTL."""

from __future__ import annotations

import time

import pytest

from celery_leases import LeaseState
from tests.acceptance.app import FAIL, RETRY_ONCE, STEPS
from tests.acceptance.conftest import Cluster

TTL = 2.0


def test_retry_releases_and_next_attempt_claims_next_generation(cluster: Cluster) -> None:
    cluster.configure(ttl=TTL)
    cluster.worker("a")
    result = cluster.send(RETRY_ONCE, 3.0)
    (first,) = cluster.side.wait_event(result.id, "attempt", timeout=30)
    generation = first["generation"]

    # during the countdown the lease is released, not held until it runs out
    released = cluster.wait_record(
        result.id, state=LeaseState.RELEASED, timeout=2.5, message="the release before retrying"
    )
    assert released.generation == generation
    assert not released.is_live(cluster.store.now_ms())

    second = result.get(timeout=30)
    record = cluster.record(result.id)
    assert record is not None
    assert record.claimed_at_ms is not None
    # the next claim takes max(previous + 1, store clock)
    assert second == max(generation + 1, record.claimed_at_ms)
    assert (record.state, record.generation) == (LeaseState.COMPLETED, second)
    attempts = cluster.side.events(result.id, "attempt")
    assert [(e["retries"], e["generation"]) for e in attempts] == [
        (0, generation),
        (1, second),
    ]


def test_failing_body_releases_lease(cluster: Cluster) -> None:
    cluster.configure(ttl=TTL)
    cluster.worker("a")
    result = cluster.send(FAIL)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)

    with pytest.raises(ValueError, match="always fails"):
        result.get(timeout=30)
    record = cluster.wait_record(
        result.id, state=LeaseState.RELEASED, timeout=5, message="the release after the failure"
    )
    assert record.generation == started["generation"]
    assert not record.is_live(cluster.store.now_ms())


def test_revoke_terminate_leaves_no_live_lease_past_ttl(cluster: Cluster) -> None:
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a")
    result = cluster.send(STEPS, 30.0)
    cluster.side.wait_event(result.id, "start", timeout=30)

    result.revoke(terminate=True)
    revoked_at = time.monotonic()
    worker.wait_for_log(rf"Terminating {result.id}", timeout=10)
    record = cluster.assert_not_held_past_ttl(result.id, since=revoked_at)
    assert record is not None
    assert record.state is not LeaseState.COMPLETED
    assert cluster.side.done_count(result.id) == 0

    # the pool replaced the terminated child and keeps working
    after = cluster.send(STEPS, 0.1)
    assert after.get(timeout=30)["worker"].startswith(f"{worker.name}@")


def test_soft_time_limit_releases_lease(cluster: Cluster) -> None:
    cluster.configure(ttl=TTL)
    cluster.worker("a")
    result = cluster.send(STEPS, 30.0, soft_time_limit=1)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)

    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "SoftTimeLimitExceeded"
    record = cluster.wait_record(
        result.id, state=LeaseState.RELEASED, timeout=5, message="the release after the limit"
    )
    assert record.generation == started["generation"]
    assert cluster.side.done_count(result.id) == 0


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_warm_shutdown_finishes_running_task_and_holds_nothing(cluster: Cluster, pool: str) -> None:
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a", pool=pool)
    result = cluster.send(STEPS, 2.0)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)

    worker.warm_shutdown()
    assert worker.wait_exit(timeout=30) == 0
    exited_at = time.monotonic()

    assert result.get(timeout=10)["generation"] == started["generation"]
    record = cluster.assert_not_held_past_ttl(result.id, since=exited_at)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, started["generation"])


def test_cold_shutdown_after_soft_timeout_gives_job_to_next_worker(cluster: Cluster) -> None:
    """A warm shutdown turned cold (SIGTERM, then SIGQUIT) stops the running
    task once ``worker_soft_shutdown_timeout`` passed. No live lease is left
    past the TTL, and the job is not lost: the next worker claims the next
    generation and completes it."""
    cluster.configure(ttl=TTL, soft_shutdown=1.0)
    worker_a = cluster.worker("a")
    result = cluster.send(STEPS, 8.0)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)

    worker_a.warm_shutdown()
    worker_a.wait_for_log(r"Warm shutdown", timeout=10)
    worker_a.cold_shutdown()
    worker_a.wait_exit(timeout=30)
    exited_at = time.monotonic()
    record = cluster.assert_not_held_past_ttl(result.id, since=exited_at)
    assert record is not None
    assert (record.state, record.generation) != (LeaseState.COMPLETED, started["generation"])
    assert cluster.side.done_count(result.id) == 0

    worker_b = cluster.worker("b")
    value = result.get(timeout=40)
    assert value["worker"].startswith(f"{worker_b.name}@")
    assert value["generation"] > started["generation"]
    assert cluster.side.done_count(result.id) == 1
