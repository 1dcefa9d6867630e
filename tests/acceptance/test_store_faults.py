"""A store connection that hangs or loses replies, and workers killed at the worst moment.

A TCP proxy (:mod:`tests.proxy`) sits between each worker and its lease store,
so a test can black-hole the connection (open, silent), drop the reply to one
request after the server applied it, or refuse connections, while the test
itself still reaches the store directly.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator

import pytest

from celery_leases import Acquired, LeaseState, TakeoverLimitExceeded
from celery_leases.stores.redis._scripts import COMPLETE_SCRIPT
from tests.acceptance.app import ECHO, EFFECTS, STEPS
from tests.acceptance.conftest import Cluster, StoreTarget
from tests.acceptance.harness import wait_until
from tests.proxy import Proxy
from tests.servers import MariadbServer, PostgresServer, RedisServer

TTL = 2.0
#: the bytes that name the completion script in an EVALSHA request
COMPLETE_SHA = hashlib.sha1(COMPLETE_SCRIPT.encode(), usedforsecurity=False).hexdigest().encode()


@pytest.fixture
def store_proxy(redis_server: RedisServer) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        yield proxy


def proxied(cluster: Cluster, proxy: Proxy) -> str:
    """The cluster's Redis store URL, through ``proxy``."""
    return re.sub(r":\d+/", f":{proxy.port}/", cluster.config.store, count=1)


def claim_when_free(cluster: Cluster, job_id: str, *, timeout: float) -> float:
    """Claim ``job_id`` as another worker as soon as the store lets us; the wall time."""

    def probe() -> float | None:
        if isinstance(cluster.store.claim(job_id, "rival:1:abc", 60), Acquired):
            return time.time()
        return None

    return wait_until(probe, timeout=timeout, interval=0.02, message=f"a free lease on {job_id}")


@pytest.mark.parametrize(("pool", "on_lost"), [("prefork", "stop"), ("threads", "raise")])
def test_a_black_holed_store_stops_effects_before_another_worker_can_claim(
    cluster: Cluster, store_proxy: Proxy, pool: str, on_lost: str
) -> None:
    """The renewal hangs (socket open, no reply, a 5 s client timeout): the
    deadline still stops the body, before the store lets anyone else in."""
    cluster.configure(ttl=TTL, on_lost=on_lost, timed_endings=True)
    worker = cluster.worker("a", pool=pool, store=proxied(cluster, store_proxy))
    result = cluster.send(EFFECTS, 30.0)
    cluster.side.wait_event(result.id, "effect", timeout=30, count=5)
    store_proxy.blackhole()
    blackholed = time.time()
    claimed = claim_when_free(cluster, result.id, timeout=TTL + 10)
    # the stale body has ended: no effect can come after this
    if on_lost == "stop":
        worker.wait_for_log(r"signal 9 \(SIGKILL\)", timeout=30)  # its process is gone
    else:
        cluster.side.wait_event(result.id, "fenced-out", timeout=30)  # interrupted
    effects = [event["at"] for event in cluster.side.events(result.id, "effect")]
    assert max(effects) < claimed, "the stale run produced an effect after another claimed"
    assert max(effects) < blackholed + TTL  # by its own local deadline


def test_a_lost_completion_reply_still_answers_the_client(
    cluster: Cluster, store_proxy: Proxy
) -> None:
    """Redis applies the completion and its reply is lost: sent again, it is
    judged by what the store recorded, and the run's result is stored."""
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a", store=proxied(cluster, store_proxy))
    # a first run loads the scripts, so the dropped reply is an applied
    # completion and not a NOSCRIPT answer
    cluster.send(STEPS, 0.05).get(timeout=30)
    store_proxy.drop_reply_to(COMPLETE_SHA)
    result = cluster.send(STEPS, 0.2)
    value = result.get(timeout=30)
    assert store_proxy.dropped_replies == 1
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert "lease fenced-out" not in worker.log()
    assert cluster.side.done_count(result.id) == 1


def test_a_worker_killed_after_its_completion_still_answers_the_client(
    cluster: Cluster,
) -> None:
    """The pool process dies between the accepted completion and the stored
    result: the redelivered copy answers with the outcome kept in the record."""
    cluster.configure(ttl=TTL, kill_after_complete=True)
    cluster.worker("a")
    result = cluster.send(STEPS, 0.2)
    cluster.side.wait_event(result.id, "killed", timeout=30)
    value = result.get(timeout=40)
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert cluster.side.done_count(result.id) == 1  # the body ran once


