"""What only the Redis store does: its keys, scripts, configuration and faults.

The behaviour every store shares is in ``test_conformance.py``. These tests
run against real redis-server processes: the session's, or their own when
they restart, stop or misconfigure it.
"""

from __future__ import annotations

import signal
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import RedisClusterException

from celery_leases import (
    Acquired,
    AlreadyCompleted,
    Completed,
    HeldElsewhere,
    LeaseConfigurationError,
    LeaseError,
    LeaseRecordUnreadable,
    LeaseState,
    RefusalReason,
    Released,
    Renewed,
    RenewRequest,
    StoreUnavailable,
    open_store,
)
from celery_leases.stores.base import Refusal
from celery_leases.stores.redis import RedisConfigWarning, RedisStore
from celery_leases.stores.redis import _batches as redis_batches
from celery_leases.stores.redis._scripts import RENEW_MANY_SCRIPT
from tests.conftest import serve
from tests.operations import every_operation
from tests.servers import RedisServer, free_port

pytestmark = pytest.mark.redis

RECORD_FIELDS = {
    "owner",
    "generation",
    "lease_until",
    "state",
    "task_name",
    "claimed_at",
    "renewed_at",
    "completed_at",
    "renew_count",
    "takeovers",
    "send_id",
    "task_id",
}


class CountingConnection(redis.Connection):
    """A real connection that counts the requests it writes to the socket."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends += 1
        super().send_packed_command(command, check_health)


ServerFactory = Callable[..., RedisServer]


@pytest.fixture
def own_redis() -> Iterator[ServerFactory]:
    """Starts redis-servers of this test alone (to restart, stop or misconfigure)."""
    running: list[Generator[RedisServer, None, None]] = []

    def start(*extra_args: str) -> RedisServer:
        server = serve(lambda: RedisServer(*extra_args))
        running.append(server)  # keeps it alive; closing it stops the server
        return next(server)

    yield start
    for server in running:
        server.close()


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client on the session server, to look at what the store wrote."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def redis_store(redis_server: RedisServer, unique: str) -> Iterator[RedisStore]:
    store = RedisStore.from_url(redis_server.url, prefix=f"t{unique}:")
    yield store
    store.close()


def age_completion(raw: redis.Redis, key: str, seconds: float) -> None:
    """Move a record's completion time back, as if ``seconds`` had passed."""
    completed_at = int(raw.hget(key, "completed_at") or 0)
    raw.hset(key, "completed_at", str(completed_at - round(seconds * 1000)))


def commandstats(client: redis.Redis) -> dict[str, int]:
    """Calls per command on the server so far."""
    info = client.info("commandstats")
    return {name: int(stats["calls"]) for name, stats in info.items()}


# --- key layout ---------------------------------------------------------------


def test_record_is_one_hash_with_hash_tag_and_no_ttl(
    redis_store: RedisStore, raw: redis.Redis, unique: str
) -> None:
    acquired = redis_store.claim("job-123", "worker-a", 30, task_name="app.tasks.report")
    assert isinstance(acquired, Acquired)
    assert isinstance(redis_store.renew("job-123", "worker-a", acquired.generation, 30), Renewed)
    assert redis_store.complete("job-123", "worker-a", acquired.generation) == Completed(
        "job-123", acquired.generation
    )

    key = f"t{unique}:{{job-123}}"
    assert redis_store.key("job-123") == key
    assert raw.keys(f"t{unique}:*") == [key]
    assert raw.type(key) == "hash"
    assert raw.ttl(key) == -1
    fields = raw.hgetall(key)
    assert set(fields) == RECORD_FIELDS
    assert fields["owner"] == "worker-a"
    assert fields["generation"] == str(acquired.generation)
    assert fields["state"] == "completed"
    assert fields["task_name"] == "app.tasks.report"
    assert fields["renew_count"] == "1"
    assert fields["takeovers"] == "0"
    assert int(fields["claimed_at"]) == acquired.store_now_ms
    assert int(fields["claimed_at"]) <= int(fields["renewed_at"]) <= int(fields["completed_at"])


def test_claim_never_sets_a_ttl_on_a_held_record(redis_store: RedisStore, raw: redis.Redis) -> None:
    redis_store.claim("job-held", "worker-a", 0.5)
    assert raw.ttl(redis_store.key("job-held")) == -1


