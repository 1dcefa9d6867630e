"""A worker whose wall clock is off by an hour keeps and completes its lease
as any other: lease times are the store's, deadlines are on time.monotonic."""

from __future__ import annotations

import time

import pytest

from celery_leases import LeaseState
from tests.acceptance.app import WATCH
from tests.acceptance.conftest import Cluster

TTL = 4.0
# renewals well inside the safe duration (3.5 s): a loaded machine that stalls
# the worker for a second or two must not pass for a clock problem
RENEW_INTERVAL = 0.5
RUN = 6.0


@pytest.mark.parametrize("skew", [-3600.0, 3600.0], ids=["behind", "ahead"])
def test_skewed_worker_clock_keeps_lease_on_store_time(cluster: Cluster, skew: float) -> None:
    cluster.configure(ttl=TTL, renew_interval=RENEW_INTERVAL)
    cluster.worker("a", clock_skew=skew)
    result = cluster.send(WATCH, RUN)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=30)
    # the worker's wall clock really is off (events carry its time.time())
    assert abs(started["at"] - time.time() - skew) < 60

    samples = 0
    while not result.ready():
        record = cluster.record(result.id)
        assert record is not None
        if record.state is LeaseState.HELD:
            # granted in store time: never more than a TTL ahead, never behind
            left_ms = record.lease_until_ms - cluster.store.now_ms()
            assert 0 < left_ms <= TTL * 1000 + 100, record
            samples += 1
        time.sleep(0.2)
        assert samples < 200, "the task ran far longer than planned"
    assert samples >= 10

    assert result.get(timeout=10) is None
    assert cluster.side.events(result.id, "lost") == []
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, started["generation"])
    assert record.renew_count >= 4, record
