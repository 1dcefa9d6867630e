"""lease_queue_unique with a real ``celery worker``: at most one queued job per key.

The client sends through the task's ``delay`` (it imports celery_leases);
the broker is Redis, so the test reads the queue's length from its list.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from celery.signals import after_task_publish

from celery_leases import LeaseSkipped
from tests.acceptance.app import BEAT_QUEUED, QUEUE_UNIQUE
from tests.acceptance.conftest import Cluster

pytestmark = pytest.mark.redis

SENDS = 20
WAIT = 60.0


def queue_length(cluster: Cluster) -> int:
    client = redis.Redis.from_url(cluster.config.broker)
    try:
        return int(client.llen(cluster.config.queue))
    finally:
        client.close()


def send_many(cluster: Cluster, key: str, first_value: int) -> list[Any]:
    """``SENDS`` sends of ``key`` from 4 threads at once; their results in send order."""
    task = cluster.client.tasks[QUEUE_UNIQUE]
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda i: task.delay(key, first_value + i), range(SENDS)))


def one_published(results: list[Any]) -> tuple[Any, int]:
    """The one result whose send published, and its index; every other
    result names the same task."""
    published = [i for i, r in enumerate(results) if not r.lease_coalesced]
    assert len(published) == 1, [(r.id, r.lease_coalesced) for r in results]
    (index,) = published
    assert {r.id for r in results} == {results[index].id}
    return results[index], index


@pytest.mark.parametrize("lease_store_target", ["redis", "postgres"], indirect=True)
def test_sends_while_one_is_queued_become_one_message(cluster: Cluster) -> None:
    key = "k1"
    # no worker yet: the first send is queued, the other 19 get it
    first, first_index = one_published(send_many(cluster, key, 0))
    assert queue_length(cluster) == 1
    mark = cluster.store.queued(f"queued-{key}")
    assert mark is not None
    assert mark.task_id == first.id

    cluster.worker("a")
    cluster.side.wait_event(first.id, "start", timeout=WAIT)
    # its run claimed the lease, so the key has nothing queued: the next
    # send publishes again, and it is the one the 19 after it get
    assert cluster.store.queued(f"queued-{key}") is None
    second, second_index = one_published(send_many(cluster, key, 100))
    assert second.id != first.id
    assert queue_length(cluster) == 1  # the worker is busy with the first

    redis.Redis.from_url(cluster.config.side).set(f"side:gate:{key}", 1)
    # every caller of a send gets the value of the send that published
    assert first.get(timeout=WAIT) == first_index
    assert second.get(timeout=WAIT) == 100 + second_index
    assert cluster.side.done_count(first.id) == 1
    assert cluster.side.done_count(second.id) == 1
    starts = cluster.side.events(kind="start")
    assert sorted(e["job"] for e in starts) == sorted([first.id, second.id])
    assert cluster.store.queued(f"queued-{key}") is None


@pytest.mark.parametrize("lease_store_target", ["redis", "postgres"], indirect=True)
def test_a_run_that_claims_before_its_sender_marks_again_leaves_no_mark(
    cluster: Cluster,
) -> None:
    """The sender marks for a short while, publishes, then marks again for
    the full bound; a worker may claim (and take the mark away) in between.
    The second mark must not place the mark anew: the key would then point
    at a job that has started for the whole bound, and every send in that
    time would get its old result."""
    key = "k2"
    redis.Redis.from_url(cluster.config.side).set(f"side:gate:{key}", 1)
    cluster.worker("a")
    started: list[str] = []

    def wait_for_the_run(headers: dict[str, Any] | None = None, **_: Any) -> None:
        # in the sender, right after its publish: the run claims and takes
        # the mark away before the sender marks again
        task_id = (headers or {}).get("id")
        if task_id:
            cluster.side.wait_event(task_id, "start", timeout=WAIT)
            started.append(task_id)

    after_task_publish.connect(wait_for_the_run, weak=False)
    try:
        first = cluster.client.tasks[QUEUE_UNIQUE].delay(key, 1)
    finally:
        after_task_publish.disconnect(wait_for_the_run)
    assert started == [first.id]
    assert first.lease_coalesced is False
    assert cluster.store.queued(f"queued-{key}") is None
    assert first.get(timeout=WAIT) == 1
    second = cluster.client.tasks[QUEUE_UNIQUE].delay(key, 2)
    assert second.lease_coalesced is False, "the next send got the finished job"
    assert second.get(timeout=WAIT) == 2


def test_a_queued_job_skipped_while_its_key_is_held_takes_its_mark_away(
    cluster: Cluster,
) -> None:
    """Under ``lease_on_busy="skip"`` a queued job can end without claiming:
    its mark must go with it, or every send until the mark's bound (an hour)
    would get the skipped job's ``LeaseSkipped`` and nothing would run."""
    key = "k3"
    task = cluster.client.tasks[BEAT_QUEUED]
    cluster.worker("a")
    cluster.worker("b")
    holder = task.delay(key, "holder")
    cluster.side.wait_event(holder.id, "start", timeout=WAIT)  # claimed, its mark gone
    skipped = task.delay(key, "skipped")
    assert skipped.lease_coalesced is False
    with pytest.raises(LeaseSkipped) as raised:
        skipped.get(timeout=WAIT)
    raised.value.with_traceback(None)  # its frames would keep the result alive
    assert cluster.store.queued(f"beat-queued-{key}") is None

    redis.Redis.from_url(cluster.config.side).set(f"side:gate:{key}", 1)
    assert holder.get(timeout=WAIT) == "holder"
    after = task.delay(key, "after")
    assert after.lease_coalesced is False, "the send got the skipped job"
    assert after.get(timeout=WAIT) == "after"
    assert cluster.side.events(skipped.id, "start") == []


def test_a_worker_killed_before_its_claim_keeps_the_key_on_its_job_until_it_comes_back(
    cluster: Cluster,
) -> None:
    """A worker that received the queued job dies before it claims: the
    mark stays (nothing claimed), so sends keep getting that job, and it is
    not lost: once the broker gives the message back (Redis: its visibility
    timeout, here 4 s), another worker runs it and takes the mark away."""
    cluster.configure(visibility_timeout=4.0)
    key = "k4"
    redis.Redis.from_url(cluster.config.side).set(f"side:gate:{key}", 1)
    task = cluster.client.tasks[QUEUE_UNIQUE]
    worker_a = cluster.worker("a")
    first = task.apply_async((key, 1), countdown=3)
    # A holds the message, unacknowledged, until its countdown ends
    worker_a.wait_for_log(rf"{re.escape(first.id)}\] received", timeout=WAIT)
    worker_a.kill()
    killed = time.monotonic()
    again = task.delay(key, 2)
    assert (again.lease_coalesced, again.id) == (True, first.id)

    cluster.worker("b")
    assert first.get(timeout=WAIT) == 1
    blocked = time.monotonic() - killed
    assert cluster.store.queued(f"queued-{key}") is None
    after = task.delay(key, 3)
    assert after.lease_coalesced is False
    assert after.get(timeout=WAIT) == 3
    assert [e["value"] for e in cluster.side.events(kind="start")] == [1, 3]
    print(f"the key named the dead worker's job for {blocked:.1f} s after the kill")