def test_default_prefix_is_leases(redis_server: RedisServer) -> None:
    with RedisStore.from_url(redis_server.url) as store:
        assert isinstance(store, RedisStore)
        assert store.key("job-1") == "leases:{job-1}"


def test_open_store_gives_a_redis_store_with_masked_url(redis_server: RedisServer) -> None:
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    store = open_store(url, prefix="x:", check_config=False)
    try:
        assert isinstance(store, RedisStore)
        assert store.url == f"redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]}"
        with pytest.raises(StoreUnavailable) as caught:
            store.claim("job-1", "worker-a", 10)
        assert "secret" not in str(caught.value)
        assert "127.0.0.1" in str(caught.value)
    finally:
        store.close()


def test_store_over_a_client_that_decodes_responses(redis_server: RedisServer, unique: str) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    with RedisStore(client, prefix=f"t{unique}:") as store:
        assert store.url == redis_server.url
        acquired = store.claim("job-a", "worker-a", 30)
        assert isinstance(acquired, Acquired)
        refused = store.renew("job-a", "worker-b", acquired.generation, 30)
        assert isinstance(refused, Refusal)
        assert refused.current_owner == "worker-a"
        [result] = store.renew_many([RenewRequest("job-a", "worker-a", acquired.generation, 30)])
        assert isinstance(result, Renewed)
        record = store.get("job-a")
        assert record is not None
        assert (record.owner, record.renew_count) == ("worker-a", 1)
        assert [r.job_id for r in store.records()] == ["job-a"]


# --- scripts --------------------------------------------------------------------


def test_every_operation_recovers_from_a_flushed_script_cache(
    redis_store: RedisStore, raw: redis.Redis
) -> None:
    raw.script_flush()
    first = redis_store.claim("job-a", "worker-a", 30)
    assert isinstance(first, Acquired)
    raw.script_flush()
    assert isinstance(redis_store.renew("job-a", "worker-a", first.generation, 30), Renewed)
    raw.script_flush()
    assert redis_store.release("job-a", "worker-a", first.generation) == Released(
        "job-a", first.generation
    )
    second = redis_store.claim("job-a", "worker-b", 30)
    assert isinstance(second, Acquired)
    assert second.generation == max(first.generation + 1, second.store_now_ms)
    raw.script_flush()
    results = redis_store.renew_many(
        [
            RenewRequest("job-a", "worker-b", second.generation, 30),
            RenewRequest("job-a", "worker-a", first.generation, 30),
        ]
    )
    assert isinstance(results[0], Renewed)
    assert isinstance(results[1], Refusal)
    assert results[1].reason is RefusalReason.SUPERSEDED
    raw.script_flush()
    assert redis_store.complete("job-a", "worker-b", second.generation) == Completed(
        "job-a", second.generation
    )
    age_completion(raw, redis_store.key("job-a"), 120)
    raw.script_flush()
    assert redis_store.purge(60) == 1
    assert redis_store.get("job-a") is None


def test_each_operation_is_one_evalsha_in_one_request(
    redis_server: RedisServer, raw: redis.Redis, unique: str
) -> None:
    store = RedisStore.from_url(
        redis_server.url, prefix=f"t{unique}:", connection_class=CountingConnection
    )
    try:
        # load every script once (a fresh server answers NOSCRIPT first)
        warm = store.claim("warm-up", "worker-a", 30)
        assert isinstance(warm, Acquired)
        store.renew("warm-up", "worker-a", warm.generation, 30)
        store.release("warm-up", "worker-a", warm.generation)
        again = store.claim("warm-up", "worker-a", 30)
        assert isinstance(again, Acquired)
        store.complete("warm-up", "worker-a", again.generation)

        before = commandstats(raw)
        sends_before = CountingConnection.sends
        first = store.claim("job-a", "worker-a", 30)
        assert isinstance(first, Acquired)
        assert isinstance(store.renew("job-a", "worker-a", first.generation, 30), Renewed)
        assert isinstance(store.release("job-a", "worker-a", first.generation), Released)
        second = store.claim("job-a", "worker-a", 30)
        assert isinstance(second, Acquired)
        assert isinstance(store.complete("job-a", "worker-a", second.generation), Completed)
        sends = CountingConnection.sends - sends_before
        after = commandstats(raw)
    finally:
        store.close()
    assert sends == 5
    assert after["cmdstat_evalsha"] - before["cmdstat_evalsha"] == 5
    for name in ("cmdstat_script|load", "cmdstat_script|exists", "cmdstat_eval"):
        assert after.get(name, 0) == before.get(name, 0)


