"""The Redis lease store behind Sentinel: URLs as kombu spells them, and a failover.

One master, one replica and three real sentinels on free ports. The failover
test makes the replica miss the last claims on purpose (paused with SIGSTOP,
its link to the master cut), kills the master with SIGKILL and lets the
sentinels promote the replica. Then the store reaches the new master by
itself; leases claimed before the pause continue, leases whose claim was lost
are reported lost, none is held twice, and every generation handed out after
the failover is above every one handed out before it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import redis

from celery_leases import (
    Acquired,
    HeldElsewhere,
    LeaseStore,
    Refusal,
    RefusalReason,
    Released,
    Renewed,
    open_store,
)
from celery_leases.errors import LeaseConfigurationError, StaleFencingToken
from celery_leases.fencing import Token
from celery_leases.fencing.redis import RedisFence
from celery_leases.stores.redis._sentinel import parse_sentinel_url
from tests.conftest import serve
from tests.leases import until_reachable
from tests.servers import RedisServer, SentinelGroup

MASTER = SentinelGroup.MASTER_NAME


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    for started in serve(SentinelGroup):
        started.wait_ready()
        yield started


@pytest.fixture
def store(group: SentinelGroup) -> Iterator[LeaseStore]:
    opened = open_store(group.url, master_name=MASTER, prefix="s:")
    yield opened
    opened.close()


def test_the_url_lists_sentinels_and_the_master_credentials() -> None:
    parsed = parse_sentinel_url(
        "sentinel://:secret@10.0.0.1:26380/2;sentinel://10.0.0.2;sentinel://10.0.0.3:26379"
    )
    assert parsed.sentinels == [("10.0.0.1", 26380), ("10.0.0.2", 26379), ("10.0.0.3", 26379)]
    assert (parsed.password, parsed.db) == ("secret", 2)


@pytest.mark.parametrize(
    ("url", "options", "word"),
    [
        ("sentinel://127.0.0.1:26379", {}, "master_name"),
        ("sentinel://127.0.0.1:26379;redis://127.0.0.1:6379", {"master_name": "m"}, "sentinel"),
        ("sentinel://127.0.0.1:26379/x", {"master_name": "m"}, "whole number"),
    ],
)
def test_a_bad_sentinel_url_is_a_configuration_error(
    url: str, options: dict[str, str], word: str
) -> None:
    with pytest.raises(LeaseConfigurationError, match=word):
        open_store(url, **options)


def test_the_store_url_shows_no_password_of_any_sentinel() -> None:
    store = open_store(
        "sentinel://:first-secret@127.0.0.1:1;sentinel://:second-secret@127.0.0.1:2",
        master_name=MASTER,
        check_config=False,
    )
    try:
        assert "secret" not in store.url
        assert "secret" not in repr(store)
    finally:
        store.close()


def test_claims_go_to_the_master_the_sentinels_name(
    group: SentinelGroup, store: LeaseStore
) -> None:
    claimed = store.claim("job", "worker-a", 30)
    assert isinstance(claimed, Acquired)
    master = redis.Redis(port=group.master.port)
    try:
        assert master.hget("s:{job}", "generation") == str(claimed.generation).encode()
    finally:
        master.close()


def test_failover_to_a_lagging_replica_hands_out_no_generation_twice(
    group: SentinelGroup, store: LeaseStore, redis_server: RedisServer, unique: str
) -> None:
    # the fence lives on another server: it keeps what the store loses
    fence_client = redis.Redis.from_url(redis_server.url)
    fence = RedisFence(fence_client, prefix=f"sent{unique}:")
    master = redis.Redis(port=group.master.port)
    replica = group.replica.proc
    assert replica is not None
    handed_out: dict[str, list[int]] = {}

    def claim(job: str, owner: str) -> Acquired:
        claimed = store.claim(job, owner, 60)
        assert isinstance(claimed, Acquired), claimed
        fence.set(f"effect:{job}", owner, Token(job, claimed.generation))
        handed_out.setdefault(job, []).append(claimed.generation)
        return claimed

    try:
        # held before the pause, and on the replica (WAIT: acknowledged by it)
        steady = {job: claim(job, "worker-a") for job in ("steady-1", "steady-2")}
        first = claim("cycled", "worker-a")
        assert isinstance(store.release("cycled", "worker-a", first.generation), Released)
        assert master.wait(1, 5000) == 1

        # the replica stops receiving: paused, and its link cut by the master
        replica.send_signal(signal.SIGSTOP)
        master.execute_command("CLIENT", "KILL", "TYPE", "replica")  # any redis-py
        lost = {job: claim(job, "worker-a") for job in ("lost-1", "lost-2")}
        for _ in range(3):  # claimed and released again: generations the replica never saw
            again = claim("cycled", "worker-a")
            assert isinstance(store.release("cycled", "worker-a", again.generation), Released)
        before = {job: max(generations) for job, generations in handed_out.items()}

        group.master.kill()
        replica.send_signal(signal.SIGCONT)
        group.wait_master(group.replica.port)

        # held leases either continue or are reported lost; none is doubled
        for job, held in steady.items():
            renewed = until_reachable(
                lambda held=held: store.renew(held.job_id, "worker-a", held.generation, 60)  # type: ignore[misc]
            )
            assert isinstance(renewed, Renewed), (job, renewed)
            assert isinstance(store.claim(job, "worker-b", 60), HeldElsewhere)
        for job, held in lost.items():
            refused = store.renew(job, "worker-a", held.generation, 60)
            assert isinstance(refused, Refusal), (job, refused)
            assert refused.reason is RefusalReason.MISSING
            claim(job, "worker-b")  # the job is not lost: another worker takes it
        claim("cycled", "worker-b")

        for job in ("lost-1", "lost-2", "cycled"):
            newest = handed_out[job][-1]
            assert newest > before[job], f"I1: {job} got {newest} after {handed_out[job][:-1]}"
            # the fence kept the lost generations and still refuses them
            with pytest.raises(StaleFencingToken):
                fence.set(f"effect:{job}", "late", Token(job, before[job]))
    finally:
        replica.send_signal(signal.SIGCONT)
        master.close()
        fence_client.close()