def test_a_poison_job_whose_completion_is_unknown_is_not_dropped(
    cluster: Cluster, store_proxy: Proxy
) -> None:
    """The takeover limit's completion hangs: the message is published again,
    and the copy reports the poison verdict the store recorded."""
    cluster.configure(ttl=TTL, max_takeovers=0)
    worker = cluster.worker("a", store=proxied(cluster, store_proxy))
    job_id = "poison-" + str(time.monotonic_ns())
    assert isinstance(cluster.store.claim(job_id, "dead:1:abc", 0.3), Acquired)
    time.sleep(0.5)  # that holder died: the next claim is a takeover
    cluster.send(STEPS, 0.05).get(timeout=30)  # loads the scripts (see above)
    store_proxy.blackhole_after(COMPLETE_SHA)
    result = cluster.send(STEPS, 0.1, task_id=job_id)
    worker.wait_for_log(r"the completion is unknown", timeout=30)
    store_proxy.heal()
    with pytest.raises(TakeoverLimitExceeded):
        result.get(timeout=60)
    assert cluster.side.done_count(job_id) == 0  # the body never ran


@pytest.mark.parametrize(
    "lease_store_target",
    ["postgres", pytest.param("mysql", marks=pytest.mark.mysql)],
    indirect=True,
)
def test_a_sql_store_down_when_first_used_defers_the_job(
    cluster: Cluster, lease_store_target: StoreTarget, request: pytest.FixtureRequest
) -> None:
    """A pool process whose first use of the store finds PostgreSQL (or
    MariaDB) down defers the job like any outage, and runs it once the store
    is back."""
    name = "postgres_server" if lease_store_target.kind == "postgres" else "mariadb_server"
    server: PostgresServer | MariadbServer = request.getfixturevalue(name)
    with Proxy("127.0.0.1", server.port) as proxy:
        proxy.refuse()
        url = cluster.config.store.replace(f":{server.port}/", f":{proxy.port}/")
        cluster.configure(ttl=TTL, defer_max=1.0)
        worker = cluster.worker("a", store=url)
        result = cluster.send(STEPS, 0.1)
        worker.wait_for_log(r"lease store unavailable at claim", timeout=30)
        assert result.state in ("PENDING", "STARTED")  # deferred, never FAILURE
        proxy.heal()
        value = result.get(timeout=40)
    assert value["worker"].startswith("a-")
    assert "raised unexpected" not in worker.log()  # never a FAILURE on the way


def test_a_copy_keeps_the_serializer_of_its_message(cluster: Cluster) -> None:
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a", pickle=True)
    job_id = "pickled-" + str(time.monotonic_ns())
    assert isinstance(cluster.store.claim(job_id, "holder:1:abc", 1.0), Acquired)
    # a set does not encode as JSON: the deferred copy must be pickled too
    result = cluster.client.send_task(
        ECHO, args=({3, 1, 2},), queue=cluster.config.queue, task_id=job_id, serializer="pickle"
    )
    value = result.get(timeout=30)
    assert value["value"] == [1, 2, 3]
    assert value["deferrals"] >= 1
    assert "could not publish" not in worker.log()


def test_a_failing_republish_backs_off_instead_of_spinning(
    cluster: Cluster, redis_server: RedisServer
) -> None:
    with Proxy("127.0.0.1", redis_server.port) as broker_writes:
        url = re.sub(r":\d+/", f":{broker_writes.port}/", cluster.config.broker, count=1)
        cluster.configure(ttl=TTL, defer_max=2.0)
        worker = cluster.worker("a", broker_write=url)
        job_id = "held-" + str(time.monotonic_ns())
        assert isinstance(cluster.store.claim(job_id, "holder:1:abc", 60), Acquired)
        broker_writes.refuse()  # the worker can consume, but not publish
        cluster.send(STEPS, 0.1, task_id=job_id)
        worker.wait_for_log(r"could not publish job .* trying again", timeout=30)
        time.sleep(8)
        received = len(re.findall(rf"{job_id}\] received", worker.log()))
        broker_writes.heal()
    # each cycle waits out its backoff before the message goes back to the queue
    assert 1 <= received <= 5
    assert "rejecting the message back to the queue" in worker.log()