def test_first_claim_writes_the_record_once_and_deletes_nothing(
    redis_store: RedisStore, raw: redis.Redis
) -> None:
    redis_store.claim("warm-up", "worker-a", 30)  # the script is loaded
    before = commandstats(raw)
    first = redis_store.claim("job-a", "worker-a", 0.05)
    assert isinstance(first, Acquired)
    after = commandstats(raw)
    calls = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    # one EXISTS finds no record; nothing else is read
    read = ("cmdstat_exists", "cmdstat_hgetall", "cmdstat_hmget", "cmdstat_type")
    assert [calls.get(name, 0) for name in read] == [1, 0, 0, 0]
    assert (calls.get("cmdstat_hset", 0), calls.get("cmdstat_hdel", 0)) == (1, 0)

    # a completion without an outcome is one read and one write
    done = redis_store.claim("job-c", "worker-a", 30)
    assert isinstance(done, Acquired)
    before = commandstats(raw)
    assert isinstance(redis_store.complete("job-c", "worker-a", done.generation), Completed)
    after = commandstats(raw)
    calls = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    writes = ("cmdstat_hmget", "cmdstat_hset", "cmdstat_hdel", "cmdstat_exists")
    assert [calls.get(name, 0) for name in writes] == [1, 1, 0, 0]

    # a claim over an old record clears the previous holder's times
    redis_store.renew("job-a", "worker-a", first.generation, 0.05)
    time.sleep(0.1)
    second = redis_store.claim("job-a", "worker-b", 30)
    assert isinstance(second, Acquired)
    assert "renewed_at" not in raw.hgetall(redis_store.key("job-a"))
    record = redis_store.get("job-a")
    assert record is not None
    assert (record.owner, record.renewed_at_ms, record.renew_count) == ("worker-b", None, 0)


def test_a_held_record_is_read_and_renewed_with_one_command_each(
    redis_store: RedisStore, raw: redis.Redis
) -> None:
    claimed = redis_store.claim("job-a", "worker-a", 30)
    assert isinstance(claimed, Acquired)
    redis_store.renew("job-a", "worker-a", claimed.generation, 30)  # the script is loaded
    before = commandstats(raw)
    renewed = redis_store.renew("job-a", "worker-a", claimed.generation, 30)
    after = commandstats(raw)
    assert isinstance(renewed, Renewed)
    calls = {name: after[name] - before.get(name, 0) for name in after if name != "cmdstat_info"}
    calls = {name: n for name, n in calls.items() if n}
    assert calls == {
        "cmdstat_evalsha": 1,
        "cmdstat_hmget": 1,
        "cmdstat_time": 1,
        "cmdstat_hset": 1,
    }
    record = redis_store.get("job-a")
    assert record is not None
    assert record.renew_count == 2


def test_a_server_that_cannot_compile_the_batch_script_renews_lease_by_lease(
    redis_store: RedisStore, raw: redis.Redis
) -> None:
    """Redis before 7 reads the script's flags line as code. As such a server
    would, this one is given the script with its flags line spoiled."""
    held = [redis_store.claim(f"job-{i}", "worker-a", 30) for i in range(5)]
    requests = [RenewRequest(h.job_id, "worker-a", h.generation, 40) for h in held]  # type: ignore[union-attr]
    requests[2] = RenewRequest("job-2", "worker-a", 1, 40)  # stale
    redis_store._renew_many_script = raw.register_script(" " + RENEW_MANY_SCRIPT)
    for _ in range(2):
        before = commandstats(raw)
        results = redis_store.renew_many(requests)
        after = commandstats(raw)
        assert [r.job_id for r in results] == [r.job_id for r in requests]
        assert isinstance(results[2], Refusal)
        assert all(isinstance(r, Renewed) for i, r in enumerate(results) if i != 2)
    # the second round does not try the batch script again
    assert after.get("cmdstat_script|load", 0) == before.get("cmdstat_script|load", 0)
    assert after["cmdstat_evalsha"] - before["cmdstat_evalsha"] == len(requests)


def test_a_prefix_with_a_nul_is_refused(redis_server: RedisServer) -> None:
    with pytest.raises(LeaseConfigurationError, match="NUL"):
        RedisStore.from_url(redis_server.url, prefix="a\x00b:")


