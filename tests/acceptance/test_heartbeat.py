"""The heartbeat keeps long tasks alive, and a task whose renewals cannot get
through hears that it lost its lease."""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_leases import LeaseState
from tests.acceptance.app import STEPS, WATCH
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import wait_until
from tests.servers import RedisServer

TTL = 2.0
RENEW_INTERVAL = TTL / 3


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_heartbeat_keeps_a_task_five_times_its_ttl_alive(cluster: Cluster, pool: str) -> None:
    cluster.configure(ttl=TTL)
    cluster.worker("a", pool=pool)
    result = cluster.send(STEPS, 5 * TTL)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)
    generation = started["generation"]

    # sampled during the run: always one live holder, always this generation
    samples = 0
    while not result.ready():
        record = cluster.record(result.id)
        assert record is not None
        assert record.generation == generation
        if record.state is LeaseState.HELD:
            assert record.is_live(cluster.store.now_ms()), record
            samples += 1
        time.sleep(0.25)
        assert samples < 200, "the task ran far longer than planned"
    assert samples >= 20

    assert result.get(timeout=10)["generation"] == generation
    record = cluster.record(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert record.generation == generation
    # 10 s renewed every 2/3 s is about 15 renewals; allow a loaded machine
    assert record.renew_count >= 8, record
    assert len(cluster.side.events(result.id, "start")) == 1


def test_blocked_renewals_surface_lease_lost_within_one_renew_interval(
    store_server: RedisServer, cluster: Cluster, unique: str
) -> None:
    cluster.configure(
        ttl=TTL,
        renew_interval=RENEW_INTERVAL,
        store=store_server.url,
        store_options={"prefix": f"acc{unique}:"},
    )
    cluster.worker("a")
    result = cluster.send(WATCH, 30.0)
    cluster.side.wait_event(result.id, "start", timeout=30)
    # let a couple of renewals through first
    cluster.wait_record(result.id, timeout=10, message="a renewal", state=LeaseState.HELD)
    wait_until(
        lambda: (r := cluster.record(result.id)) is not None and r.renew_count >= 2,
        timeout=10,
        message="two renewals",
    )

    assert store_server.proc is not None
    os.kill(store_server.proc.pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        (lost,) = cluster.side.wait_event(result.id, "lost", timeout=4 * TTL)
        oks = [e for e in cluster.side.events(result.id, "ok") if e["at"] <= lost["at"]]
    finally:
        os.kill(store_server.proc.pid, signal.SIGCONT)

    assert lost["reason"] == "deadline"
    # the local deadline as the lease last reported it, before it was lost
    deadline = oks[-1]["deadline"]
    assert lost["at"] <= deadline + RENEW_INTERVAL + 0.5, (lost, oks[-1])
    assert lost["at"] >= deadline - 0.25, (lost, oks[-1])
    # the last renewal that got through was sent before the store froze
    assert lost["at"] <= stopped_at + TTL + RENEW_INTERVAL + 0.5
    assert lost["at"] > stopped_at
    # the lost run never completed
    record = cluster.record(result.id)
    assert record is not None
    assert record.state is not LeaseState.COMPLETED
