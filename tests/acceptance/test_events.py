"""``-E`` alone makes real workers send lease events, from every pool."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import wait_until
from tests.integration.test_observe import receiving


@pytest.fixture(autouse=True)
def _collect_results(cluster: Cluster) -> Iterator[None]:
    """Collect the test's AsyncResults (in reference cycles) while the servers are up:
    their ``__del__`` talks to the result backend."""
    yield
    gc.collect()


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_a_worker_started_with_dash_e_sends_lease_events(cluster: Cluster, pool: str) -> None:
    assert not cluster.client.conf.worker_send_task_events
    cluster.worker("a", pool=pool, extra_args=("-E",))
    with receiving(cluster.client) as received:
        result = cluster.send(STEPS, 0.1)
        value = result.get(timeout=30)
        wait_until(
            lambda: received.of("lease-completed", result.id), timeout=30, message="lease-completed"
        )
    (claimed,) = received.of("lease-claimed", result.id)
    (completed,) = received.of("lease-completed", result.id)
    for event in (claimed, completed):
        assert event["hostname"] == value["worker"]
        assert event["generation"] == value["generation"]
        assert event["job_id"] == result.id


def test_a_worker_without_dash_e_sends_no_lease_event(cluster: Cluster) -> None:
    worker = cluster.worker("a")
    with receiving(cluster.client) as received:
        cluster.send(STEPS, 0.1).get(timeout=30)
        # a warm shutdown flushes whatever lease events the pool queued
        worker.warm_shutdown()
        worker.wait_exit(timeout=30)
        received.probe()
    assert received.of("lease-") == []