def test_a_server_short_of_replicas_is_an_outage_not_a_configuration_error() -> None:
    for server in serve(lambda: RedisServer("--min-replicas-to-write", "1")):
        store = RedisStore.from_url(server.url, check_config=False)
        try:
            with pytest.raises(StoreUnavailable, match="NOREPLICAS"):
                store.claim("job-a", "worker-a", 30)
        finally:
            store.close()


def test_a_cluster_client_error_is_an_outage() -> None:
    store = RedisStore.from_url("redis://127.0.0.1:1/0", check_config=False)
    with pytest.raises(StoreUnavailable, match="renew_many"), store._errors("renew_many"):
        raise RedisClusterException("no node serves slot 866")


@pytest.mark.parametrize("spoiled", ["many", "inf", "1e400", "-3", "99999999999999999999"])
def test_a_renew_count_that_is_not_a_whole_number_starts_again(
    redis_store: RedisStore, raw: redis.Redis, spoiled: str
) -> None:
    claimed = redis_store.claim("job-a", "worker-a", 30)
    assert isinstance(claimed, Acquired)
    raw.hset(redis_store.key("job-a"), "renew_count", spoiled)
    assert isinstance(redis_store.renew("job-a", "worker-a", claimed.generation, 30), Renewed)
    assert raw.hget(redis_store.key("job-a"), "renew_count") == "1"


def test_a_renew_count_that_is_not_a_number_does_not_stop_renewals(
    redis_store: RedisStore, raw: redis.Redis
) -> None:
    claimed = redis_store.claim("job-a", "worker-a", 30)
    assert isinstance(claimed, Acquired)
    raw.hset(redis_store.key("job-a"), "renew_count", "many")
    assert isinstance(redis_store.renew("job-a", "worker-a", claimed.generation, 30), Renewed)
    [many] = redis_store.renew_many([RenewRequest("job-a", "worker-a", claimed.generation, 30)])
    assert isinstance(many, Renewed)
    assert raw.hget(redis_store.key("job-a"), "renew_count") == "2"


def test_refusals_name_the_current_record_from_one_reply(redis_store: RedisStore) -> None:
    first = redis_store.claim("job-a", "worker-a", 0.05)
    assert isinstance(first, Acquired)
    time.sleep(0.1)
    second = redis_store.claim("job-a", "worker-b", 30)
    assert isinstance(second, Acquired)
    assert second.takeovers == 1
    refused = redis_store.complete("job-a", "worker-a", first.generation)
    assert refused == Refusal(
        "job-a",
        "worker-a",
        first.generation,
        RefusalReason.SUPERSEDED,
        current_owner="worker-b",
        current_generation=second.generation,
    )


def test_held_elsewhere_reports_holder_and_time_left(redis_store: RedisStore) -> None:
    first = redis_store.claim("job-a", "worker-a", 30)
    assert isinstance(first, Acquired)
    held = redis_store.claim("job-a", "worker-b", 30)
    assert isinstance(held, HeldElsewhere)
    assert (held.holder, held.generation) == ("worker-a", first.generation)
    assert 25 < held.remaining <= 30


# --- records and purge --------------------------------------------------------


def test_records_escape_glob_characters_in_the_prefix(
    redis_server: RedisServer, unique: str
) -> None:
    # unescaped, the pattern "p…[ab]*:{*}" would also match the keys "p…a:{…}"
    odd = RedisStore.from_url(redis_server.url, prefix=f"p{unique}[ab]*:")
    plain = RedisStore.from_url(redis_server.url, prefix=f"p{unique}a:")
    try:
        plain.claim("other", "worker-z", 30)
        odd_ids = ["job}{*?[x]", "job-2", "jöb-3"]
        for job_id in odd_ids:
            odd.claim(job_id, "worker-a", 30)
        done = odd.claim("job-done", "worker-a", 30)
        assert isinstance(done, Acquired)
        odd.complete("job-done", "worker-a", done.generation)

        assert sorted(r.job_id for r in odd.records()) == sorted([*odd_ids, "job-done"])
        assert [r.job_id for r in odd.records(state=LeaseState.COMPLETED)] == ["job-done"]
        assert sorted(r.job_id for r in odd.records(state=LeaseState.HELD)) == sorted(odd_ids)
        assert [r.job_id for r in plain.records()] == ["other"]
    finally:
        odd.close()
        plain.close()


