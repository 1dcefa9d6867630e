"""The lease store goes away and comes back: no job is lost, and no body runs
without a lease."""

from __future__ import annotations

import re

from celery_leases import LeaseState
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.servers import RedisServer

TTL = 2.0


def test_store_down_at_claim_defers_job_until_store_is_back(
    store_server: RedisServer, cluster: Cluster, unique: str
) -> None:
    cluster.configure(ttl=TTL, store=store_server.url, store_options={"prefix": f"acc{unique}:"})
    worker = cluster.worker("a")
    store_server.stop()

    result = cluster.send(STEPS, 0.2)
    worker.wait_for_log(r"lease store unavailable at claim", timeout=20)
    # deferred, not run without a lease, not dropped: its copy comes back and
    # is deferred again
    worker.wait_for_log(
        rf"\[{re.escape(result.id)}\]: lease store unavailable at claim .*\(deferral 2\)",
        timeout=30,
    )
    assert cluster.side.events(result.id, "start") == []
    assert not result.ready()

    store_server.start()
    value = result.get(timeout=60)
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert cluster.side.done_count(result.id) == 1
    assert len(cluster.side.events(result.id, "start")) == 1


def test_store_restart_while_held_keeps_the_lease_and_its_generation(
    store_server: RedisServer, cluster: Cluster, unique: str
) -> None:
    """The store restarts on its own data (AOF) while a task holds a lease:
    the record survives, renewals resume, the job completes once with the
    generation it was claimed with."""
    cluster.configure(ttl=TTL, store=store_server.url, store_options={"prefix": f"acc{unique}:"})
    cluster.worker("a")
    result = cluster.send(STEPS, 4 * TTL)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)
    renewed = cluster.wait_record(result.id, state=LeaseState.HELD, timeout=5, message="held")

    store_server.restart()
    after = cluster.record(result.id)
    assert after is not None
    assert after.generation == started["generation"] == renewed.generation

    assert result.get(timeout=60)["generation"] == started["generation"]
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, started["generation"])
    assert record.renew_count > after.renew_count
    assert cluster.side.done_count(result.id) == 1
