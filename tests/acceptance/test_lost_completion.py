"""A completion the store applied, whose reply never came back before the deadline.

Timeline (TTL 3 s, the store client's socket timeout 5 s)::

    worker                      proxy                   store
    complete(g) ------------->  forwarded ------------> completed by (owner, g)
    ... waits 5 s               the reply is swallowed,
                                the connection stays open
    deadline passes: lost
    socket timeout: outcome unknown
    release(g) -------------->  (a new connection) ---> refused: completed by (owner, g)
    -> this run completed: its result is stored, the client gets it

The record names this very run as the completer, so the run completed
(protocol duty 6); no other delivery will answer the client.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_leases import Acquired, LeaseState, TakeoverLimitExceeded
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.test_store_faults import COMPLETE_SHA, proxied
from tests.proxy import Proxy
from tests.servers import RedisServer

#: shorter than the Redis store's 5 s socket timeout
TTL = 3.0


@pytest.fixture
def store_proxy(redis_server: RedisServer) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        yield proxy


def test_a_completion_reply_lost_past_the_deadline_still_answers_the_client(
    cluster: Cluster, store_proxy: Proxy
) -> None:
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a", store=proxied(cluster, store_proxy))
    # a first run loads the scripts, so the lost reply is an applied completion
    cluster.send(STEPS, 0.05).get(timeout=30)
    store_proxy.silence_reply_to(COMPLETE_SHA)
    result = cluster.send(STEPS, 0.2)
    value = result.get(timeout=40)
    assert store_proxy.dropped_replies == 1
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert cluster.side.done_count(result.id) == 1  # answered by this run, not run again
    assert "records this run's completion" in worker.log()


def test_a_poison_verdict_whose_reply_was_lost_past_the_deadline_fails_the_job(
    cluster: Cluster, store_proxy: Proxy
) -> None:
    cluster.configure(ttl=TTL, max_takeovers=0)
    cluster.worker("a", store=proxied(cluster, store_proxy))
    job_id = "poison-" + str(time.monotonic_ns())
    assert isinstance(cluster.store.claim(job_id, "dead:1:abc", 0.3), Acquired)
    time.sleep(0.5)  # that holder died: the next claim is a takeover
    cluster.send(STEPS, 0.05).get(timeout=30)  # loads the scripts (see above)
    store_proxy.silence_reply_to(COMPLETE_SHA)
    result = cluster.send(STEPS, 0.1, task_id=job_id)
    with pytest.raises(TakeoverLimitExceeded):
        result.get(timeout=40)
    assert store_proxy.dropped_replies == 1
    assert cluster.side.done_count(job_id) == 0  # the body never ran
