"""When the store cannot be asked, every operation raises StoreUnavailable.

Redis and PostgreSQL run as dedicated servers here (not the session ones),
so a test can stop them and start them again on the same data. While the
server is down no operation may answer, least of all with :class:`Acquired`;
once it is back the same store handle works again (it reconnects by itself)
and the generations carry on from the kept records.

SQLite has no server to stop. What is decided for it:

- a database path whose directory does not exist when the store is opened is
  a configuration mistake: :class:`LeaseConfigurationError`, naming the path;
- a database that exists but cannot be written (another process holds the
  write lock past the busy timeout) is a store that is unavailable for now:
  :class:`StoreUnavailable`, and the store works again once the lock is gone.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_leases import (
    Acquired,
    AlreadyCompleted,
    Completed,
    LeaseConfigurationError,
    LeaseError,
    LeaseStore,
    Released,
    Renewed,
    StoreUnavailable,
    open_store,
)
from tests.conftest import serve
from tests.operations import every_operation
from tests.servers import PostgresServer, RedisServer

JOB = "job-down"
OTHER = "job-released"
A = "worker-a"
B = "worker-b"
#: long enough that no lease in these tests runs out during a restart
TTL = 120.0


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server for this test alone, free to be stopped."""
    yield from serve(RedisServer)


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster for this test alone, free to be stopped."""
    yield from serve(PostgresServer)


def assert_all_unavailable(store: LeaseStore, generation: int) -> None:
    for name, call in every_operation(store, JOB, A, generation, TTL).items():
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert isinstance(info.value, LeaseError)
        assert info.value.__cause__ is not None, f"{name}: the driver error is not chained"
        if name in ("claim", "renew", "complete", "release"):
            assert info.value.job_id == JOB, name


def prepare(store: LeaseStore) -> tuple[Acquired, Acquired]:
    """A held lease on JOB and a released one on OTHER, before the outage."""
    held = store.claim(JOB, A, TTL)
    assert isinstance(held, Acquired)
    released = store.claim(OTHER, A, TTL)
    assert isinstance(released, Acquired)
    assert store.release(OTHER, A, released.generation) == Released(OTHER, released.generation)
    return held, released


def assert_works_again(store: LeaseStore, held: Acquired, released: Acquired) -> None:
    """The first operations after the outage succeed on the kept records."""
    renewed = store.renew(JOB, A, held.generation, TTL)
    assert isinstance(renewed, Renewed), renewed
    assert store.complete(JOB, A, held.generation) == Completed(JOB, held.generation)
    assert store.claim(JOB, B, TTL) == AlreadyCompleted(JOB, held.generation)
    again = store.claim(OTHER, B, TTL)
    assert isinstance(again, Acquired), again
    assert again.generation == released.generation + 1


# --- Redis -----------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_redis_down_raises_store_unavailable_then_recovers(
    own_redis: RedisServer, unique: str, how: str
) -> None:
    with open_store(own_redis.url, prefix=f"down{unique}:") as store:
        held, released = prepare(store)
        if how == "stop":
            own_redis.stop()
        else:
            # SIGKILL: with appendfsync always, acknowledged writes survive
            own_redis.kill()
        assert_all_unavailable(store, held.generation)
        own_redis.start()
        assert_works_again(store, held, released)


# --- PostgreSQL ------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_down_raises_store_unavailable_then_recovers(
    own_postgres: PostgresServer, unique: str
) -> None:
    with open_store(own_postgres.url, table_name=f"leases_{unique}") as store:
        held, released = prepare(store)
        own_postgres.stop()
        assert_all_unavailable(store, held.generation)
        own_postgres.start()
        assert_works_again(store, held, released)


# --- SQLite ----------------------------------------------------------------


def test_sqlite_path_in_a_missing_directory_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "no-such-dir" / "leases.db"
    with pytest.raises(LeaseConfigurationError) as info:
        open_store(f"sqlite:///{path}")
    assert str(path.parent) in str(info.value)
    assert not path.parent.exists()


def test_sqlite_locked_past_the_busy_timeout_is_unavailable_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_leases.stores import sql

    # wait half a second for the write lock instead of ten
    monkeypatch.setattr(sql, "SQLITE_BUSY_TIMEOUT", 0.5)
    path = tmp_path / "leases.db"
    with open_store(f"sqlite:///{path}") as store:
        held, released = prepare(store)
        # another process's long write transaction holds the write lock
        blocker = sqlite3.connect(path, isolation_level=None, timeout=5)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            writes = ("claim", "claim of a new job", "renew", "renew_many", "complete", "release")
            operations = every_operation(store, JOB, A, held.generation, TTL)
            for name in writes:
                with pytest.raises(StoreUnavailable) as info:
                    operations[name]()
                assert info.value.__cause__ is not None, name
            # readers are not blocked by a writer in WAL mode
            record = store.get(JOB)
            assert record is not None
            assert record.generation == held.generation
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert_works_again(store, held, released)
