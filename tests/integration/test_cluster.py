"""The Redis store on a real Redis Cluster: 3 masters, 3 replicas.

(The conformance suite runs on the session's cluster too:
``tests/integration/test_conformance.py`` with ``redis-cluster``.) Here:
renewals grouped per node, a resharding of the slots that hold live leases
while they are renewed, and a master killed with SIGKILL, its replica
promoted after it missed the last claims.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from celery_leases import (
    Acquired,
    HeldElsewhere,
    LeaseConfigurationError,
    LeaseStore,
    Refusal,
    RefusalReason,
    Released,
    Renewed,
    RenewRequest,
    open_store,
)
from celery_leases.errors import StaleFencingToken
from celery_leases.fencing import Token
from celery_leases.fencing.redis import RedisFence
from tests.conftest import serve
from tests.leases import until_reachable
from tests.servers import RedisCluster, RedisServer


def _slot(job_id: str) -> int:
    return int(key_slot(job_id.encode()))


def _jobs_in_slots(low: int, high: int, count: int) -> list[str]:
    """``count`` job ids whose slots are in ``low..high``."""
    found: list[str] = []
    n = 0
    while len(found) < count:
        job = f"job-{n}"
        if low <= _slot(job) <= high:
            found.append(job)
        n += 1
    return found


def _node_id(cluster: RedisCluster, port: int) -> str:
    return cluster.node_cli(port, "CLUSTER", "MYID").strip()


def _first_slots(cluster: RedisCluster, port: int) -> tuple[int, int]:
    """The first slot range that the master on ``port`` serves."""
    for line in cluster.node_cli(port, "CLUSTER", "NODES").splitlines():
        fields = line.split()
        if "myself" in fields[2]:
            low, _, high = fields[8].partition("-")
            return int(low), int(high or low)
    raise AssertionError(f"no slots on {port}")


@pytest.fixture
def cluster_store(redis_cluster: RedisCluster, unique: str) -> Iterator[LeaseStore]:
    store = open_store(redis_cluster.url, prefix=f"c{unique}:")
    yield store
    store.close()


def test_a_prefix_with_a_brace_is_refused_on_a_cluster(redis_cluster: RedisCluster) -> None:
    with pytest.raises(LeaseConfigurationError, match="hash tag"):
        open_store(redis_cluster.url, prefix="{all}:")


def test_renew_many_answers_leases_on_every_master(
    redis_cluster: RedisCluster, cluster_store: LeaseStore
) -> None:
    jobs = [f"spread-{n}" for n in range(30)]
    held = [cluster_store.claim(job, "worker-a", 30) for job in jobs]
    assert all(isinstance(h, Acquired) for h in held)
    masters = {redis_cluster.node_of_slot(_slot(job)).port for job in jobs}
    assert len(masters) == 3  # the batch really spans every node
    requests = [RenewRequest(h.job_id, "worker-a", h.generation, 30) for h in held]  # type: ignore[union-attr]
    requests.insert(5, RenewRequest("spread-0", "worker-b", 1, 30))  # a stale one among them
    cluster_store.renew_many(requests)  # the script is in every node's cache
    before = _evalsha_calls(redis_cluster)
    results = cluster_store.renew_many(requests)
    after = _evalsha_calls(redis_cluster)
    # one script call per master, whatever the number of slots
    assert {port: after[port] - before[port] for port in masters} == dict.fromkeys(masters, 1)
    assert [r.job_id for r in results] == [r.job_id for r in requests]
    assert isinstance(results[5], Refusal)
    assert all(isinstance(r, Renewed) for i, r in enumerate(results) if i != 5)


def _evalsha_calls(cluster: RedisCluster) -> dict[int, int]:
    """EVALSHA calls so far, per live node."""
    calls = {}
    for node in cluster.live_nodes():
        stats = redis.Redis(port=node.port).info("commandstats")
        calls[node.port] = int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    return calls


def test_renew_many_renews_every_lease_while_a_slot_is_half_migrated(
    own_cluster: RedisCluster,
) -> None:
    """A slot in the middle of a migration: one of its records is on the
    target, one still on the source. The source's renew-many call fails at
    the moved record (ASK when it is the declared key, an error from inside
    the script when it is not); every lease is still renewed."""
    store = open_store(own_cluster.url, prefix="m:")
    source = own_cluster.node_of_slot(0)
    target = next(n for n in own_cluster.live_nodes() if n is not source and "master" in _role(n))
    low, high = _first_slots(own_cluster, source.port)
    moved_job, staying_job = _jobs_in_slots(low, low, 2)
    others = _jobs_in_slots(low + 1, high, 6)
    try:
        held = {}
        for job in (moved_job, staying_job, *others):
            claimed = store.claim(job, "worker-a", 30)
            assert isinstance(claimed, Acquired)
            held[job] = claimed
        slot = str(low)
        own_cluster.node_cli(
            target.port, "CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(own_cluster, source.port)
        )
        own_cluster.node_cli(
            source.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(own_cluster, target.port)
        )
        reply = own_cluster.node_cli(
            source.port, "MIGRATE", "127.0.0.1", str(target.port), f"m:{{{moved_job}}}", "0", "5000"
        )
        assert reply.strip() == "OK"
        orders = {
            "declared": [moved_job, staying_job, *others],
            "inside": [*others[:3], staying_job, moved_job, *others[3:]],
        }
        for where, order in orders.items():
            requests = [RenewRequest(job, "worker-a", held[job].generation, 40) for job in order]
            results = store.renew_many(requests)
            assert [r.job_id for r in results] == order, where
            assert all(isinstance(r, Renewed) for r in results), (where, results)
        record = store.get(moved_job)  # the cluster client follows the ASK to the target
        assert record is not None
        assert record.renew_count == 2
        assert record.generation == held[moved_job].generation
    finally:
        store.close()


def test_resharding_the_slots_of_live_leases_loses_none(
    redis_cluster: RedisCluster, cluster_store: LeaseStore
) -> None:
    source = redis_cluster.node_of_slot(0)
    target = next(n for n in redis_cluster.live_nodes() if n is not source and "master" in _role(n))
    low, high = _first_slots(redis_cluster, source.port)
    moved = 100
    jobs = _jobs_in_slots(low, min(high, low + moved - 1), 12)
    held = {}
    for job in jobs:
        claimed = cluster_store.claim(job, "worker-a", 30)
        assert isinstance(claimed, Acquired)
        held[job] = claimed
    reshard = subprocess.Popen(
        [
            "redis-cli", "--cluster", "reshard", f"127.0.0.1:{source.port}",
            "--cluster-from", _node_id(redis_cluster, source.port),
            "--cluster-to", _node_id(redis_cluster, target.port),
            "--cluster-slots", str(moved), "--cluster-yes",
            "--cluster-pipeline", "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    rounds = 0
    try:
        deadline = time.monotonic() + 60
        while True:
            done = reshard.poll() is not None
            requests = [RenewRequest(j, "worker-a", h.generation, 30) for j, h in held.items()]
            for request, result in zip(requests, cluster_store.renew_many(requests), strict=True):
                assert isinstance(result, Renewed), (request, result)
            for job in jobs[:3]:
                rival = cluster_store.claim(job, "worker-b", 30)
                assert isinstance(rival, HeldElsewhere), rival
                assert rival.generation == held[job].generation
            rounds += 1
            if done:
                break
            assert time.monotonic() < deadline, "the resharding did not finish"
    finally:
        if reshard.poll() is None:
            reshard.kill()
        reshard.wait()
    assert reshard.returncode == 0
    assert rounds >= 1
    # every lease now lives on the target, still held and complete-able
    for job, claimed in held.items():
        assert redis_cluster.node_of_slot(_slot(job)) is target
        completed = cluster_store.complete(job, "worker-a", claimed.generation)
        assert not isinstance(completed, Refusal), completed


def _role(node: RedisServer) -> str:
    return redis.Redis(port=node.port).execute_command("ROLE")[0].decode()  # type: ignore[no-any-return]


@pytest.fixture
def own_cluster() -> Iterator[RedisCluster]:
    """A cluster of this test alone: it kills one of its masters."""
    yield from serve(RedisCluster)


def test_a_master_killed_after_its_replica_missed_claims_hands_out_no_generation_twice(
    own_cluster: RedisCluster, redis_server: RedisServer, unique: str
) -> None:
    store = open_store(own_cluster.url, prefix="k:")
    fence_client = redis.Redis.from_url(redis_server.url)
    fence = RedisFence(fence_client, prefix=f"clu{unique}:")
    victim = own_cluster.node_of_slot(0)
    low, high = _first_slots(own_cluster, victim.port)
    steady_job, cycled_job, lost_job = _jobs_in_slots(low, high, 3)
    replica = next(
        n for n in own_cluster.live_nodes()
        if f"master_port:{victim.port}" in own_cluster.node_cli(n.port, "INFO", "replication")
    )  # fmt: skip
    assert replica.proc is not None
    master = redis.Redis(port=victim.port)
    handed_out: dict[str, list[int]] = {}

    def claim(job: str, owner: str) -> Acquired:
        claimed = until_reachable(lambda: store.claim(job, owner, 60))
        assert isinstance(claimed, Acquired), claimed
        fence.set(f"effect:{job}", owner, Token(job, claimed.generation))
        handed_out.setdefault(job, []).append(claimed.generation)
        return claimed

    try:
        steady = claim(steady_job, "worker-a")
        first = claim(cycled_job, "worker-a")
        assert isinstance(store.release(cycled_job, "worker-a", first.generation), Released)
        assert master.wait(1, 5000) == 1

        replica.proc.send_signal(signal.SIGSTOP)
        master.execute_command("CLIENT", "KILL", "TYPE", "replica")  # any redis-py
        lost = claim(lost_job, "worker-a")
        for _ in range(3):
            again = claim(cycled_job, "worker-a")
            assert isinstance(store.release(cycled_job, "worker-a", again.generation), Released)
        before = {job: max(generations) for job, generations in handed_out.items()}

        victim.kill()
        replica.proc.send_signal(signal.SIGCONT)
        own_cluster.wait_ok()

        renewed = until_reachable(
            lambda: store.renew(steady_job, "worker-a", steady.generation, 60)
        )
        assert isinstance(renewed, Renewed), renewed
        assert isinstance(store.claim(steady_job, "worker-b", 60), HeldElsewhere)
        refused = store.renew(lost_job, "worker-a", lost.generation, 60)
        assert isinstance(refused, Refusal)
        assert refused.reason is RefusalReason.MISSING
        claim(lost_job, "worker-b")
        claim(cycled_job, "worker-b")
        for job in (lost_job, cycled_job):
            assert handed_out[job][-1] > before[job], f"I1: {job}: {handed_out[job]}"
            with pytest.raises(StaleFencingToken):
                fence.set(f"effect:{job}", "late", Token(job, before[job]))
    finally:
        replica.proc.send_signal(signal.SIGCONT)
        master.close()
        fence_client.close()
        store.close()
