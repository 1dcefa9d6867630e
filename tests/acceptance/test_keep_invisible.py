"""``leases_broker_keep_invisible``: renewals keep a running message invisible.

Two real prefork workers on one queue, visibility timeout 2 s, lease TTL
1.5 s (a renewal every 0.5 s), on kombu's Redis transport and on SQS (a
local server)::

    A receives the job and runs a body of 6 s (3 x the visibility timeout)
    without the setting: t~2 s the broker hands the message to B, which
        finds the lease held and defers a copy; again at t~4 s ...
    with it: every renewal pushes the message's visibility forward; B never
        sees it, and A's run is its only delivery

A killed worker: A is SIGKILLed mid-run (with its pool child), past one
visibility timeout in which nobody else saw the message. Its lease is
renewed no more, so its message is extended no more: the broker hands it to
B one visibility timeout after the last extension, and B's claim succeeds
once the lease ran out, one TTL after the last renewal (the body sleeps
on its first run only, so B's run ends at once). ``pytest -s``
prints the figures (docs/performance.md).

A store outage: the store is down while a job waits (until it was deferred
``OUTAGE_DEFERRALS`` times, about 20 s). Each
delivery finds the store down and defers a copy with a growing countdown,
and the worker holds that copy unacknowledged until its countdown ends; a
countdown longer than the visibility timeout would let the broker hand the
copy out again, and each of those deliveries would defer a copy of its own.
Countdowns are capped at half the visibility timeout, so every delivery is
the job's first or the one copy a deferral published.

Deliveries are counted from the workers' logs: every delivery logs
``Task <name>[<id>] received``, and every deferral publishes one new copy;
a delivery beyond the first of each message is the broker's redelivery.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from celery_leases import LeaseState
from tests.acceptance.app import SLOW_ONCE, STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import Worker, wait_until
from tests.servers import RedisServer

VISIBILITY = 2.0
TTL = 1.5
BODY = 3 * VISIBILITY
#: kombu's Redis transport looks for visible messages once a second here
#: (``unacked_restore_interval``, tests/acceptance/app.py); SQS needs no sweep
SWEEP = {"redis": 1.0, "sqs": 0.0}
#: the broker's delivery and the worker's poll (SQS long-polls 1 s)
DELIVERY_SLACK = 2.0


def count_deliveries(cluster: Cluster, job_id: str, task: str = STEPS) -> tuple[int, int]:
    """(messages received, deferrals) for ``job_id`` over every worker's log."""
    received = deferred = 0
    job = re.escape(job_id)
    for worker in cluster.workers:
        log = worker.log()
        received += len(re.findall(rf"Task {re.escape(task)}\[{job}\] received", log))
        deferred += len(re.findall(rf"lease deferred: job={job} ", log))
    return received, deferred


def outage_deferrals(cluster: Cluster, job_id: str) -> list[int]:
    """The deferral number each delivery of ``job_id`` logged on finding the store down.

    A copy handed out twice is deferred twice with the same number.
    """
    pattern = rf"\[{re.escape(job_id)}\]: lease store unavailable at claim .*\(deferral (\d+)\)"
    return [int(n) for w in cluster.workers for n in re.findall(pattern, w.log())]


def start_two_workers(cluster: Cluster) -> list[Worker]:
    """Workers A and B, started side by side (each start takes seconds)."""
    workers = [cluster.worker(name, start=False) for name in ("a", "b")]
    starts = [threading.Thread(target=worker.start) for worker in workers]
    for start in starts:
        start.start()
    for start in starts:
        start.join()
    for worker in workers:
        worker.wait_for_log(r"\bready\.", timeout=60)
    return workers


def _run_one_long_job(cluster: Cluster, *, keep_invisible: bool) -> tuple[int, int]:
    cluster.configure(ttl=TTL, visibility_timeout=VISIBILITY, keep_invisible=keep_invisible)
    start_two_workers(cluster)
    result = cluster.send(STEPS, BODY)
    cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=BODY + 30, message="the job to complete"
    )
    # a copy deferred last comes back within its countdown: let it be seen
    # (with the setting no copy exists; a redelivery would have been logged)
    time.sleep(0.5 if keep_invisible else VISIBILITY + SWEEP["redis"])
    assert cluster.side.done_count(result.id) == 1
    received, deferred = count_deliveries(cluster, result.id)
    redeliveries = received - 1 - deferred
    print(
        f"\nkeep_invisible={keep_invisible}: body {BODY:g} s, visibility {VISIBILITY:g} s: "
        f"{received} deliveries, {deferred} deferrals, {redeliveries} redeliveries"
    )
    return redeliveries, deferred


