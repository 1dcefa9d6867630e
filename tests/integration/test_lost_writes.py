"""A store that loses its last writes still never hands out a generation twice.

Every claim takes ``max(previous + 1, store clock)``. These tests make a real
store lose its last claims (redis-server killed with SIGKILL and started from
an older AOF or RDB file; PostgreSQL with ``synchronous_commit=off`` stopped
in immediate mode; MariaDB that writes its redo log only now and then,
killed with SIGKILL) and check that every generation handed out after the
restart is above every one handed out before (I1), and that a fenced target
that saw the lost generations accepts every write of the new ones and never
a lower one (I5).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from celery_leases import Acquired, LeaseStore, Released, open_store
from celery_leases.errors import StaleFencingToken
from celery_leases.fencing import Token
from celery_leases.fencing.redis import RedisFence
from celery_leases.stores.redis import RedisConfigWarning
from celery_leases.stores.sql import SqlStore
from tests.conftest import serve
from tests.servers import MariadbServer, PostgresServer, RedisServer

JOBS = ("job-a", "job-b")
ROUNDS = 4


class Ledger:
    """Claims and releases ``JOBS`` in turn; writes each generation to a fence."""

    def __init__(self, store: LeaseStore, fence: RedisFence, owner: str) -> None:
        self.store = store
        self.fence = fence
        self.owner = owner
        self.handed_out: dict[str, list[int]] = {job: [] for job in JOBS}

    def claim_and_release(self, rounds: int = ROUNDS) -> None:
        for _ in range(rounds):
            for job in JOBS:
                claimed = self.store.claim(job, self.owner, 30)
                assert isinstance(claimed, Acquired), claimed
                # the fence lives on another server: it keeps what the store lost
                self.fence.set(f"effect:{job}", claimed.generation, Token(job, claimed.generation))
                released = self.store.release(job, self.owner, claimed.generation)
                assert isinstance(released, Released), released
                self.handed_out[job].append(claimed.generation)


@pytest.fixture
def fence(redis_server: RedisServer, unique: str) -> Iterator[RedisFence]:
    client = redis.Redis.from_url(redis_server.url)
    yield RedisFence(client, prefix=f"lost{unique}:")
    client.close()


def assert_lost_then_above(store: LeaseStore, before: Ledger, fence: RedisFence) -> None:
    """The store lost claims of ``before``; new claims go above all of them."""
    for job in JOBS:
        record = store.get(job)
        assert record is not None, f"{job}: the whole record was lost, not only its last claims"
        # the restart really lost writes: the record is older than the last claim
        assert record.generation < before.handed_out[job][-1], (job, record)
    after = Ledger(store, fence, "after-restart")
    after.claim_and_release()
    for job in JOBS:
        assert min(after.handed_out[job]) > max(before.handed_out[job]), (
            f"I1: {job} handed out {after.handed_out[job]} after {before.handed_out[job]}"
        )
        accepted = fence.accepted(f"effect:{job}")
        assert accepted is not None
        assert accepted.generation == after.handed_out[job][-1]
    # and the fence still refuses every generation of the lost claims
    for job in JOBS:
        with pytest.raises(StaleFencingToken):
            fence.set(f"effect:{job}", "late", Token(job, before.handed_out[job][-1]))


@pytest.fixture
def own_redis() -> Iterator[Callable[..., RedisServer]]:
    started: list[Iterator[RedisServer]] = []

    def make(*args: str) -> RedisServer:
        server = serve(lambda: RedisServer(*args))
        started.append(server)
        return next(server)

    yield make
    for server in started:
        next(server, None)


def test_redis_aof_everysec_restarted_from_an_older_file(
    own_redis: Callable[..., RedisServer], fence: RedisFence
) -> None:
    server = own_redis("--appendonly", "yes", "--appendfsync", "everysec")
    store = open_store(server.url)
    try:
        before = Ledger(store, fence, "before-restart")
        before.claim_and_release(rounds=1)
        older = server.copy_files()  # what an OS crash would have kept
        before.claim_and_release()
        server.kill()
        server.put_back(older)
        server.start()
        assert_lost_then_above(store, before, fence)
    finally:
        store.close()


def test_redis_snapshots_only_killed_after_the_last_snapshot(
    own_redis: Callable[..., RedisServer], fence: RedisFence
) -> None:
    server = own_redis("--appendonly", "no", "--save", "")
    with pytest.warns(RedisConfigWarning, match="appendonly 'no'"):
        store = open_store(server.url)
    client = redis.Redis.from_url(server.url)
    try:
        before = Ledger(store, fence, "before-restart")
        before.claim_and_release(rounds=1)
        client.save()  # the snapshot the restart will load
        before.claim_and_release()
        server.kill()  # no snapshot on the way down
        server.start()
        assert_lost_then_above(store, before, fence)
    finally:
        client.close()
        store.close()


@pytest.fixture
def lossy_postgres() -> Iterator[PostgresServer]:
    """PostgreSQL that acknowledges commits before their WAL is written.

    ``synchronous_commit=off`` (as the session's server), and a WAL writer
    that waits 10 s between writes: an immediate-mode stop loses the last
    commits.
    """
    yield from serve(lambda: PostgresServer("wal_writer_delay=10000", "full_page_writes=off"))


def test_postgres_asynchronous_commit_stopped_in_immediate_mode(
    lossy_postgres: PostgresServer, fence: RedisFence
) -> None:
    store = open_store(lossy_postgres.url)
    try:
        before = Ledger(store, fence, "before-restart")
        before.claim_and_release(rounds=1)
        assert isinstance(store, SqlStore)
        with store.engine.connect() as conn:
            conn.exec_driver_sql("CHECKPOINT")  # these claims are on disk
            # the next commits start a fresh WAL segment: they stay within one
            # WAL page, whose filling would wake the WAL writer to flush them
            conn.exec_driver_sql("SELECT pg_switch_wal()")
        before.claim_and_release(rounds=2)
        lossy_postgres.stop("immediate")
        lossy_postgres.start()
        assert_lost_then_above(store, before, fence)
    finally:
        store.close()


@pytest.fixture
def lossy_mariadb() -> Iterator[MariadbServer]:
    """MariaDB that acknowledges commits before their redo log is written.

    ``innodb_flush_log_at_trx_commit=0`` writes the log buffer only every
    ``innodb_flush_log_at_timeout`` seconds (here 30): a SIGKILL loses the
    commits since the last write.
    """
    yield from serve(
        lambda: MariadbServer(
            "--innodb-flush-log-at-trx-commit=0", "--innodb-flush-log-at-timeout=30"
        )
    )


@pytest.mark.mysql
def test_mariadb_lazy_redo_log_killed(lossy_mariadb: MariadbServer, fence: RedisFence) -> None:
    store = open_store(lossy_mariadb.url)
    try:
        before = Ledger(store, fence, "before-restart")
        before.claim_and_release(rounds=1)
        # one commit that waits for the log writes every commit before it too
        lossy_mariadb.sql(
            "SET GLOBAL innodb_flush_log_at_trx_commit = 1;"
            "CREATE TABLE leases.durable (id INT PRIMARY KEY);"
            "INSERT INTO leases.durable VALUES (1);"
            "SET GLOBAL innodb_flush_log_at_trx_commit = 0;"
        )
        before.claim_and_release()
        lossy_mariadb.kill()
        lossy_mariadb.start()
        assert_lost_then_above(store, before, fence)
    finally:
        store.close()
