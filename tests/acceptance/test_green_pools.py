"""Real ``celery worker -P gevent`` and ``-P eventlet`` processes.

Under monkey-patching a task greenlet that never yields holds the hub, and
every other greenlet of the worker waits. The lease threads are OS threads
with a store connection of their own, so the leases of the other tasks (and
the blocker's own) keep being renewed meanwhile: the test polls each record
from outside and never finds it run out while its run goes on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_leases import LeaseState
from tests.acceptance.app import HOLD_HUB, STEPS, WATCH
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import wait_until
from tests.proxy import Proxy
from tests.servers import RedisServer

TTL = 2.0
RENEW_INTERVAL = TTL / 4
#: each way of holding the hub lasts longer than a TTL
SPIN = 1.5 * TTL
BLOCK = 1.5 * TTL

pytestmark = pytest.mark.parametrize("pool", ["gevent", "eventlet"])


@pytest.fixture
def store_proxy(store_server: RedisServer) -> Iterator[Proxy]:
    """A proxy between the workers and the lease store, which a test may black-hole."""
    with Proxy("127.0.0.1", store_server.port) as proxy:
        yield proxy


def test_a_task_holding_the_hub_does_not_let_other_leases_run_out(
    cluster: Cluster, pool: str
) -> None:
    cluster.configure(ttl=TTL, renew_interval=RENEW_INTERVAL)
    worker = cluster.worker("green", pool=pool, concurrency=4)
    cooperative = cluster.send(STEPS, SPIN + BLOCK + 2.0)
    (started,) = cluster.side.wait_event(cooperative.id, "start", timeout=30)
    blocker = cluster.send(HOLD_HUB, SPIN, BLOCK)
    cluster.side.wait_event(blocker.id, "start", timeout=30)

    # polled from this process all along: while a run goes on, its record
    # is held by it and live in the store's own clock
    samples = 0
    while not cooperative.ready():
        now_ms = cluster.store.now_ms()
        for job in (cooperative.id, blocker.id):
            record = cluster.record(job)
            assert record is not None
            if record.state is LeaseState.HELD:
                assert record.is_live(now_ms), (job, record)
                samples += 1
        time.sleep(0.1)
        assert samples < 1000, "the runs took far longer than planned"
    assert samples >= 30

    assert cooperative.get(timeout=10)["generation"] == started["generation"]
    blocker.get(timeout=10)
    for job in (cooperative.id, blocker.id):
        record = cluster.record(job)
        assert record is not None
        assert record.state is LeaseState.COMPLETED, record
        assert len(cluster.side.events(job, "start")) == 1  # never fenced out, never run again
    assert cluster.side.done_count(cooperative.id) == 1
    assert "heartbeat failed" not in worker.log()


def test_a_black_holed_store_makes_the_lease_read_lost_at_its_deadline(
    cluster: Cluster, store_proxy: Proxy, unique: str, pool: str
) -> None:
    cluster.configure(
        ttl=TTL,
        renew_interval=RENEW_INTERVAL,
        store=f"redis://127.0.0.1:{store_proxy.port}/0",
        store_options={"prefix": f"acc{unique}:"},
    )
    worker = cluster.worker("green", pool=pool)
    result = cluster.send(WATCH, 6 * TTL)
    cluster.side.wait_event(result.id, "start", timeout=30)
    wait_until(
        lambda: (r := cluster.record(result.id)) is not None and r.renew_count >= 2,
        timeout=10,
        message="two renewals",
    )

    store_proxy.blackhole()
    holed_at = time.time()
    (lost,) = cluster.side.wait_event(result.id, "lost", timeout=4 * TTL)
    oks = [event for event in cluster.side.events(result.id, "ok") if event["at"] <= lost["at"]]
    store_proxy.heal()

    assert lost["reason"] == "deadline"
    # the local deadline the lease last showed, within a poll of the body
    deadline = oks[-1]["deadline"]
    assert deadline - 0.25 <= lost["at"] <= deadline + RENEW_INTERVAL + 0.5, (lost, oks[-1])
    assert holed_at < lost["at"] <= holed_at + TTL + RENEW_INTERVAL + 0.5
    record = cluster.record(result.id)
    assert record is not None
    assert record.state is not LeaseState.COMPLETED
    # the notice, handed from the deadline thread to the notifier greenlet
    worker.wait_for_log(rf"lease lost: job={result.id} .*reason=deadline", timeout=10)


def test_a_green_worker_with_lease_on_lost_raise_stops_at_start(
    cluster: Cluster, pool: str
) -> None:
    worker = cluster.worker("raise", pool=pool, start=False, on_lost="raise")
    with pytest.raises(AssertionError, match="exited before logging"):
        worker.start(ready_timeout=60)
    assert worker.wait_exit(timeout=30) != 0
    log = worker.log()
    assert "Traceback" not in log  # one line says what to change
    assert f"the {pool} pool cannot honour" in log
    assert "lease_on_lost='flag'" in log


def test_an_autoscaled_worker_sizes_the_store_pool_to_its_maximum(
    cluster: Cluster, pool: str
) -> None:
    # -c 2, but --autoscale lets the pool grow to 150 greenlets: the store's
    # task pool is sized to that maximum before the first task
    worker = cluster.worker("wide", pool=pool, concurrency=2, extra_args=("--autoscale", "150,2"))
    assert "gets max_connections=158" in worker.log()
    assert cluster.send(STEPS, 0.1).get(timeout=30)["generation"] > 0
