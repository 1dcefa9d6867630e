"""A duplicate delivery is deferred, never dropped: when the holder dies, the
deferred copy finishes the job, once."""

from __future__ import annotations

import re
import time

from celery.result import AsyncResult

from celery_leases import LeaseState
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import wait_until

TTL = 2.0


def test_duplicate_waits_for_killed_holder_then_completes_once(cluster: Cluster) -> None:
    """Timeline (TTL 2 s, body 4 s)::

    A claims generation g and runs the body
    the same task id is sent again; B receives it, finds the lease held,
        re-publishes it with a countdown and does not run the body
    A is killed with SIGKILL (no release: its lease runs out)
    B's deferred copy claims g+1 (a takeover), runs the body, completes
    """
    cluster.configure(ttl=TTL)
    workers = [cluster.worker("a"), cluster.worker("b")]
    result = cluster.send(STEPS, 4.0)
    (started_a,) = cluster.side.wait_event(result.id, "start", timeout=30)
    generation_a = started_a["generation"]
    # whichever worker took the job is A, the holder; the other is B
    worker_a, worker_b = sorted(
        workers, key=lambda w: not started_a["worker"].startswith(f"{w.name}@")
    )

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

    worker_a.kill()
    killed_at = time.monotonic()

    record = cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=40, message="the deferred copy to finish"
    )
    assert record.generation == generation_a + 1
    assert record.takeovers == 1
    # B only claimed once A's lease had run out
    (started_b,) = [e for e in cluster.side.events(result.id, "start") if e != started_a]
    assert started_b["generation"] == generation_a + 1
    assert started_b["worker"].startswith(f"{worker_b.name}@")
    assert time.monotonic() - killed_at < 40

    value = AsyncResult(result.id, app=cluster.new_app()).get(timeout=10)
    assert value == {"worker": started_b["worker"], "generation": generation_a + 1}
    assert cluster.side.done_count(result.id) == 1
    succeeded = re.escape(f"Task {STEPS}[{result.id}] succeeded")
    assert len(re.findall(succeeded, worker_a.log() + worker_b.log())) == 1


def test_delivery_of_completed_job_is_skipped(cluster: Cluster) -> None:
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a")
    result = cluster.send(STEPS, 0.1)
    value = result.get(timeout=30)

    cluster.send(STEPS, 0.1, task_id=result.id)
    worker.wait_for_log(
        rf"{re.escape(result.id)}.*already completed by generation {value['generation']}; skipping",
        timeout=30,
    )
    assert cluster.side.done_count(result.id) == 1
    assert len(cluster.side.events(result.id, "start")) == 1
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert AsyncResult(result.id, app=cluster.new_app()).get(timeout=10) == value
