"""A hard time limit follows Celery's own rule, ``task_acks_on_timeout``.

The pool process running the body is terminated at the limit; its leases
are released as it exits. Then Celery decides what becomes of the message:

- ``task_acks_on_timeout=True`` (Celery's default, or
  ``task_acks_on_failure_or_timeout``): FAILURE (``TimeLimitExceeded``) is
  stored, the message is acknowledged, and the job does not run again;
- ``task_acks_on_timeout=False``: the message goes back to the queue and the
  next delivery claims the job with the next generation and runs it.
"""

from __future__ import annotations

import time

from celery.result import AsyncResult

from celery_leases import LeaseState
from tests.acceptance.app import SLOW_ONCE
from tests.acceptance.conftest import Cluster

TTL = 2.0

#: the hard time limit of the first, long run (seconds)
LIMIT = 2


def test_a_hard_time_limit_fails_the_job_and_it_does_not_run_again(cluster: Cluster) -> None:
    cluster.configure(ttl=TTL)
    cluster.worker("a")
    result = cluster.send(SLOW_ONCE, 30.0, time_limit=LIMIT)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)

    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "TimeLimitExceeded"
    failed_at = time.monotonic()
    record = cluster.wait_record(
        result.id, state=LeaseState.RELEASED, timeout=10, message="the release at the limit"
    )
    assert record.generation == started["generation"]
    # a message given back would be claimed at once (the lease is released)
    # or after one TTL at most: wait well past both
    time.sleep(max(0.0, failed_at + 2 * TTL + 2.0 - time.monotonic()))
    assert len(cluster.side.events(result.id, "start")) == 1
    assert cluster.side.done_count(result.id) == 0
    stored = AsyncResult(result.id, app=cluster.new_app())
    assert stored.state == "FAILURE"


def test_with_acks_on_timeout_off_the_job_runs_again_with_the_next_generation(
    cluster: Cluster,
) -> None:
    cluster.configure(ttl=TTL, acks_on_timeout=False)
    cluster.worker("a")
    result = cluster.send(SLOW_ONCE, 30.0, time_limit=LIMIT)
    (first,) = cluster.side.wait_event(result.id, "start", timeout=30)

    starts = cluster.side.wait_event(result.id, "start", timeout=40, count=2)
    second = starts[1]
    assert second["run"] == 2
    assert second["generation"] > first["generation"]
    record = cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=30, message="the second run's completion"
    )
    assert record.generation == second["generation"]
    stored = AsyncResult(result.id, app=cluster.new_app())
    assert stored.get(timeout=30) == {"run": 2, "generation": second["generation"]}
    assert cluster.side.done_count(result.id) == 1
