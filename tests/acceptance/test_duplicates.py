"""A duplicate delivery is deferred, never dropped: when the holder dies, the
deferred copy finishes the job, once. The main cases run on Redis and on
RabbitMQ, where a countdown message is held unacknowledged in the worker."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_leases import LeaseState
from celery_leases.sending import keeping_send_id
from tests.acceptance.app import ECHO, STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import Worker, wait_until
from tests.broker_servers import CONSUMER_TIMEOUT

TTL = 2.0


def _holder_and_deferred_duplicate(
    cluster: Cluster,
) -> tuple[AsyncResult, dict[str, Any], Worker, Worker]:
    """Start two workers, send a 4 s job, then its duplicate.

    Returns the result, the holder's start event, the holder (A) and the
    worker that received and deferred the duplicate (B).
    """
    workers = [cluster.worker("a"), cluster.worker("b")]
    send_id = f"send-{uuid.uuid4().hex}"
    with keeping_send_id(send_id):
        result = cluster.send(STEPS, 4.0)
    (started_a,) = cluster.side.wait_event(result.id, "start", timeout=30)
    generation_a = started_a["generation"]
    # whichever worker took the job is A, the holder; the other is B
    worker_a, worker_b = sorted(
        workers, key=lambda w: not started_a["worker"].startswith(f"{w.name}@")
    )

    # the same message again (same task id and send id), as a broker
    # redelivers it while A runs
    with keeping_send_id(send_id):
        cluster.send(STEPS, 4.0, task_id=result.id)
    received = re.escape(f"Task {STEPS}[{result.id}] received")
    # the duplicate, then its re-published copy
    wait_until(
        lambda: len(re.findall(received, worker_b.log())) >= 2,
        timeout=10,
        message="B to receive the duplicate and its deferred copy",
    )
    assert cluster.side.events(result.id, "start") == [started_a], "B ran a held job"
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.HELD, generation_a)
    assert cluster.side.done_count(result.id) == 0, "A finished before it could be killed"
    return result, started_a, worker_a, worker_b


@pytest.mark.parametrize("broker_kind", ["redis", "amqp"], indirect=True)
def test_duplicate_waits_for_killed_holder_then_completes_once(
    cluster: Cluster, broker_kind: str
) -> None:
    """Timeline (TTL 2 s, body 4 s)::

    A claims generation g and runs the body
    the same message is delivered again; B receives it, finds the lease
        held, re-publishes it with a countdown and does not run the body
    A is killed with SIGKILL (no release: its lease runs out); RabbitMQ
        also gives A's own message to B at once, which B defers as well
    B's first copy claims g+1 (a takeover), runs the body, completes; a
        second copy finds the job completed and is skipped
    """
    cluster.configure(ttl=TTL)
    result, started_a, worker_a, worker_b = _holder_and_deferred_duplicate(cluster)
    generation_a = started_a["generation"]

    worker_a.kill()

    record = cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=40, message="the deferred copy to finish"
    )
    assert record.claimed_at_ms is not None
    generation_b = max(generation_a + 1, record.claimed_at_ms)
    assert record.generation == generation_b
    # B claimed A's run-out lease, not a released one
    assert record.takeovers == 1
    (started_b,) = [e for e in cluster.side.events(result.id, "start") if e != started_a]
    assert started_b["generation"] == generation_b
    assert started_b["worker"].startswith(f"{worker_b.name}@")

    value = AsyncResult(result.id, app=cluster.new_app()).get(timeout=10)
    assert value == {"worker": started_b["worker"], "generation": generation_b}
    assert cluster.side.done_count(result.id) == 1
    succeeded = re.escape(f"Task {STEPS}[{result.id}] succeeded")
    # the worker logs the success after the result is stored
    worker_b.wait_for_log(succeeded, timeout=10)
    assert len(re.findall(succeeded, worker_a.log() + worker_b.log())) == 1
    if broker_kind == "amqp":
        # A's own message came back when its connection closed: the same
        # run, so it was skipped, not run a second time
        worker_b.wait_for_log(rf"lease skipped: job={re.escape(result.id)}", timeout=30)
        assert cluster.side.done_count(result.id) == 1


@pytest.mark.parametrize("broker_kind", ["redis", "amqp"], indirect=True)
def test_delivery_of_completed_job_is_skipped(cluster: Cluster) -> None:
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a")
    # the same send twice (one send id), as a broker redelivers a message
    with keeping_send_id("send-1"):
        result = cluster.send(STEPS, 0.1)
    value = result.get(timeout=30)

    with keeping_send_id("send-1"):
        cluster.send(STEPS, 0.1, task_id=result.id)
    worker.wait_for_log(
        rf"lease skipped: job={re.escape(result.id)} .*generation={value['generation']}",
        timeout=30,
    )
    assert cluster.side.done_count(result.id) == 1
    assert len(cluster.side.events(result.id, "start")) == 1
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert AsyncResult(result.id, app=cluster.new_app()).get(timeout=10) == value


def test_takeover_past_limit_fails_job_without_running_it(cluster: Cluster) -> None:
    """With ``leases_max_takeovers = 0`` the first takeover (the holder was
    killed) marks the job as poison: completed in the store, failed in the
    backend, its body not run again."""
    cluster.configure(ttl=TTL, max_takeovers=0)
    result, started_a, worker_a, _ = _holder_and_deferred_duplicate(cluster)

    worker_a.kill()
    record = cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=40, message="the poison verdict"
    )
    assert record.generation > started_a["generation"]
    assert record.takeovers == 1
    result.get(timeout=20, propagate=False)
    assert result.state == "FAILURE"
    assert "took over a run-out lease 1 times (limit 0)" in str(result.result)
    # the backend names the error's own class, which needs it to survive pickling
    assert type(result.result).__name__ == "TakeoverLimitExceeded"
    assert cluster.side.events(result.id, "start") == [started_a]
    assert cluster.side.done_count(result.id) == 0


@pytest.mark.parametrize("broker_kind", ["amqp"], indirect=True)
def test_a_deferred_copy_does_not_outlive_the_consumer_timeout(cluster: Cluster) -> None:
    """Timeline (RabbitMQ ``consumer_timeout`` 8 s, checked every second; TTL 20 s)::

    A claims the job and runs its 4 s body
    the same message again: B finds the lease held for about 20 s more
        (a countdown of 20 s would keep the copy unacknowledged in B past
        the consumer timeout: the node would close B's channel with
        PRECONDITION_FAILED and B would stop consuming)
    the countdown is capped at half the consumer timeout: B's copy comes
        back after 4 s at most and is deferred again or skipped
    A completes; B's next copy finds the job completed and is skipped
    """
    cluster.configure(ttl=20.0, consumer_timeout=CONSUMER_TIMEOUT)
    result, started_a, worker_a, worker_b = _holder_and_deferred_duplicate(cluster)
    deferred_at = time.monotonic()

    value = result.get(timeout=30)
    assert value == {"worker": started_a["worker"], "generation": started_a["generation"]}
    worker_b.wait_for_log(rf"lease skipped: job={re.escape(result.id)}", timeout=30)
    # past the point where an uncapped copy would have been taken from B
    time.sleep(max(0.0, deferred_at + CONSUMER_TIMEOUT + 4.0 - time.monotonic()))
    assert worker_b.alive(), worker_b.log()
    assert "PRECONDITION_FAILED" not in worker_b.log()
    assert cluster.side.done_count(result.id) == 1
    countdowns = [
        float(found)
        for found in re.findall(
            rf"lease deferred: job={re.escape(result.id)} .*countdown=([0-9.]+)", worker_b.log()
        )
    ]
    assert countdowns, worker_b.log()
    assert max(countdowns) <= CONSUMER_TIMEOUT / 2
    # B still takes work
    echo = cluster.send(ECHO, "after")
    assert echo.get(timeout=30)["value"] == "after"
    assert worker_a.alive()
