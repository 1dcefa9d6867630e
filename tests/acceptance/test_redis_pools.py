"""A threads worker whose tasks hold every connection of the Redis store's pool.

Tasks that talk to the store through a slowed link keep all of the tasks'
connections in use; the heartbeat's renewals go out on a pool of their own,
so a lease renewed meanwhile is not lost.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.acceptance.app import HOG, WATCH
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
