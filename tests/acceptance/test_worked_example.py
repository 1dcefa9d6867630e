"""The protocol's worked example with real workers, on every store, and on RabbitMQ.

Timeline (TTL 2 s, broker visibility timeout 3 s)::

    t=0     A receives the job, claims generation g, starts the body
    t~0.1   A is frozen (SIGSTOP of its whole process group)
    t~2.1   A's lease runs out in the store
    t~3     the message has been unacked for a visibility timeout; B starts
            (on Redis, when the broker's unacked index says so)
    t~3-4   the broker hands the unacked message to B; B claims g+1
    t~5     B completes: the store accepts, the backend stores B's result
    later   A is resumed; its body ends; its completion with g is refused:
            A logs "lease fenced-out" and writes nothing to the result backend
"""

from __future__ import annotations

import time

import pytest
import redis
from celery.result import AsyncResult

from celery_leases import LeaseState
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import wait_until
from tests.broker_servers import RabbitServer

#: what the RabbitMQ node logs when it closes a connection that went silent
MISSED_HEARTBEATS = "missed heartbeats from client"


@pytest.mark.parametrize(
    ("broker_kind", "lease_store_target"),
    [
        ("redis", "redis"),
        ("redis", "postgres"),
        ("redis", "sqlite"),
        ("redis", "mysql"),
        ("amqp", "redis"),
    ],
    indirect=True,
)
def test_paused_worker_is_fenced_out_and_successor_result_stands(
    cluster: Cluster, broker_kind: str, request: pytest.FixtureRequest
) -> None:
    cluster.configure(visibility_timeout=3.0)
    rabbit: RabbitServer | None = None
    if broker_kind == "amqp":
        rabbit = request.getfixturevalue("rabbit_server")
        missed_before = rabbit.log().count(MISSED_HEARTBEATS)
    worker_a = cluster.worker("a")
    result = cluster.send(STEPS, 1.5)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)
    generation_a = started["generation"]
    assert isinstance(generation_a, int)
    worker_a.freeze()
    if broker_kind == "redis":
        _wait_past_visibility(cluster.config.broker, cluster.config.visibility_timeout)

    worker_b = cluster.worker("b")
    record = cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=40, message="B's completion"
    )
    if rabbit is not None:
        # the node let go of A's message because A's heartbeats stopped
        assert rabbit.log().count(MISSED_HEARTBEATS) > missed_before
    assert record.claimed_at_ms is not None
    generation_b = max(generation_a + 1, record.claimed_at_ms)
    assert record.generation == generation_b
    value = result.get(timeout=20)
    assert value["generation"] == generation_b
    assert value["worker"].startswith(f"{worker_b.name}@")

    worker_a.thaw()
    worker_a.wait_for_log(rf"lease fenced-out: job={result.id}", timeout=30)
    # A's body did run to its end: only the completion was refused
    assert cluster.side.done_count(result.id) == 2

    stored = AsyncResult(result.id, app=cluster.new_app())
    assert stored.state == "SUCCESS"
    assert stored.get(timeout=10) == value
    final = cluster.record(result.id)
    assert final is not None
    assert final.state is LeaseState.COMPLETED
    assert final.generation == generation_b
    assert final.owner == record.owner
    assert [r.job_id for r in cluster.store.records()].count(result.id) == 1


def _wait_past_visibility(broker_url: str, visibility_timeout: float) -> None:
    """Wait until the Redis broker's unacked index holds a delivery older
    than the visibility timeout.

    kombu gives such a message back when a consumer starts, then on a
    cadence of its own: 100 s before kombu made it configurable
    (``unacked_restore_interval``, which the oldest kombu we support does
    not read). A worker B started earlier could wait that long.
    """
    client = redis.Redis.from_url(broker_url)
    try:

        def past() -> bool:
            oldest = client.zrange("unacked_index", 0, 0, withscores=True)
            return bool(oldest) and time.time() - oldest[0][1] > visibility_timeout

        wait_until(past, timeout=30, message="the delivery to pass the visibility timeout")
    finally:
        client.close()
