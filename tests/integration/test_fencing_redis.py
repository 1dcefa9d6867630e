"""Fenced Redis writes on a real redis-server: SET, HSET, XADD and bare fences."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from celery_leases.errors import LeaseConfigurationError, StaleFencingToken
from celery_leases.fencing import Token
from celery_leases.fencing.http import FenceChecker, fencing_headers
from celery_leases.fencing.redis import RedisFence, fence_key
from tests.servers import RedisServer

A = Token("job-1", 7, owner="worker-a")
B = Token("job-1", 8, owner="worker-b")


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def fence(client: redis.Redis, unique: str) -> RedisFence:
    return RedisFence(client, prefix=f"t{unique}:")


@pytest.fixture
def key(unique: str) -> str:
    return f"k{unique}:report"


def test_worked_example_stale_set_is_refused(
    fence: RedisFence, client: redis.Redis, key: str
) -> None:
    fence.set(key, "from 8", B)
    with pytest.raises(StaleFencingToken) as refused:
        fence.set(key, "from 7", A)
    assert refused.value.accepted == 8
    assert refused.value.generation == 7
    assert refused.value.resource == key
    assert client.get(key) == "from 8"


def test_newer_set_applies_and_reports_the_previous_generation(
    fence: RedisFence, client: redis.Redis, key: str
) -> None:
    first = fence.set(key, "from 7", A)
    second = fence.set(key, "from 8", B)
    assert (first.applied, first.previous) == (True, None)
    assert (second.applied, second.previous) == (True, 7)
    assert client.get(key) == "from 8"
    assert fence.accepted(key) == Token("job-1", 8)


def test_unfenced_set_lets_the_stale_write_land(client: redis.Redis, key: str) -> None:
    """The same schedule with plain SET: A's late write overwrites B's."""
    client.set(key, "from 8")
    client.set(key, "from 7")
    assert client.get(key) == "from 7"


def test_set_expiry_applies_to_the_value_never_to_the_fence(
    fence: RedisFence, client: redis.Redis, key: str
) -> None:
    fence.set(key, "short-lived", A, ex=0.2)
    assert 0 < client.pttl(key) <= 200
    assert client.ttl(fence.fence_key(key)) == -1
    deadline = time.monotonic() + 10
    while client.exists(key):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(StaleFencingToken):
        fence.set(key, "stale after expiry", Token("job-1", 6))
    assert client.get(key) is None


def test_repeat_modes(fence: RedisFence, client: redis.Redis, key: str) -> None:
    fence.set(key, "first", A)
    assert fence.set(key, "second", A).applied
    skipped = fence.set(key, "third", A, on_repeat="accept")
    assert (skipped.applied, skipped.previous) == (False, 7)
    with pytest.raises(StaleFencingToken, match="repeats are refused"):
        fence.set(key, "fourth", A, on_repeat="refuse")
    assert client.get(key) == "second"


def test_default_on_repeat_is_set_per_fence(client: redis.Redis, unique: str, key: str) -> None:
    idempotent = RedisFence(client, prefix=f"t{unique}:", on_repeat="accept")
    idempotent.set(key, "first", A)
    assert idempotent.set(key, "second", A).applied is False
    assert client.get(key) == "first"


def test_same_generation_of_another_job_is_refused(
    fence: RedisFence, client: redis.Redis, key: str
) -> None:
    fence.set(key, "job 1", Token("job-1", 7))
    with pytest.raises(StaleFencingToken):
        fence.set(key, "job 2", Token("job-2", 7))
    assert client.get(key) == "job 1"


def test_hset_is_fenced(fence: RedisFence, client: redis.Redis, key: str) -> None:
    fence.hset(key, {"status": "done", "by": "8"}, B)
    with pytest.raises(StaleFencingToken) as refused:
        fence.hset(key, {"status": "stale", "by": "7"}, A)
    assert refused.value.accepted == 8
    assert client.hgetall(key) == {"status": "done", "by": "8"}


def test_xadd_appends_only_non_stale_entries(
    fence: RedisFence, client: redis.Redis, key: str
) -> None:
    written = fence.xadd(key, {"event": "from 8"}, B, maxlen=100)
    with pytest.raises(StaleFencingToken):
        fence.xadd(key, {"event": "from 7"}, A)
    entries = client.xrange(key)
    assert [fields for _, fields in entries] == [{"event": "from 8"}]
    assert entries[0][0] == written.entry_id


def test_fence_hash_shares_the_slot_of_its_key() -> None:
    assert fence_key("report") == "celery_leases:fence:{report}"
    assert fence_key("user:{42}:name") == "celery_leases:fence:{42}:user:{42}:name"
    with pytest.raises(LeaseConfigurationError, match="hash tag"):
        fence_key("odd}key")
    with pytest.raises(LeaseConfigurationError, match="hash tag"):
        fence_key("{}empty-tag")


@pytest.mark.parametrize("key", ["report", "user:{42}:name", "a{b}c{d}", "x{y"])
def test_fence_and_key_hash_to_one_cluster_slot(key: str) -> None:
    assert key_slot(key.encode()) == key_slot(fence_key(key).encode())


def test_scripts_are_loaded_again_after_a_script_flush(
    fence: RedisFence, client: redis.Redis, key: str
) -> None:
    fence.set(key, "from 7", A)
    client.script_flush()
    fence.set(key, "from 8", B)
    assert client.get(key) == "from 8"


def test_works_with_a_bytes_client(redis_server: RedisServer, unique: str, key: str) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    try:
        fence = RedisFence(raw, prefix=f"t{unique}:")
        fence.set(key, b"\x00\xff", B)
        with pytest.raises(StaleFencingToken) as refused:
            fence.set(key, b"old", A)
        assert refused.value.accepted == 8
        assert raw.get(key) == b"\x00\xff"
        assert fence.accepted(key) == Token("job-1", 8)
    finally:
        raw.close()


def test_redis_fence_backs_a_fence_checker(fence: RedisFence) -> None:
    checker = FenceChecker(fence)
    checker.check(fencing_headers(B), resource="service:report")
    with pytest.raises(StaleFencingToken) as refused:
        checker.check(fencing_headers(A), resource="service:report")
    assert refused.value.accepted == 8


@pytest.mark.parametrize(
    ("token", "message"),
    [(Token("", 1), "job_id"), (Token("j", 0), "generation"), (Token("j", 2**53), "2\\*\\*53")],
)
def test_invalid_tokens_are_configuration_errors(
    fence: RedisFence, key: str, token: Token, message: str
) -> None:
    with pytest.raises(LeaseConfigurationError, match=message):
        fence.set(key, "x", token)


def test_bad_expiry_is_a_configuration_error(fence: RedisFence, key: str) -> None:
    with pytest.raises(LeaseConfigurationError, match="ex must be"):
        fence.set(key, "x", A, ex=0)
