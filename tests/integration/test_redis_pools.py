"""The Redis store's renewals have a pool of their own, and a full pool is not an outage.

Tasks send claims, completions and reads on the store's task client; the
heartbeat sends ``renew_many`` on its renewal client. Here the tasks' pool is
made full in two ways: by many threads whose calls the proxy slows down (as
a busy worker's tasks do), and by taking every connection of the pool (one,
Sentinel and Cluster alike). ``renew_many`` must still go through, and a task
call that finds no free connection says so.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_leases import Acquired, LeaseStore, Renewed, RenewRequest, StoreUnavailable, open_store
from celery_leases.errors import LeaseConfigurationError
from celery_leases.stores.redis import RedisStore
from tests.integration.test_redis_connections import checkout
from tests.proxy import Proxy
from tests.servers import RedisCluster, RedisServer, SentinelGroup

pytestmark = pytest.mark.redis

OWNER = "worker-a"
#: connections of the tasks' pool in these tests (redis-py's default is 100)
TASK_CONNECTIONS = 4
#: each chunk waits this long in the proxy, each way: a task call takes about twice it
DELAY = 0.4
#: generous bound on one renew_many through the slowed proxy (about 2 * DELAY)
PROMPT = 8 * DELAY


def _claim_all(store: LeaseStore, count: int) -> list[RenewRequest]:
    requests = []
    for i in range(count):
        claimed = store.claim(f"job-{i}", OWNER, 60)
        assert isinstance(claimed, Acquired)
        requests.append(RenewRequest(claimed.job_id, OWNER, claimed.generation, 60))
    return requests


def _is_exhaustion(error: StoreUnavailable) -> bool:
    return "was in use" in str(error)


def test_renew_many_goes_through_while_slow_task_calls_hold_every_connection(
    redis_server: RedisServer, unique: str
) -> None:
    with Proxy("127.0.0.1", redis_server.port) as proxy:
        store = RedisStore.from_url(
            f"redis://127.0.0.1:{proxy.port}/0",
            prefix=f"p{unique}:",
            max_connections=TASK_CONNECTIONS,
            socket_timeout=30,
            socket_connect_timeout=30,
        )
        try:
            requests = _claim_all(store, 10)
            store.renew_many(requests)  # the renewal connection is open, the script loaded
            proxy.delay(DELAY)
            stop = threading.Event()
            full = threading.Event()
            task_errors: list[StoreUnavailable] = []

            def task() -> None:
                while not stop.is_set():
                    try:
                        store.get("job-0")
                    except StoreUnavailable as exc:
                        task_errors.append(exc)
                        full.set()
                        time.sleep(0.01)

            tasks = [threading.Thread(target=task) for _ in range(3 * TASK_CONNECTIONS)]
            for thread in tasks:
                thread.start()
            try:
                assert full.wait(30), "the tasks never filled their pool"
                started = time.monotonic()
                results = store.renew_many(requests)
                took = time.monotonic() - started
                full.clear()
                assert full.wait(30), "the pool did not stay full"
            finally:
                stop.set()
                for thread in tasks:
                    thread.join(60)
        finally:
            proxy.heal()
            store.close()
    assert all(isinstance(r, Renewed) for r in results), results
    assert took < PROMPT, f"renew_many took {took:.2f} s behind the tasks"
    assert task_errors
    assert all(_is_exhaustion(e) for e in task_errors)


def test_a_task_call_on_a_full_pool_says_so_and_is_not_an_outage(
    redis_server: RedisServer, unique: str
) -> None:
    store = RedisStore.from_url(redis_server.url, prefix=f"p{unique}:", max_connections=2)
    try:
        with _holding_every_task_connection(store), pytest.raises(StoreUnavailable) as caught:
            store.claim("job-1", OWNER, 30)
        message = str(caught.value)
        assert "every connection of this process's pool" in message
        assert "was not sent" in message
        assert "not an outage" in message
        assert "max_connections" in message
        assert "Check that the server is up" not in message
        assert caught.value.job_id == "job-1"
        assert store.get("job-1") is None  # nothing was sent
    finally:
        store.close()


def test_a_full_renewal_pool_names_its_own_option(redis_server: RedisServer, unique: str) -> None:
    store = RedisStore.from_url(redis_server.url, prefix=f"p{unique}:", renew_connections=1)
    try:
        requests = _claim_all(store, 2)
        held = checkout(store._renew_client.connection_pool)
        try:
            with pytest.raises(StoreUnavailable) as caught:
                store.renew_many(requests)
        finally:
            store._renew_client.connection_pool.release(held)
        assert "renew_connections" in str(caught.value)
        assert "not an outage" in str(caught.value)
        assert all(isinstance(r, Renewed) for r in store.renew_many(requests))
    finally:
        store.close()


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "4"])
def test_the_renewal_pool_size_is_checked(redis_server: RedisServer, size: object) -> None:
    with pytest.raises(LeaseConfigurationError, match="renew_connections"):
        open_store(redis_server.url, renew_connections=size)


def test_a_store_over_a_client_renews_on_a_pool_of_its_own(
    redis_server: RedisServer, unique: str
) -> None:
    client = redis.Redis.from_url(redis_server.url, max_connections=1, decode_responses=True)
    with RedisStore(client, prefix=f"p{unique}:") as store:
        requests = _claim_all(store, 3)
        with _holding_every_task_connection(store):
            assert all(isinstance(r, Renewed) for r in store.renew_many(requests))
        renewal_pool = store._renew_client.connection_pool
        assert renewal_pool is not client.connection_pool
        assert renewal_pool.connection_kwargs["decode_responses"] is True


# --- one node, Sentinel and Cluster -------------------------------------------------


def _open(kind: str, request: pytest.FixtureRequest, unique: str) -> LeaseStore:
    options: dict[str, Any] = {"prefix": f"p{unique}:", "max_connections": TASK_CONNECTIONS}
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return open_store(server.url, **options)
    if kind == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return open_store(cluster.url, **options)
    group: SentinelGroup = request.getfixturevalue("sentinel_group")
    return open_store(group.url, master_name=SentinelGroup.MASTER_NAME, **options)


@pytest.mark.parametrize("kind", ["redis", "redis-cluster", "sentinel"])
def test_renew_many_needs_no_connection_of_the_tasks_pool(
    kind: str, request: pytest.FixtureRequest, unique: str
) -> None:
    store = _open(kind, request, unique)
    try:
        assert isinstance(store, RedisStore)
        requests = _claim_all(store, 12)  # on a cluster: leases on every master
        with _holding_every_task_connection(store):
            results = store.renew_many(requests)
            with pytest.raises(StoreUnavailable) as caught:
                store.claim("job-other", OWNER, 30)
        assert all(isinstance(r, Renewed) for r in results), results
        assert _is_exhaustion(caught.value)
    finally:
        store.close()


@contextlib.contextmanager
def _holding_every_task_connection(store: RedisStore) -> Iterator[None]:
    """Take every connection of the store's task pools (each node's on a
    cluster), as that many tasks in the middle of a call would hold them."""
    client: Any = store._client
    if hasattr(client, "get_nodes"):
        pools = [node.redis_connection.connection_pool for node in client.get_nodes()]
    else:
        pools = [client.connection_pool]
    held = [(pool, checkout(pool)) for pool in pools for _ in range(pool.max_connections)]
    try:
        yield
    finally:
        for pool, connection in held:
            pool.release(connection)
