"""A threads worker whose tasks hold every connection of the Redis store's pool.

Tasks that talk to the store through a slowed link keep all of the tasks'
connections in use; the heartbeat's renewals go out on a pool of their own,
so a lease renewed meanwhile is not lost.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.acceptance.app import ECHO, HOG, WATCH
from tests.acceptance.conftest import Cluster
from tests.proxy import Proxy
from tests.servers import RedisServer

TTL = 2.0
#: the tasks' pool (redis-py's default is 100)
TASK_CONNECTIONS = 4
#: threads of the hog task reading through the tasks' pool at once
READERS = 2 * TASK_CONNECTIONS
#: how long the hog keeps the pool full: several lease times
HOG_SECONDS = 3 * TTL


@pytest.fixture
def store_proxy(redis_server: RedisServer) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        yield proxy


def test_a_lease_outlives_tasks_that_hold_every_store_connection(
    cluster: Cluster, store_proxy: Proxy
) -> None:
    store = re.sub(r":\d+/", f":{store_proxy.port}/", cluster.config.store, count=1)
    options = {**cluster.config.store_options, "max_connections": TASK_CONNECTIONS}
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a", pool="threads", concurrency=4, store=store, store_options=options)
    watched = cluster.send(WATCH, HOG_SECONDS + 2 * TTL)
    cluster.side.wait_event(watched.id, "start", timeout=30)
    store_proxy.delay(0.05)  # a store call takes a tenth of a second now
    hog = cluster.send(HOG, HOG_SECONDS, READERS)
    full = hog.get(timeout=HOG_SECONDS + 30)
    assert full > 0, "the hog never filled the tasks' pool"
    watched.get(timeout=4 * TTL + 30)  # raises LeaseLost if the lease was lost
    store_proxy.heal()
    assert cluster.side.events(watched.id, "lost") == []
    assert "could not renew" not in worker.log()


#: a threads worker with more threads than redis-py's default pool (100)
WIDE = 110


def test_a_threads_worker_wider_than_the_default_pool_claims_every_task_at_once(
    cluster: Cluster, store_proxy: Proxy
) -> None:
    # every thread claims at once through a slowed link, so every claim holds
    # a connection at the same time: the store's pool must have one per
    # thread, or the claims beyond it are deferred as if the store were down
    store = re.sub(r":\d+/", f":{store_proxy.port}/", cluster.config.store, count=1)
    assert "max_connections" not in cluster.config.store_options
    cluster.configure(ttl=60)  # a claim slowed this much is far from its deadline
    worker = cluster.worker("a", pool="threads", concurrency=WIDE, store=store)
    store_proxy.delay(0.2)
    results = [cluster.send(ECHO, n) for n in range(WIDE)]
    answers = [result.get(timeout=120) for result in results]
    store_proxy.heal()
    assert sorted(answer["value"] for answer in answers) == list(range(WIDE))
    assert [a for a in answers if a["deferrals"]] == []
    assert "lease store unavailable at claim" not in worker.log()
    assert f"max_connections={WIDE + 8}" in worker.log()