@pytest.mark.parametrize("broker_kind", ["redis", "sqs"], indirect=True)
def test_a_run_three_visibility_timeouts_long_is_not_delivered_again(
    cluster: Cluster, broker_kind: str
) -> None:
    redeliveries, deferred = _run_one_long_job(cluster, keep_invisible=True)
    assert (redeliveries, deferred) == (0, 0)


@pytest.mark.parametrize("broker_kind", ["redis", "sqs"], indirect=True)
def test_without_the_setting_the_same_run_is_delivered_again(
    cluster: Cluster, broker_kind: str
) -> None:
    redeliveries, deferred = _run_one_long_job(cluster, keep_invisible=False)
    assert redeliveries >= 1
    assert deferred >= 1


@pytest.mark.parametrize("broker_kind", ["redis", "sqs"], indirect=True)
def test_a_killed_workers_job_runs_again_within_a_visibility_timeout_and_a_ttl(
    cluster: Cluster, broker_kind: str
) -> None:
    cluster.configure(ttl=TTL, visibility_timeout=VISIBILITY, keep_invisible=True)
    workers = start_two_workers(cluster)
    # the body sleeps on its first run only: B's takeover ends at once
    result = cluster.send(SLOW_ONCE, BODY)
    (started_a,) = cluster.side.wait_event(result.id, "start", timeout=30)
    worker_a, worker_b = sorted(
        workers, key=lambda w: not started_a["worker"].startswith(f"{w.name}@")
    )
    # past one visibility timeout, and still only A's: the renewals extended it
    time.sleep(VISIBILITY + SWEEP[broker_kind] + 0.5)
    assert count_deliveries(cluster, result.id, SLOW_ONCE) == (1, 0)
    worker_a.kill()
    killed_at = time.time()
    started_b = cluster.side.wait_event(result.id, "start", timeout=30, count=2)[1]
    waited = started_b["at"] - killed_at
    print(f"\n{broker_kind}: the killed worker's job started again after {waited:.2f} s")
    assert started_b["worker"].startswith(f"{worker_b.name}@")
    assert started_b["generation"] > started_a["generation"]
    assert waited <= VISIBILITY + TTL + SWEEP[broker_kind] + DELIVERY_SLACK
    record = cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=30, message="the job to complete"
    )
    assert record.takeovers == 1
    assert started_b["run"] == 2


#: the visibility timeout during the store outage, and the deferrals it lasts
OUTAGE_VISIBILITY = 6.0
OUTAGE_DEFERRALS = 8


def test_a_store_outage_gives_one_delivery_per_deferral(
    store_server: RedisServer, cluster: Cluster, unique: str
) -> None:
    cluster.configure(
        ttl=1.2,
        visibility_timeout=OUTAGE_VISIBILITY,
        keep_invisible=True,
        store=store_server.url,
        store_options={"prefix": f"acc{unique}:"},
    )
    cluster.worker("a")
    store_server.stop()
    down_at = time.monotonic()
    result = cluster.send(STEPS, 0.1)
    wait_until(
        lambda: len(outage_deferrals(cluster, result.id)) >= OUTAGE_DEFERRALS,
        timeout=120,
        message=f"{OUTAGE_DEFERRALS} deferrals while the store is down",
    )
    received, deferred = count_deliveries(cluster, result.id)
    numbers = outage_deferrals(cluster, result.id)
    outage = time.monotonic() - down_at
    store_server.start()
    print(
        f"\nstore down {outage:.1f} s, visibility {OUTAGE_VISIBILITY:g} s: {received} "
        f"deliveries, {deferred} deferrals, deferral numbers {numbers}"
    )
    # every copy was delivered once: each deferral number comes once
    assert sorted(numbers) == list(range(1, len(numbers) + 1))
    # and each waited at least leases_defer_backoff (1 s)
    assert received <= outage / 1.0 + 2
    value = result.get(timeout=60)
    assert cluster.side.done_count(result.id) == 1
    record = cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=10, message="the job to complete"
    )
    assert value["generation"] == record.generation