def test_records_walk_more_keys_than_one_scan_batch(redis_store: RedisStore) -> None:
    job_ids = {f"job-{i}" for i in range(1200)}
    for job_id in job_ids:
        redis_store.claim(job_id, "worker-a", 60)
    assert {r.job_id for r in redis_store.records()} == job_ids
    assert len(list(redis_store.records(limit=10))) == 10


def test_purge_keeps_young_and_unfinished_records(
    redis_store: RedisStore, raw: redis.Redis
) -> None:
    for job_id in ("old", "young", "held"):
        redis_store.claim(job_id, "worker-a", 60)
    for job_id in ("old", "young"):
        record = redis_store.get(job_id)
        assert record is not None
        redis_store.complete(job_id, "worker-a", record.generation)
    age_completion(raw, redis_store.key("old"), 120)
    assert redis_store.purge(60) == 1
    assert {r.job_id for r in redis_store.records()} == {"young", "held"}


# --- configuration warnings -----------------------------------------------------


def test_warns_when_maxmemory_policy_can_evict(own_redis: ServerFactory) -> None:
    server = own_redis("--maxmemory-policy", "allkeys-lru")
    with pytest.warns(RedisConfigWarning, match="maxmemory-policy 'allkeys-lru'"):
        store = RedisStore.from_url(server.url)
    store.close()


def test_warns_when_appendonly_is_off(own_redis: ServerFactory) -> None:
    server = own_redis("--appendonly", "no")
    with pytest.warns(RedisConfigWarning, match="appendonly 'no'"):
        store = RedisStore.from_url(server.url)
    store.close()


def test_durable_config_opens_without_warning(redis_server: RedisServer) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = RedisStore.from_url(redis_server.url)
        store.now_ms()
        store.close()
    assert [w for w in caught if issubclass(w.category, RedisConfigWarning)] == []


def test_check_config_false_skips_the_check(own_redis: ServerFactory) -> None:
    server = own_redis("--appendonly", "no")
    with RedisStore.from_url(server.url, check_config=False) as store:
        assert store.now_ms() > 0


def test_disabled_config_command_is_skipped(own_redis: ServerFactory) -> None:
    # managed Redis services often refuse CONFIG; the store must still open
    server = own_redis("--appendonly", "no", "--rename-command", "CONFIG", "")
    with RedisStore.from_url(server.url) as store:
        assert isinstance(store.claim("job-a", "worker-a", 10), Acquired)


def test_config_check_waits_for_a_server_down_at_open(own_redis: ServerFactory) -> None:
    server = own_redis("--maxmemory-policy", "allkeys-lru")
    server.stop()
    store = RedisStore.from_url(server.url)  # no server, no warning, no error
    try:
        server.start()
        with pytest.warns(RedisConfigWarning, match="maxmemory-policy"):
            assert isinstance(store.claim("job-a", "worker-a", 10), Acquired)
    finally:
        store.close()


# --- restarts ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_generation_continues_after_restart(own_redis: ServerFactory, how: str) -> None:
    # appendfsync always: also SIGKILL must not lose an acknowledged claim
    server = own_redis()
    with RedisStore.from_url(server.url) as store:
        first = store.claim("job-a", "worker-a", 30)
        assert isinstance(first, Acquired)
        assert isinstance(store.release("job-a", "worker-a", first.generation), Released)
        getattr(server, how)()
        server.start()
        second = store.claim("job-a", "worker-b", 30)
        assert isinstance(second, Acquired)
        assert second.generation == max(first.generation + 1, second.store_now_ms)


def test_completed_job_stays_completed_after_restart(own_redis: ServerFactory) -> None:
    server = own_redis()
    with RedisStore.from_url(server.url) as store:
        first = store.claim("job-a", "worker-a", 30)
        assert isinstance(first, Acquired)
        store.complete("job-a", "worker-a", first.generation)
        server.restart()
        assert store.claim("job-a", "worker-b", 30) == AlreadyCompleted("job-a", first.generation)


def test_claim_after_purge_and_restart_is_above_the_old_generation(
    own_redis: ServerFactory,
) -> None:
    server = own_redis()
    raw = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        with RedisStore.from_url(server.url) as store:
            first = store.claim("job-a", "worker-a", 30)
            assert isinstance(first, Acquired)
            store.complete("job-a", "worker-a", first.generation)
            age_completion(raw, store.key("job-a"), 120)
            assert store.purge(60) == 1
            server.restart()
            assert store.get("job-a") is None
            again = store.claim("job-a", "worker-b", 30)
            assert isinstance(again, Acquired)
            assert again.generation > first.generation
    finally:
        raw.close()


