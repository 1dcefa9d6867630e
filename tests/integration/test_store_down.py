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
    assert again.generation == max(released.generation + 1, again.store_now_ms)


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
    from celery_leases.stores.sql import _store as sql

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


# --- permanent refusals are not outages ----------------------------------------
#
# Wrong credentials, missing rights or a missing database do not go away by
# trying again: they are LeaseConfigurationError at once, with a message that
# says what to check and never holds the password.

SECRET = "s3cret-Pa55word"
WRONG = "wr0ng-Pa55word"


def assert_all_misconfigured(store: LeaseStore, *secrets: str, table_only: bool = False) -> None:
    for name, call in every_operation(store, JOB, A, 12345, TTL).items():
        if table_only and name == "now_ms":
            continue  # reads the clock, not the table
        with pytest.raises(LeaseConfigurationError) as info:
            call()
        assert not isinstance(info.value, StoreUnavailable), name
        assert info.value.__cause__ is not None, name
        for secret in secrets:
            assert secret not in str(info.value), f"{name}: the message shows a password"


@pytest.fixture
def redis_with_password() -> Iterator[RedisServer]:
    """A redis-server that requires a password (and knows an ACL user)."""
    yield from serve(lambda: RedisServer("--requirepass", SECRET))


@pytest.mark.redis
@pytest.mark.parametrize("credentials", ["", f":{WRONG}@"], ids=["no password", "wrong"])
def test_redis_refusing_the_credentials_is_a_configuration_error(
    redis_with_password: RedisServer, unique: str, credentials: str
) -> None:
    url = f"redis://{credentials}127.0.0.1:{redis_with_password.port}/0"
    with open_store(url, prefix=f"auth{unique}:") as store:
        assert_all_misconfigured(store, WRONG, SECRET)
    with (
        open_store(url, prefix=f"auth{unique}:") as store,
        pytest.raises(LeaseConfigurationError, match="password in the store URL"),
    ):
        store.claim(JOB, A, TTL)


@pytest.mark.redis
def test_redis_user_without_the_rights_is_a_configuration_error(
    redis_with_password: RedisServer, unique: str
) -> None:
    port = redis_with_password.port
    with open_store(f"redis://:{SECRET}@127.0.0.1:{port}/0", prefix=f"acl{unique}:") as admin:
        admin._client.execute_command(  # type: ignore[attr-defined]
            "ACL", "SETUSER", "reader", "on", f">{WRONG}", "~*", "+@read", "+ping"
        )
        held = admin.claim(JOB, A, TTL)
        assert isinstance(held, Acquired)
    url = f"redis://reader:{WRONG}@127.0.0.1:{port}/0"
    with open_store(url, prefix=f"acl{unique}:") as store:
        with pytest.raises(LeaseConfigurationError, match="NoPermissionError") as info:
            store.claim(JOB, B, TTL)
        assert WRONG not in str(info.value)
    with open_store(f"redis://:{SECRET}@127.0.0.1:{port}/0", prefix=f"acl{unique}:") as admin:
        # the job was left as it was
        assert isinstance(admin.renew(JOB, A, held.generation, TTL), Renewed)


@pytest.mark.redis
def test_redis_with_the_right_password_works(redis_with_password: RedisServer) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{redis_with_password.port}/0"
    with open_store(url) as store:
        assert isinstance(store.claim(JOB, A, TTL), Acquired)
        assert SECRET not in store.url


@pytest.mark.postgres
def test_postgres_role_without_rights_is_a_configuration_error(
    own_postgres: PostgresServer, unique: str
) -> None:
    table = f"leases_{unique}"
    with open_store(own_postgres.url, table_name=table) as admin:
        assert isinstance(admin.claim(JOB, A, TTL), Acquired)
        with admin.engine.begin() as conn:  # type: ignore[attr-defined]
            conn.exec_driver_sql(f"CREATE ROLE lowly_{unique} LOGIN")
    url = own_postgres.url.replace("postgres@", f"lowly_{unique}@", 1)
    with open_store(url, table_name=table, create_table=False) as store:
        assert_all_misconfigured(store, table_only=True)
        with pytest.raises(LeaseConfigurationError, match="permission denied"):
            store.claim(JOB, B, TTL)


@pytest.mark.postgres
@pytest.mark.parametrize("what", ["database", "role"])
def test_postgres_missing_database_or_role_is_a_configuration_error(
    own_postgres: PostgresServer, what: str
) -> None:
    url = own_postgres.url
    url = (
        url.rsplit("/", 1)[0] + "/no_such_db"
        if what == "database"
        else url.replace("postgres@", "no_such_role@", 1)
    )
    with pytest.raises(LeaseConfigurationError, match="does not exist"):
        open_store(url)
    with open_store(url, create_table=False) as store:
        assert_all_misconfigured(store)


@pytest.mark.postgres
def test_postgres_wrong_password_is_a_configuration_error(own_postgres: PostgresServer) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(own_postgres.url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER ROLE postgres PASSWORD '{SECRET}'")
    engine.dispose()
    hba = own_postgres.data / "pg_hba.conf"
    hba.write_text(
        "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n", encoding="utf-8"
    )
    own_postgres.restart()
    wrong = own_postgres.url.replace("postgres@", f"postgres:{WRONG}@", 1)
    with pytest.raises(LeaseConfigurationError, match="password authentication failed") as info:
        open_store(wrong)
    assert WRONG not in str(info.value)
    right = own_postgres.url.replace("postgres@", f"postgres:{SECRET}@", 1)
    with open_store(right) as store:
        assert isinstance(store.claim(JOB, A, TTL), Acquired)
        assert SECRET not in str(store.url)
