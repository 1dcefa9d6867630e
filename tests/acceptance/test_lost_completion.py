"""A completion the store applied, whose reply never came back before the deadline.

Timeline (TTL 2 s, so the local deadline is 1.5 s after the claim was sent;
the store client waits 5 s for a reply, more than the lease has left)::

    worker                      proxy                   store
    complete(g) ------------->  forwarded ------------> completed by (owner, g)
    ... waits                   the reply is swallowed,
                                the connection stays open
    deadline: no reply yet, no more waiting (nor a second try)
    release(g) -------------->  (a new connection) ---> refused: completed by (owner, g)
    -> this run completed: its result is stored, the client gets it

The record names this very run as the completer, so the run completed
(protocol duty 6); no other delivery will answer the client. The run
waits for the store no longer than its lease lasts, plus the drift margin
for the one question it asks after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_leases import Acquired, LeaseState, TakeoverLimitExceeded
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster, StoreTarget
from tests.acceptance.test_store_faults import COMPLETE_SHA, proxied
from tests.proxy import Proxy
from tests.servers import PostgresServer, RedisServer

#: shorter than the store clients' 5 s wait for a reply
TTL = 2.0
#: the default drift margin at that TTL
DRIFT_MARGIN = 0.5
#: bytes only a completion's request holds, per store
COMPLETION_MARKERS = {"redis": COMPLETE_SHA, "postgres": b"SET state='completed'"}


@pytest.fixture
def store_proxy(lease_store_target: StoreTarget, request: pytest.FixtureRequest) -> Iterator[Proxy]:
    name = "postgres_server" if lease_store_target.kind == "postgres" else "redis_server"
    server: RedisServer | PostgresServer = request.getfixturevalue(name)
    with Proxy("127.0.0.1", server.port) as proxy:
        yield proxy


@pytest.mark.parametrize("lease_store_target", ["redis", "postgres"], indirect=True)
def test_a_completion_reply_lost_past_the_deadline_still_answers_the_client(
    cluster: Cluster, store_proxy: Proxy, lease_store_target: StoreTarget
) -> None:
    cluster.configure(ttl=TTL, timed_endings=True)
    worker = cluster.worker("a", store=proxied(cluster, store_proxy))
    # a first run loads the scripts, so the lost reply is an applied completion
    cluster.send(STEPS, 0.05).get(timeout=30)
    store_proxy.silence_reply_to(COMPLETION_MARKERS[lease_store_target.kind])
    result = cluster.send(STEPS, 0.2)
    value = result.get(timeout=40)
    assert store_proxy.dropped_replies == 1
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert cluster.side.done_count(result.id) == 1  # answered by this run, not run again
    assert "records this run's completion" in worker.log()
    # judged at the deadline, with one bounded question after it: not after
    # the store client's whole wait for a reply (5 s, and twice on SQL)
    (completed,) = cluster.side.events(result.id, "completed")
    assert completed["past_deadline"] < DRIFT_MARGIN + 1.5, completed


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
