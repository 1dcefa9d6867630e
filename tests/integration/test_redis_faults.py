"""Redis faults between the client and the server, and keys that are not records.

A :class:`tests.proxy.Proxy` sits between the store and the session's
redis-server, so a test can lose a reply after Redis applied the request,
hold replies back, or answer nothing at all.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis

from celery_leases import (
    Acquired,
    AlreadyCompleted,
    Completed,
    LeaseRecordUnreadable,
    LeaseState,
    Refusal,
    RefusalReason,
    Renewed,
    RenewRequest,
    StoreUnavailable,
)
from celery_leases.stores.deadline import bounded
from celery_leases.stores.redis import RedisStore
from tests.acceptance.test_store_faults import COMPLETE_SHA
from tests.proxy import Proxy
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

A = "worker-a"
B = "worker-b"
JOB = "job-1"
#: the client's socket timeout: how long a lost reply keeps it waiting
TIMEOUT = 1.0


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", redis_server.port) as running:
        yield running


@pytest.fixture
def store(proxy: Proxy, unique: str) -> Iterator[RedisStore]:
    url = f"redis://127.0.0.1:{proxy.port}/0"
    with RedisStore.from_url(
        url, prefix=f"f{unique}:", socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT
    ) as opened:
        warm_up(opened)
        yield opened


def warm_up(store: RedisStore) -> None:
    """Load every script, so the request a test loses is the script itself
    (a first EVALSHA answered NOSCRIPT would be lost instead)."""
    held = store.claim("warm-up", A, 30)
    assert isinstance(held, Acquired)
    store.renew("warm-up", A, held.generation, 30)
    store.complete("warm-up", A, held.generation)


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client straight to the server, past the proxy."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


# --- a lost completion reply (protocol rule 6) -----------------------------------


def test_complete_whose_reply_was_lost_is_completed_when_sent_again(
    store: RedisStore, proxy: Proxy, raw: redis.Redis
) -> None:
    held = store.claim(JOB, A, 30)
    assert isinstance(held, Acquired)
    proxy.drop_next_reply()
    with pytest.raises(StoreUnavailable, match="complete of job 'job-1'"):
        store.complete(JOB, A, held.generation, outcome=b"result")
    assert proxy.dropped_replies == 1
    # Redis applied the first completion; only its reply was lost
    assert raw.hget(store.key(JOB), "state") == b"completed"
    assert store.complete(JOB, A, held.generation, outcome=b"result") == Completed(
        JOB, held.generation
    )
    assert store.claim(JOB, B, 30) == AlreadyCompleted(JOB, held.generation, "", b"result")


def test_after_a_lost_completion_another_owner_is_still_refused(
    store: RedisStore, proxy: Proxy
) -> None:
    held = store.claim(JOB, A, 30)
    assert isinstance(held, Acquired)
    proxy.drop_next_reply()
    with pytest.raises(StoreUnavailable):
        store.complete(JOB, A, held.generation)
    refused = store.complete(JOB, B, held.generation)
    assert isinstance(refused, Refusal)
    assert refused.reason is RefusalReason.COMPLETED
    assert refused.current_owner == A


def test_renew_whose_reply_was_lost_leaves_the_lease_renewable(
    store: RedisStore, proxy: Proxy
) -> None:
    held = store.claim(JOB, A, 30)
    assert isinstance(held, Acquired)
    proxy.drop_next_reply()
    with pytest.raises(StoreUnavailable):
        store.renew(JOB, A, held.generation, 30)
    assert isinstance(store.renew(JOB, A, held.generation, 30), Renewed)


def test_a_completion_whose_reply_is_held_gives_up_at_the_callers_deadline(
    proxy: Proxy, unique: str
) -> None:
    """Inside ``bounded()`` (a run completes within its lease's time left),
    the wait for a reply ends at that deadline, not at the socket timeout."""
    left = 0.5
    url = f"redis://127.0.0.1:{proxy.port}/0"
    with RedisStore.from_url(url, prefix=f"b{unique}:") as store:  # a 5 s socket timeout
        warm_up(store)
        held = store.claim(JOB, A, 30)
        assert isinstance(held, Acquired)
        proxy.silence_reply_to(COMPLETE_SHA)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable), bounded(left):
            store.complete(JOB, A, held.generation)
        took = time.monotonic() - started
        assert proxy.dropped_replies == 1
        assert left <= took < left + 2.0
        # Redis applied it: asked again, on a fresh connection, it says so
        assert store.complete(JOB, A, held.generation) == Completed(JOB, held.generation)


# --- the proxy's other faults --------------------------------------------------


def test_blackholed_server_is_unavailable_within_the_timeout_then_recovers(
    store: RedisStore, proxy: Proxy
) -> None:
    held = store.claim(JOB, A, 30)
    assert isinstance(held, Acquired)
    proxy.blackhole()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        store.renew(JOB, A, held.generation, 30)
    # bounded by the socket timeout, with room for a loaded machine
    assert time.monotonic() - started < TIMEOUT + 10
    proxy.heal()
    assert isinstance(store.renew(JOB, A, held.generation, 30), Renewed)


def test_delayed_replies_still_arrive(store: RedisStore, proxy: Proxy) -> None:
    proxy.delay(0.2)
    held = store.claim(JOB, A, 30)
    assert isinstance(held, Acquired)
    assert isinstance(store.renew(JOB, A, held.generation, 30), Renewed)


def test_cut_closes_every_open_connection(proxy: Proxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client:
        client.sendall(b"PING\r\n")
        assert client.recv(64) == b"+PONG\r\n"
        proxy.cut()
        client.settimeout(5)
        assert client.recv(64) == b""  # closed by the proxy
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as again:
        again.sendall(b"PING\r\n")
        assert again.recv(64) == b"+PONG\r\n"


# --- keys under the prefix that are not records ----------------------------------


def test_foreign_keys_under_the_prefix_are_skipped_by_records_and_purge(
    store: RedisStore, raw: redis.Redis
) -> None:
    done = store.claim("done", A, 30)
    assert isinstance(done, Acquired)
    store.complete("done", A, done.generation)
    raw.hset(store.key("done"), "completed_at", str(done.store_now_ms - 120_000))
    raw.set(store.key("a-string"), "not a record")
    raw.rpush(store.key("a-list"), "not", "a", "record")
    deadline = time.monotonic() + 10
    while store.now_ms() <= done.generation and time.monotonic() < deadline:
        time.sleep(0.01)

    assert sorted(r.job_id for r in store.records()) == ["done", "warm-up"]
    assert sorted(r.job_id for r in store.records(state=LeaseState.COMPLETED)) == [
        "done",
        "warm-up",
    ]
    assert store.purge(60) == 1
    assert store.purge(60) == 0
    assert raw.get(store.key("a-string")) == b"not a record"
    assert raw.llen(store.key("a-list")) == 3


def test_the_scripts_take_a_key_of_another_type_as_unreadable_and_leave_it(
    store: RedisStore, raw: redis.Redis
) -> None:
    """The claim reads a record with HGETALL, the fenced scripts with HMGET:
    both answer WRONGTYPE on a string key, which each script reports as a
    record it cannot read, and none changes the key."""
    key = store.key("a-string")
    raw.set(key, "not a record")
    calls = {
        "claim": lambda: store.claim("a-string", A, 30),
        "renew": lambda: store.renew("a-string", A, 1, 30),
        "complete": lambda: store.complete("a-string", A, 1),
        "release": lambda: store.release("a-string", A, 1),
        "force_release": lambda: store.force_release("a-string", by="ops", reason="test"),
    }
    for name, call in calls.items():
        with pytest.raises(LeaseRecordUnreadable, match="a-string"):
            call()
        assert raw.get(key) == b"not a record", name
    [refused] = store.renew_many([RenewRequest("a-string", A, 1, 30)])
    assert isinstance(refused, Refusal)
    assert refused.reason is RefusalReason.UNREADABLE
    assert raw.get(key) == b"not a record"