# --- store unavailable ------------------------------------------------------------


def test_every_operation_raises_store_unavailable_when_redis_is_down(
    own_redis: ServerFactory,
) -> None:
    server = own_redis()
    with RedisStore.from_url(server.url, socket_timeout=2, socket_connect_timeout=2) as store:
        held = store.claim("job-a", "worker-a", 60)
        assert isinstance(held, Acquired)
        server.stop()

        operations = every_operation(store, "job-a", "worker-a", held.generation, 60)
        for name, operation in operations.items():
            with pytest.raises(StoreUnavailable) as caught:
                operation()
            assert isinstance(caught.value, LeaseError)
            assert isinstance(caught.value.__cause__, redis.RedisError), name
            assert server.url in str(caught.value)
            assert name.split()[0].split("_")[0] in str(caught.value)

        # the same handle works again once the server is back, with the data
        server.start()
        assert isinstance(store.renew("job-a", "worker-a", held.generation, 60), Renewed)


def test_unreadable_record_raises_unreadable_not_unavailable(
    redis_store: RedisStore, raw: redis.Redis
) -> None:
    raw.hset(redis_store.key("job-a"), mapping={"generation": "12", "state": "paused"})
    with pytest.raises(LeaseRecordUnreadable, match=r"job 'job-a'.* is unreadable"):
        redis_store.get("job-a")


def test_claim_whose_reply_is_lost_is_not_acquired(own_redis: ServerFactory) -> None:
    server = own_redis()
    assert server.proc is not None
    with RedisStore.from_url(server.url, socket_timeout=0.5) as store:
        store.now_ms()  # connected and checked before the server freezes
        server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailable, match="claim of job 'job-a'"):
                store.claim("job-a", "worker-a", 0.2)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        # whether or not the script ran, the job is claimable once the ttl runs out
        deadline = time.monotonic() + 10
        while True:
            result = store.claim("job-a", "worker-b", 30)
            if isinstance(result, Acquired) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert isinstance(result, Acquired)


# --- batched renew ------------------------------------------------------------------


def _counted_renew_many(
    store: RedisStore, raw: redis.Redis, requests: list[RenewRequest]
) -> tuple[list[Any], int, dict[str, int]]:
    """``renew_many``'s results, the requests it wrote to its socket, and the
    commands the server ran for it at the top level (scripts' own are not)."""
    before = commandstats(raw)
    sends_before = CountingConnection.sends
    results = store.renew_many(requests)
    sends = CountingConnection.sends - sends_before
    after = commandstats(raw)
    own = ("cmdstat_evalsha", "cmdstat_script|load", "cmdstat_script|exists", "cmdstat_eval")
    calls = {name: after.get(name, 0) - before.get(name, 0) for name in own}
    return results, sends, {name: n for name, n in calls.items() if n}


def test_renew_many_is_one_round_trip_with_refusals_in_order(
    redis_server: RedisServer, raw: redis.Redis, unique: str
) -> None:
    store = RedisStore.from_url(
        redis_server.url, prefix=f"t{unique}:", connection_class=CountingConnection
    )
    try:
        live = [store.claim(f"live-{i}", "worker-a", 30) for i in range(50)]
        taken = store.claim("taken", "worker-a", 0.05)
        released = store.claim("released", "worker-a", 30)
        completed = store.claim("completed", "worker-a", 30)
        for result in (*live, taken, released, completed):
            assert isinstance(result, Acquired)
        assert isinstance(taken, Acquired)
        assert isinstance(released, Acquired)
        assert isinstance(completed, Acquired)
        time.sleep(0.1)
        assert isinstance(store.claim("taken", "worker-b", 30), Acquired)
        store.release("released", "worker-a", released.generation)
        store.complete("completed", "worker-a", completed.generation)
        # the renew-many script is in the server's cache (a flush costs one reload)
        store.renew_many([RenewRequest(live[0].job_id, "worker-a", live[0].generation, 30)])

        requests = [RenewRequest(r.job_id, "worker-a", r.generation, 60) for r in live[:25]]
        requests += [
            RenewRequest("taken", "worker-a", taken.generation, 60),
            RenewRequest("released", "worker-a", released.generation, 60),
            RenewRequest("missing", "worker-a", 7, 60),
            RenewRequest("completed", "worker-a", completed.generation, 60),
        ]
        requests += [RenewRequest(r.job_id, "worker-a", r.generation, 60) for r in live[25:]]

        results, sends, calls = _counted_renew_many(store, raw, requests)
    finally:
        store.close()

    assert sends == 1
    # one script call renews every lease
    assert calls == {"cmdstat_evalsha": 1}

    assert [r.job_id for r in results] == [r.job_id for r in requests]
    reasons = {r.job_id: r.reason for r in results if isinstance(r, Refusal)}
    assert reasons == {
        "taken": RefusalReason.SUPERSEDED,
        "released": RefusalReason.RELEASED,
        "missing": RefusalReason.MISSING,
        "completed": RefusalReason.COMPLETED,
    }
    renewed = [r for r in results if isinstance(r, Renewed)]
    assert len(renewed) == len(live)
    assert all(r.lease_until_ms - r.store_now_ms == 60_000 for r in renewed)


def test_renew_many_sends_its_chunks_in_one_round_trip(
    redis_server: RedisServer, raw: redis.Redis, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_batches, "RENEW_CHUNK", 7)
    store = RedisStore.from_url(
        redis_server.url, prefix=f"t{unique}:", connection_class=CountingConnection
    )
    try:
        held = [store.claim(f"job-{i}", "worker-a", 30) for i in range(20)]
        requests = [RenewRequest(h.job_id, "worker-a", h.generation, 45) for h in held]  # type: ignore[union-attr]
        requests[9] = RenewRequest("job-9", "worker-a", 1, 45)  # stale, in the second chunk
        store.renew_many(requests[:1])  # the script is in the server's cache
        results, sends, calls = _counted_renew_many(store, raw, requests)
    finally:
        store.close()
    assert sends == 1
    assert calls == {"cmdstat_evalsha": 3}  # 7 + 7 + 6 leases
    assert [r.job_id for r in results] == [r.job_id for r in requests]
    assert isinstance(results[9], Refusal)
    assert results[9].reason is RefusalReason.SUPERSEDED
    assert all(isinstance(r, Renewed) for i, r in enumerate(results) if i != 9)
    assert all(
        r.lease_until_ms - r.store_now_ms == 45_000 for r in results if isinstance(r, Renewed)
    )
    for i in range(20):
        expected = {0: "2", 9: "0"}.get(i, "1")  # job-0 was renewed by the warm-up too
        assert raw.hget(f"t{unique}:{{job-{i}}}", "renew_count") == expected


@pytest.mark.parametrize("given", [True, False], ids=["given-client", "from-url"])
def test_a_decoding_client_keeps_a_binary_outcome_whole(
    redis_server: RedisServer, unique: str, given: bool
) -> None:
    outcome = b"\x80\x04\x95pickled\xff\xfe"  # not UTF-8, as a pickled result is not
    if given:
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        store = RedisStore(client, prefix=f"t{unique}:")
    else:
        store = RedisStore.from_url(redis_server.url, prefix=f"t{unique}:", decode_responses=True)
    with store:
        held = store.claim("job", "worker-a", 30, send_id="send-1")
        stale = store.claim("other", "worker-a", 30)
        assert isinstance(held, Acquired)
        assert isinstance(stale, Acquired)
        assert store.complete("job", "worker-a", held.generation, outcome=outcome) == Completed(
            "job", held.generation
        )
        again = store.claim("job", "worker-b", 30, send_id="send-1")
        assert isinstance(again, AlreadyCompleted)
        assert again.outcome == outcome
        record = store.get("job")
        assert record is not None
        assert record.outcome == outcome
        assert {r.job_id: r.outcome for r in store.records()}["job"] == outcome
        # a stale renewal of the completed job is refused, and the other lease
        # of the same batch is renewed
        refused, renewed = store.renew_many(
            [
                RenewRequest("job", "worker-a", held.generation, 30),
                RenewRequest("other", "worker-a", stale.generation, 30),
            ]
        )
        assert isinstance(refused, Refusal)
        assert refused.reason is RefusalReason.COMPLETED
        assert isinstance(renewed, Renewed)
        late = store.complete("job", "worker-c", held.generation + 1)
        assert isinstance(late, Refusal)
