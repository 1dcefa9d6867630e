"""What is particular to the SQL store, on real PostgreSQL and SQLite.

The shared behaviour of every store is in ``test_conformance.py``; here are
the table, the database clock, SQLite under many processes, PostgreSQL
restarted or stopped, the one-statement batched renew and the fencing
clause. PostgreSQL comes from the session server (or a private one for the
tests that stop it); SQLite databases are files under ``tmp_path``.
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from celery_leases import (
    Acquired,
    AlreadyCompleted,
    Completed,
    HeldElsewhere,
    LeaseConfigurationError,
    LeaseState,
    Refusal,
    RefusalReason,
    Released,
    Renewed,
    RenewRequest,
    StoreUnavailable,
    open_store,
)
from celery_leases.stores import sql
from celery_leases.stores.sql import SqlStore, _sqlite, create_table, lease_table
from celery_leases.stores.sql import _records as sql_records
from celery_leases.stores.sql._engine import PING_AFTER_IDLE
from tests.operations import at_once, every_operation
from tests.proxy import Proxy
from tests.servers import MariadbServer, PostgresServer

A = "worker-a"
B = "worker-b"

EXPECTED_COLUMNS = {
    # name: (nullable, is an integer type)
    "job_id": (False, False),
    "owner": (False, False),
    "generation": (False, True),
    "lease_until": (False, True),
    "state": (False, False),
    "task_name": (False, False),
    "claimed_at": (True, True),
    "renewed_at": (True, True),
    "completed_at": (True, True),
    "renew_count": (False, True),
    "takeovers": (False, True),
    "send_id": (False, False),
    "outcome": (True, False),
    "released_at": (True, True),
    "released_by": (False, False),
    "release_reason": (False, False),
    "task_id": (False, False),
}


# --- fixtures -----------------------------------------------------------------


@pytest.fixture
def table_name(unique: str) -> str:
    return f"leases_{unique}"


@pytest.fixture
def sql_store(sql_url: str, table_name: str) -> Iterator[SqlStore]:
    store = SqlStore.from_url(sql_url, table_name=table_name)
    yield store
    store.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'leases.db'}"


@pytest.fixture(scope="module", params=["postgres", pytest.param("mysql", marks=pytest.mark.mysql)])
def own_server(request: pytest.FixtureRequest) -> Iterator[PostgresServer | MariadbServer]:
    """A PostgreSQL or MariaDB of this module's own, for tests that stop or restart it."""
    from tests.conftest import serve

    make: type[PostgresServer] | type[MariadbServer]
    make = PostgresServer if request.param == "postgres" else MariadbServer
    yield from serve(make)


@pytest.fixture
def own_store(own_server: PostgresServer | MariadbServer, table_name: str) -> Iterator[SqlStore]:
    store = SqlStore.from_url(own_server.url, table_name=table_name)
    yield store
    # a test may have left the server stopped
    if not _port_open(own_server.port):
        own_server.start()
    store.close()


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _acquire(store: SqlStore, job_id: str, owner: str = A, ttl: float = 30) -> Acquired:
    result = store.claim(job_id, owner, ttl)
    assert isinstance(result, Acquired), result
    return result


def _database_now_ms(store: SqlStore) -> int:
    """The database's clock read with plain SQL, independently of the store."""
    if store.dialect_name == "postgresql":
        query = "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"
    elif store.dialect_name == "mysql":
        query = "SELECT CAST(UNIX_TIMESTAMP(NOW(6)) * 1000 AS SIGNED)"
    else:
        query = "SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
    with store.engine.connect() as conn:
        return int(conn.exec_driver_sql(query).scalar_one())


def _backdate_completion(store: SqlStore, job_id: str, seconds: float) -> None:
    t = store.table
    with store.engine.begin() as conn:
        conn.execute(
            t.update()
            .where(t.c.job_id == job_id)
            .values(completed_at=t.c.completed_at - round(seconds * 1000))
        )


def _statements(store: SqlStore, *, mysql: int, other: int) -> int:
    """How many statements an operation sends: MySQL decides a claim that
    finds a record, and a renewal, under the records' locks (a SELECT ...
    FOR UPDATE before the write)."""
    return mysql if store.dialect_name == "mysql" else other


class StatementLog:
    """Counts the SQL statements an engine sends (transaction control aside)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.statements: list[str] = []

    def _record(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.strip().upper().split(" ")[0] not in ("BEGIN", "COMMIT", "ROLLBACK"):
            self.statements.append(statement)

    def __enter__(self) -> StatementLog:
        event.listen(self.engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc_info: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._record)


# --- the table ----------------------------------------------------------------


def test_store_creates_the_table_with_its_columns(sql_store: SqlStore, table_name: str) -> None:
    inspector = sa.inspect(sql_store.engine)
    columns = {c["name"]: c for c in inspector.get_columns(table_name)}
    assert set(columns) == set(EXPECTED_COLUMNS)
    for name, (nullable, integer) in EXPECTED_COLUMNS.items():
        assert columns[name]["nullable"] is nullable, name
        assert isinstance(columns[name]["type"], sa.Integer) is integer, name
    assert inspector.get_pk_constraint(table_name)["constrained_columns"] == ["job_id"]
    # its index: tests/integration/test_sql_index.py


def test_table_creation_is_idempotent(sql_url: str, table_name: str) -> None:
    first = SqlStore.from_url(sql_url, table_name=table_name)
    _acquire(first, "kept")
    second = SqlStore.from_url(sql_url, table_name=table_name)
    create_table(second.engine, table_name)
    try:
        record = second.get("kept")
        assert record is not None
        assert record.owner == A
    finally:
        first.close()
        second.close()


def test_create_table_function_makes_a_usable_table(sql_url: str, table_name: str) -> None:
    engine = sa.create_engine(sql_url)
    try:
        table = create_table(engine, table_name)
        assert table.name == table_name
        assert sa.inspect(engine).has_table(table_name)
        assert sa.inspect(engine).has_table(f"{table_name}_queued")  # lease_queue_unique's
        store = SqlStore(engine, table_name=table_name, create_table=False)
        assert isinstance(store.claim("job", A, 10), Acquired)
        assert store.mark_queued("queued-job", "task-1", 10).task_id == "task-1"
        store.close()
        # the store did not create the engine, so it left it usable
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 1
    finally:
        engine.dispose()


def test_a_store_never_makes_the_queued_marks_table_a_send_needs(
    sql_url: str, table_name: str
) -> None:
    # the lease table alone (made by hand, or before lease_queue_unique was used)
    engine = sa.create_engine(sql_url)
    try:
        lease_table(sa.MetaData(), table_name).create(engine)
        store = SqlStore(engine, table_name=table_name, create_table=False)
        assert store.queued("job") is None
        with pytest.raises(LeaseConfigurationError, match=f"{table_name}_queued.*init-db"):
            store.mark_queued("job", "task-1", 10)
        assert not sa.inspect(engine).has_table(f"{table_name}_queued")
        store.close()
        create_table(engine, table_name)  # makes the missing one beside it
        assert sa.inspect(engine).has_table(f"{table_name}_queued")
    finally:
        engine.dispose()


def test_custom_table_name_keeps_records_apart(sql_url: str, unique: str) -> None:
    one = SqlStore.from_url(sql_url, table_name=f"one_{unique}")
    two = SqlStore.from_url(sql_url, table_name=f"two_{unique}")
    try:
        _acquire(one, "job")
        assert two.get("job") is None
        assert isinstance(two.claim("job", B, 10), Acquired)
        assert one.table.name == f"one_{unique}"
    finally:
        one.close()
        two.close()


def test_without_create_table_a_missing_table_is_a_configuration_error(
    sql_url: str, table_name: str
) -> None:
    # a missing table does not appear by trying again: it is not an outage
    store = SqlStore.from_url(sql_url, table_name=table_name, create_table=False)
    try:
        assert not sa.inspect(store.engine).has_table(table_name)
        with pytest.raises(LeaseConfigurationError, match=table_name) as info:
            store.claim("job", A, 10)
        assert isinstance(info.value.__cause__, sa.exc.DBAPIError)
        assert info.value.job_id == "job"
    finally:
        store.close()


def test_concurrent_table_creation_does_not_fail(sql_url: str, table_name: str) -> None:
    engine = sa.create_engine(sql_url, pool_size=8)
    try:
        outcomes = at_once(8, lambda _: create_table(engine, table_name))
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert errors == []
        assert sa.inspect(engine).has_table(table_name)
    finally:
        engine.dispose()


@pytest.mark.parametrize("name", ["", "1leases", "leases; DROP TABLE x", "a" * 41, None])
def test_bad_table_name_is_a_configuration_error(name: Any) -> None:
    with pytest.raises(LeaseConfigurationError, match="table_name"):
        lease_table(sa.MetaData(), name)


def test_lease_table_defines_the_table_without_touching_a_database() -> None:
    metadata = sa.MetaData()
    table = lease_table(metadata, "my_leases")
    assert metadata.tables["my_leases"] is table
    assert set(table.c.keys()) == set(EXPECTED_COLUMNS)


# --- URLs, drivers, configuration --------------------------------------------


def test_open_store_opens_a_sql_store_for_both_databases(sql_url: str, table_name: str) -> None:
    store = open_store(sql_url, table_name=table_name)
    try:
        assert isinstance(store, SqlStore)
        assert store.table.name == table_name
    finally:
        store.close()


def test_postgresql_url_without_driver_means_psycopg(
    postgres_server: PostgresServer, table_name: str
) -> None:
    url = postgres_server.url.replace("postgresql+psycopg://", "postgresql://")
    store = open_store(url, table_name=table_name)
    try:
        assert isinstance(store, SqlStore)
        assert store.engine.url.drivername == "postgresql+psycopg"
        assert store.dialect_name == "postgresql"
        assert not store.engine.pool._pre_ping  # pinged after an idle spell instead
        assert isinstance(store.claim("job", A, 10), Acquired)
    finally:
        store.close()


def test_url_hides_the_password(postgres_server: PostgresServer, table_name: str) -> None:
    # the throwaway server trusts every local connection, so any password works
    url = postgres_server.url.replace("postgres@", "postgres:hunter2@")
    store = SqlStore.from_url(url, table_name=table_name)
    try:
        assert "hunter2" not in store.url
        assert "***" in store.url
        assert "hunter2" not in repr(store)
    finally:
        store.close()


def test_in_memory_sqlite_is_refused() -> None:
    for url in ("sqlite://", "sqlite:///:memory:"):
        with pytest.raises(LeaseConfigurationError, match="in-memory"):
            SqlStore.from_url(url)


def test_sqlite_older_than_3_35_is_refused() -> None:
    with pytest.raises(LeaseConfigurationError, match=r"3\.35\.0 or newer.*3\.34\.1"):
        _sqlite.check_sqlite_version((3, 34, 1))
    _sqlite.check_sqlite_version(sqlite3.sqlite_version_info)  # this machine's is fine


def test_unparsable_url_is_a_configuration_error() -> None:
    with pytest.raises(LeaseConfigurationError, match="cannot parse"):
        SqlStore.from_url("postgresql://host:notaport/db")


def test_close_disposes_only_an_engine_the_store_created(sqlite_url: str) -> None:
    owned = SqlStore.from_url(sqlite_url)
    owned.now_ms()
    assert owned.engine.pool.checkedin() == 1  # type: ignore[attr-defined]
    owned.close()
    assert owned.engine.pool.checkedin() == 0  # type: ignore[attr-defined]

    engine = sa.create_engine(sqlite_url)
    try:
        borrowed = SqlStore(engine)
        borrowed.now_ms()
        borrowed.close()
        assert engine.pool.checkedin() == 1  # type: ignore[attr-defined]
    finally:
        engine.dispose()


def test_forked_child_does_not_reuse_the_parents_connections(sql_store: SqlStore) -> None:
    _acquire(sql_store, "parent")
    assert sql_store.engine.pool.checkedin() == 1  # type: ignore[attr-defined]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            fresh_pool = sql_store.engine.pool.checkedin() == 0  # type: ignore[attr-defined]
            works = isinstance(sql_store.claim("child", B, 10), Acquired)
            code = 0 if fresh_pool and works else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 1) == bytes([0])
    os.close(read)
    assert status == 0
    # the parent's pooled connection still works
    assert isinstance(sql_store.claim("parent-again", A, 10), Acquired)
    assert sql_store.get("child") is not None


# --- the clock is the database's ---------------------------------------------


def test_postgres_clock_moves_within_a_transaction(postgres_server: PostgresServer) -> None:
    # now() would stand still for the whole transaction; the store's clock must not
    engine = sa.create_engine(postgres_server.url)
    try:
        with engine.begin() as conn:
            first = conn.exec_driver_sql(f"SELECT {sql.POSTGRES_NOW_MS}").scalar_one()
            start_of_transaction = conn.exec_driver_sql("SELECT now()").scalar_one()
            conn.exec_driver_sql("SELECT pg_sleep(0.2)")
            second = conn.exec_driver_sql(f"SELECT {sql.POSTGRES_NOW_MS}").scalar_one()
            assert conn.exec_driver_sql("SELECT now()").scalar_one() == start_of_transaction
        assert 150 <= second - first < 5_000
    finally:
        engine.dispose()


def test_store_clock_matches_the_database_clock(sql_store: SqlStore) -> None:
    before = _database_now_ms(sql_store)
    now = sql_store.now_ms()
    after = _database_now_ms(sql_store)
    assert isinstance(now, int)
    # the independent reading truncates; the store's may round up by 1 ms
    assert before - 1 <= now <= after + 1


def test_claim_times_come_from_the_database_in_one_reading(sql_store: SqlStore) -> None:
    before = _database_now_ms(sql_store)
    acquired = _acquire(sql_store, "job", ttl=12.345)
    after = _database_now_ms(sql_store)
    assert before - 1 <= acquired.store_now_ms <= after + 1
    assert acquired.lease_until_ms - acquired.store_now_ms == 12_345
    assert acquired.generation == acquired.store_now_ms  # a new record: generation = now
    record = sql_store.get("job")
    assert record is not None
    assert record.claimed_at_ms == acquired.store_now_ms


def test_renew_times_come_from_the_database_in_one_reading(sql_store: SqlStore) -> None:
    acquired = _acquire(sql_store, "job")
    before = _database_now_ms(sql_store)
    renewed = sql_store.renew("job", A, acquired.generation, 7.5)
    (batched,) = sql_store.renew_many([RenewRequest("job", A, acquired.generation, 2.25)])
    after = _database_now_ms(sql_store)
    assert isinstance(renewed, Renewed)
    assert isinstance(batched, Renewed)
    assert renewed.lease_until_ms - renewed.store_now_ms == 7_500
    assert batched.lease_until_ms - batched.store_now_ms == 2_250
    assert before - 1 <= renewed.store_now_ms <= batched.store_now_ms <= after + 1


def test_release_and_complete_stamp_the_database_clock(sql_store: SqlStore) -> None:
    first = _acquire(sql_store, "released")
    second = _acquire(sql_store, "completed")
    before = _database_now_ms(sql_store)
    assert isinstance(sql_store.release("released", A, first.generation), Released)
    assert isinstance(sql_store.complete("completed", A, second.generation), Completed)
    after = _database_now_ms(sql_store)
    released = sql_store.get("released")
    completed = sql_store.get("completed")
    assert released is not None
    assert completed is not None
    assert completed.completed_at_ms is not None
    assert released.owner == ""
    assert before - 1 <= released.lease_until_ms <= after + 1
    assert before - 1 <= completed.completed_at_ms <= after + 1


# --- SQLite connection settings and many processes ----------------------------


def test_sqlite_connections_use_wal_and_a_busy_timeout(sqlite_url: str) -> None:
    store = SqlStore.from_url(sqlite_url)
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 10_000
    finally:
        store.close()


def test_sqlite_write_transactions_take_the_write_lock_at_begin(
    sqlite_url: str, tmp_path: Path
) -> None:
    store = SqlStore.from_url(sqlite_url)
    other = sqlite3.connect(tmp_path / "leases.db", timeout=0, isolation_level=None)
    try:
        # nothing is written in the transaction, but the write lock is already ours
        with store.engine.begin(), pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()
        store.close()


def test_sqlite_reads_do_not_wait_for_a_writer(sqlite_url: str, tmp_path: Path) -> None:
    store = SqlStore.from_url(sqlite_url)
    _acquire(store, "job")
    other = sqlite3.connect(tmp_path / "leases.db", timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        assert store.get("job") is not None
        assert list(store.records())
        assert store.now_ms() > 0
        assert time.monotonic() - started < 2  # far below the 10 s busy timeout
        other.execute("ROLLBACK")
    finally:
        other.close()
        store.close()


def test_two_stores_on_one_sqlite_engine_install_the_hooks_once(sqlite_url: str) -> None:
    engine = sa.create_engine(sqlite_url)
    try:
        first = SqlStore(engine, table_name="one")
        second = SqlStore(engine, table_name="two")
        # a doubled hook would fail with "cannot start a transaction within a transaction"
        assert isinstance(first.claim("job", A, 10), Acquired)
        assert isinstance(second.claim("job", A, 10), Acquired)
    finally:
        engine.dispose()


PROCESSES = 8
ITERATIONS = 40
HAMMERED_JOBS = ("job-0", "job-1", "job-2")


def _hammer(args: tuple[str, str, int, float]) -> dict[str, Any]:
    """One process of the SQLite race: claim, renew, release or complete."""
    url, owner, seed, start_at = args
    acquired: list[tuple[str, int]] = []
    completed: list[str] = []
    errors: list[str] = []
    store = SqlStore.from_url(url)
    try:
        time.sleep(max(0.0, start_at - time.time()))
        for i in range(ITERATIONS):
            job_id = HAMMERED_JOBS[(i + seed) % len(HAMMERED_JOBS)]
            try:
                result = store.claim(job_id, owner, 5)
                if isinstance(result, Acquired):
                    acquired.append((job_id, result.generation))
                    renewed = store.renew_many([RenewRequest(job_id, owner, result.generation, 5)])
                    assert isinstance(renewed[0], Renewed), renewed
                    assert isinstance(store.renew(job_id, owner, result.generation, 5), Renewed)
                    assert isinstance(store.release(job_id, owner, result.generation), Released)
                last = store.claim("final", owner, 5)
                if isinstance(last, Acquired):
                    acquired.append(("final", last.generation))
                    if isinstance(store.complete("final", owner, last.generation), Completed):
                        completed.append("final")
            except Exception as exc:  # report every failure to the parent
                errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        store.close()
    return {"acquired": acquired, "completed": completed, "errors": errors}


@pytest.mark.slow
def test_sqlite_under_many_processes_never_locks_or_repeats_a_generation(
    sqlite_url: str,
) -> None:
    SqlStore.from_url(sqlite_url).close()  # the table exists before the race
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 4  # every process has imported and connected by then
    args = [(sqlite_url, f"owner-{n}", n, start_at) for n in range(PROCESSES)]
    with context.Pool(PROCESSES) as pool:
        outcomes = pool.map(_hammer, args, chunksize=1)
    errors = [e for o in outcomes for e in o["errors"]]
    assert errors == []
    acquired = [pair for o in outcomes for pair in o["acquired"]]
    repeated = [pair for pair, count in Counter(acquired).items() if count > 1]
    assert repeated == []
    # every job's generations went up with each claim
    for job_id in HAMMERED_JOBS:
        generations = [g for j, g in acquired if j == job_id]
        assert len(set(generations)) == len(generations)
    assert sum(len(o["completed"]) for o in outcomes) == 1
    assert len(acquired) > PROCESSES  # the race really happened


# --- PostgreSQL races, restarts and outages ------------------------------------


def test_postgres_concurrent_claims_have_one_winner(
    postgres_server: PostgresServer, table_name: str
) -> None:
    store = SqlStore.from_url(postgres_server.url, table_name=table_name, pool_size=16)
    try:
        for round_ in range(3):
            results = at_once(16, lambda n: store.claim("job", f"w{n}", 30))
            winners = [r for r in results if isinstance(r, Acquired)]
            assert len(winners) == 1, results
            assert all(isinstance(r, (Acquired, HeldElsewhere)) for r in results), results
            losers = [r for r in results if isinstance(r, HeldElsewhere)]
            assert {r.generation for r in losers} == {winners[0].generation}
            assert sql_store_release(store, winners[0]), round_
    finally:
        store.close()


def sql_store_release(store: SqlStore, acquired: Acquired) -> bool:
    return isinstance(store.release(acquired.job_id, acquired.owner, acquired.generation), Released)


def test_restart_keeps_generations_going_up(
    own_server: PostgresServer | MariadbServer, own_store: SqlStore
) -> None:
    store = own_store
    first = _acquire(store, "job")
    assert isinstance(store.release("job", A, first.generation), Released)
    own_server.restart()
    time.sleep(PING_AFTER_IDLE)  # past a restart this long, pooled connections are pinged
    # the same store object reconnects (the ping) and the record survived
    second = _acquire(store, "job", owner=B)
    assert second.generation == max(first.generation + 1, second.store_now_ms)
    assert isinstance(store.complete("job", B, second.generation), Completed)
    _backdate_completion(store, "job", seconds=120)
    assert store.purge(60) == 1
    assert store.get("job") is None
    own_server.restart()
    time.sleep(PING_AFTER_IDLE)
    third = _acquire(store, "job")
    assert third.generation > second.generation


def test_a_stopped_database_makes_every_operation_store_unavailable(
    own_server: PostgresServer | MariadbServer, own_store: SqlStore
) -> None:
    store = own_store
    held = _acquire(store, "held")
    own_server.stop()
    calls = every_operation(store, "held", A, held.generation, 10)
    for name, call in calls.items():
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert isinstance(info.value.__cause__, sa.exc.DBAPIError), name
        assert store.url in str(info.value), name
    own_server.start()
    # nothing happened while it was down: the lease is still A's, "held-new" unknown
    assert store.get("held-new") is None
    assert isinstance(store.renew("held", A, held.generation, 10), Renewed)


def test_store_unavailable_names_job_owner_and_generation(
    own_server: PostgresServer | MariadbServer, own_store: SqlStore
) -> None:
    store = own_store
    held = _acquire(store, "held")
    own_server.stop()
    with pytest.raises(StoreUnavailable, match="during complete of job 'held'") as info:
        store.complete("held", A, held.generation)
    assert (info.value.job_id, info.value.owner, info.value.generation) == (
        "held",
        A,
        held.generation,
    )


# --- renew_many ---------------------------------------------------------------


def test_renew_many_mixes_renewals_and_refusals_in_request_order(sql_store: SqlStore) -> None:
    live = _acquire(sql_store, "live")
    superseded = _acquire(sql_store, "superseded")
    done = _acquire(sql_store, "done")
    gone = _acquire(sql_store, "gone")
    other = _acquire(sql_store, "other")
    assert isinstance(sql_store.complete("done", A, done.generation), Completed)
    assert isinstance(sql_store.release("gone", A, gone.generation), Released)
    requests = [
        RenewRequest("missing", A, 5, 10),
        RenewRequest("live", A, live.generation, 10),
        RenewRequest("superseded", B, superseded.generation, 10),
        RenewRequest("done", A, done.generation, 10),
        RenewRequest("gone", A, gone.generation, 10),
        RenewRequest("superseded", A, superseded.generation - 1, 10),
        RenewRequest("other", A, other.generation, 20),
    ]
    results = sql_store.renew_many(requests)
    assert [type(r) for r in results] == [
        Refusal,
        Renewed,
        Refusal,
        Refusal,
        Refusal,
        Refusal,
        Renewed,
    ]
    reasons = [r.reason for r in results if isinstance(r, Refusal)]
    assert reasons == [
        RefusalReason.MISSING,
        RefusalReason.SUPERSEDED,
        RefusalReason.COMPLETED,
        RefusalReason.RELEASED,
        RefusalReason.SUPERSEDED,
    ]
    assert [r.job_id for r in results] == [r.job_id for r in requests]
    superseded_refusal = results[2]
    assert isinstance(superseded_refusal, Refusal)
    assert superseded_refusal.current_owner == A
    assert superseded_refusal.current_generation == superseded.generation
    renewed = results[6]
    assert isinstance(renewed, Renewed)
    assert renewed.lease_until_ms - renewed.store_now_ms == 20_000
    record = sql_store.get("other")
    assert record is not None
    assert record.renew_count == 1
    assert record.lease_until_ms == renewed.lease_until_ms
    assert record.renewed_at_ms == renewed.store_now_ms


def test_renew_many_is_one_statement_when_nothing_is_refused(sql_store: SqlStore) -> None:
    leases = [_acquire(sql_store, f"job-{n}") for n in range(50)]
    requests = [RenewRequest(a.job_id, A, a.generation, 10) for a in leases]
    with StatementLog(sql_store.engine) as log:
        results = sql_store.renew_many(requests)
    assert all(isinstance(r, Renewed) for r in results)
    assert len(log.statements) == _statements(sql_store, mysql=2, other=1)
    assert log.statements[-1].lstrip().upper().startswith(("UPDATE", "WITH"))


def test_renew_many_adds_one_select_when_something_is_refused(sql_store: SqlStore) -> None:
    leases = [_acquire(sql_store, f"job-{n}") for n in range(20)]
    requests = [RenewRequest(a.job_id, A, a.generation, 10) for a in leases]
    requests += [RenewRequest(a.job_id, B, a.generation, 10) for a in leases[:5]]
    with StatementLog(sql_store.engine) as log:
        results = sql_store.renew_many(requests)
    assert sum(isinstance(r, Refusal) for r in results) == 5
    assert len(log.statements) == 2
    # MySQL judges the refusals by the records its first SELECT locked
    first, second = ("SELECT", "UPDATE") if sql_store.dialect_name == "mysql" else ("", "SELECT")
    assert log.statements[0].lstrip().upper().startswith(first)
    assert log.statements[1].lstrip().upper().startswith(second)


def test_single_operations_are_one_statement_when_they_succeed(sql_store: SqlStore) -> None:
    with StatementLog(sql_store.engine) as log:
        acquired = _acquire(sql_store, "job")
        sql_store.renew("job", A, acquired.generation, 10)
        sql_store.complete("job", A, acquired.generation)
    assert len(log.statements) == _statements(sql_store, mysql=4, other=3)


class CompiledLog:
    """The statement objects an engine runs, and whether the compiled cache had them."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.runs: list[tuple[Any, bool]] = []

    def _record(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        context = args[1]
        if context.compiled is not None:  # not BEGIN IMMEDIATE and the like
            hit = context.cache_hit is context.dialect.CACHE_HIT
            self.runs.append((context.invoked_statement, hit))

    def __enter__(self) -> CompiledLog:
        event.listen(self.engine, "after_cursor_execute", self._record)
        return self

    def __exit__(self, *exc_info: object) -> None:
        event.remove(self.engine, "after_cursor_execute", self._record)


def _every_operation(store: SqlStore, job_id: str) -> None:
    """Claim, a refused claim, renew, renew_many, release, complete, get, now, purge."""
    acquired = _acquire(store, job_id)
    assert isinstance(store.claim(job_id, B, 10), HeldElsewhere)
    assert isinstance(store.renew(job_id, A, acquired.generation, 10), Renewed)
    requests = [RenewRequest(job_id, owner, acquired.generation, 10) for owner in (A, B)]
    assert [type(r) for r in store.renew_many(requests)] == [Renewed, Refusal]
    assert isinstance(store.release(job_id, A, acquired.generation), Released)
    again = _acquire(store, job_id)
    assert isinstance(store.complete(job_id, A, again.generation), Completed)
    assert isinstance(store.complete(job_id, B, again.generation), Refusal)
    assert store.get(job_id) is not None
    store.now_ms()
    store.purge(3600)


def test_operations_run_statements_built_once_from_the_compiled_cache(
    sql_store: SqlStore,
) -> None:
    # Building a statement costs more Python than its round trip, so each is
    # built once per store and found in the engine's compiled cache after.
    # (A listener sends every statement through Core: the warm-up listens too.)
    with CompiledLog(sql_store.engine):
        _every_operation(sql_store, "warm-up")
    with CompiledLog(sql_store.engine) as first:
        _every_operation(sql_store, "job-1")
    with CompiledLog(sql_store.engine) as second:
        _every_operation(sql_store, "job-2")
    assert len(first.runs) == len(second.runs) >= 12
    assert all(a is b for (a, _), (b, _) in zip(first.runs, second.runs, strict=True))
    missed = [statement for statement, hit in first.runs + second.runs if not hit]
    if sa.__version__.startswith("2.0."):
        # SQLAlchemy 2.0 gives no cache key to an INSERT with ON CONFLICT or
        # ON DUPLICATE KEY (2.1 does): there the claim is compiled on each call
        missed = [statement for statement in missed if not isinstance(statement, sa.Insert)]
    assert missed == []


# --- claims --------------------------------------------------------------------


def test_claim_over_a_run_out_lease_is_a_takeover_in_one_statement(sql_store: SqlStore) -> None:
    first = _acquire(sql_store, "job", ttl=0.05)
    deadline = time.monotonic() + 10
    while sql_store.now_ms() <= first.lease_until_ms + 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    with StatementLog(sql_store.engine) as log:
        second = _acquire(sql_store, "job", owner=B)
    assert len(log.statements) == _statements(sql_store, mysql=3, other=1)
    assert second.generation == max(first.generation + 1, second.store_now_ms)
    assert second.takeovers == 1
    record = sql_store.get("job")
    assert record is not None
    assert (record.owner, record.takeovers, record.renew_count) == (B, 1, 0)
    assert record.renewed_at_ms is None


def test_claim_of_held_or_completed_job_adds_one_select(sql_store: SqlStore) -> None:
    acquired = _acquire(sql_store, "job")
    with StatementLog(sql_store.engine) as log:
        held = sql_store.claim("job", B, 10)
    assert isinstance(held, HeldElsewhere)
    assert held.holder == A
    assert 25 < held.remaining <= 30
    assert len(log.statements) == 2
    sql_store.complete("job", A, acquired.generation)
    assert sql_store.claim("job", B, 10) == AlreadyCompleted("job", acquired.generation)


# --- records and purge ---------------------------------------------------------


def test_records_are_paged_in_job_id_order(
    sql_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql_records, "RECORDS_PAGE_SIZE", 3)
    leases = {f"job-{n:02}": _acquire(sql_store, f"job-{n:02}") for n in range(10)}
    for job_id in ("job-01", "job-04", "job-07"):
        sql_store.complete(job_id, A, leases[job_id].generation)
    with StatementLog(sql_store.engine) as log:
        every = [r.job_id for r in sql_store.records()]
    assert every == sorted(leases)
    assert len(log.statements) == 4  # pages of 3, 3, 3 and 1
    completed = [r.job_id for r in sql_store.records(state=LeaseState.COMPLETED)]
    assert completed == ["job-01", "job-04", "job-07"]
    assert [r.job_id for r in sql_store.records(limit=4)] == sorted(leases)[:4]


def test_purge_is_one_delete_with_the_memory_store_conditions(sql_store: SqlStore) -> None:
    old = _acquire(sql_store, "old")
    young = _acquire(sql_store, "young")
    _acquire(sql_store, "held")
    sql_store.complete("old", A, old.generation)
    sql_store.complete("young", A, young.generation)
    _backdate_completion(sql_store, "old", seconds=120)
    with StatementLog(sql_store.engine) as log:
        assert sql_store.purge(60) == 1
    # one statement on the lease table; the others find and drop run-out
    # waiters (add_waiter), a table of their own
    waiters = f"{sql_store.table.name}_waiters"
    name = sql_store.table.name
    leases = [s for s in log.statements if name in s.replace(waiters, "")]
    assert len(leases) == 1
    assert leases[0].lstrip().upper().startswith("DELETE")
    assert sql_store.get("old") is None
    assert sql_store.get("young") is not None
    assert sql_store.get("held") is not None


def test_a_claim_over_a_generation_ahead_of_the_clock_adds_one(sql_store: SqlStore) -> None:
    acquired = _acquire(sql_store, "job")
    sql_store.release("job", A, acquired.generation)
    ahead = sql_store.now_ms() + 60_000
    t = sql_store.table
    with sql_store.engine.begin() as conn:
        conn.execute(t.update().where(t.c.job_id == "job").values(generation=ahead))
    assert _acquire(sql_store, "job", owner=B).generation == ahead + 1


# --- the fencing clause -----------------------------------------------------------


def _fenced_write(store: SqlStore, job_id: str, owner: str, generation: int, value: str) -> bool:
    """Write ``value`` to a side table only if the lease is current; True if written."""
    metadata = sa.MetaData()
    effects = sa.Table(
        f"effects_{store.table.name}",
        metadata,
        sa.Column("job_id", sa.String(255), primary_key=True),
        sa.Column("value", sa.String(255), nullable=False),
    )
    metadata.create_all(store.engine)
    with store.engine.begin() as conn:
        conn.execute(
            sa.insert(effects).from_select(
                ["job_id", "value"],
                sa.select(sa.literal(job_id), sa.literal(value)).where(
                    store.lease_is_current_clause(job_id, owner, generation)
                ),
            )
        )
        written = conn.execute(
            sa.select(effects.c.value).where(effects.c.job_id == job_id, effects.c.value == value)
        ).first()
    return written is not None


def test_lease_is_current_clause_is_true_only_for_the_holder(sql_store: SqlStore) -> None:
    first = _acquire(sql_store, "job")
    assert _fenced_write(sql_store, "job", A, first.generation, "a1")
    assert not _fenced_write(sql_store, "job", B, first.generation, "b1")
    assert not _fenced_write(sql_store, "job", A, first.generation - 1, "a0")
    sql_store.release("job", A, first.generation)
    assert not _fenced_write(sql_store, "job", A, first.generation, "a2")
    second = _acquire(sql_store, "job", owner=B)
    assert not _fenced_write(sql_store, "job", A, first.generation, "a3")
    assert _fenced_write(sql_store, "other-job-is-not-held", B, second.generation, "x") is False
    sql_store.complete("job", B, second.generation)
    assert not _fenced_write(sql_store, "job", B, second.generation, "b2")


def test_lease_is_current_clause_ignores_lease_until(sql_store: SqlStore) -> None:
    acquired = _acquire(sql_store, "job", ttl=0.001)
    time.sleep(0.05)
    assert _fenced_write(sql_store, "job", A, acquired.generation, "late")


# --- MySQL and MariaDB ------------------------------------------------------------


@pytest.mark.mysql
@pytest.mark.parametrize("scheme", ["mysql", "mysql+pymysql", "mariadb", "mariadb+pymysql"])
def test_mysql_and_mariadb_urls_open_the_store_with_pymysql(
    mariadb_server: MariadbServer, scheme: str, table_name: str
) -> None:
    url = mariadb_server.url.replace("mysql+pymysql://", f"{scheme}://")
    store = open_store(url, table_name=table_name)
    try:
        assert isinstance(store, SqlStore)
        assert (store.dialect_name, store.engine.driver) == ("mysql", "pymysql")
        assert isinstance(store.claim("job", A, 10), Acquired)
    finally:
        store.close()


@pytest.mark.mysql
def test_mysql_wrong_password_is_a_configuration_error_without_the_password(
    mariadb_server: MariadbServer, table_name: str
) -> None:
    url = mariadb_server.url.replace(mariadb_server.PASSWORD, "not-the-Pa55word")
    with pytest.raises(LeaseConfigurationError) as info:
        open_store(url, table_name=table_name)
    assert "Access denied" in str(info.value)
    assert "not-the-Pa55word" not in str(info.value)


@pytest.mark.mysql
def test_mysql_job_ids_that_differ_in_case_or_trailing_space_are_apart(
    mariadb_server: MariadbServer, table_name: str
) -> None:
    # MySQL's default collations would call these equal
    store = SqlStore.from_url(mariadb_server.url, table_name=table_name)
    try:
        generations = [_acquire(store, job).generation for job in ("Job", "job", "job ", "jöb")]
        assert len(generations) == 4
        assert [r.job_id for r in store.records()] == sorted(
            ["Job", "job", "job ", "jöb"], key=str.encode
        )
    finally:
        store.close()


@pytest.mark.mysql
def test_mysql_session_limits_follow_the_store_timeout(
    mariadb_server: MariadbServer, table_name: str
) -> None:
    store = SqlStore.from_url(mariadb_server.url, table_name=table_name, timeout=2.5)
    try:
        with store.engine.connect() as conn:
            row = conn.exec_driver_sql(
                "SELECT @@innodb_lock_wait_timeout, @@lock_wait_timeout, @@max_statement_time"
            ).one()
        assert tuple(row) == (3, 3, 2.5)
    finally:
        store.close()


@pytest.mark.mysql
def test_mysql_calls_cost_their_round_trips_and_no_more(
    mariadb_server: MariadbServer, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pymysql.connections

    store = SqlStore.from_url(mariadb_server.url, table_name=table_name)
    sent: list[str] = []
    original = pymysql.connections.Connection._execute_command

    def execute_command(self: Any, command: int, sql: str | bytes) -> Any:
        text = sql.decode() if isinstance(sql, bytes) else sql
        sent.append(text.split(" ", 1)[0].upper() if text else "PING")
        return original(self, command, sql)

    try:
        warm = _acquire(store, "warm")
        monkeypatch.setattr(pymysql.connections.Connection, "_execute_command", execute_command)
        acquired = _acquire(store, "job")
        # no ROLLBACK of the pool, and no ping of a connection used just now
        assert sent == ["INSERT", "COMMIT"]
        sent.clear()
        assert isinstance(store.renew("job", A, acquired.generation, 10), Renewed)
        assert sent == ["SELECT", "UPDATE", "COMMIT"]
        sent.clear()
        assert isinstance(store.complete("warm", A, warm.generation), Completed)
        assert sent == ["UPDATE", "COMMIT"]
        sent.clear()
        assert store.get("job") is not None
        # a read ends its own transaction, so no snapshot outlives the call
        assert sent == ["SELECT", "ROLLBACK"]
        sent.clear()
        time.sleep(PING_AFTER_IDLE)  # a connection idle this long is pinged first
        assert store.get("job") is not None
        assert sent == ["PING", "SELECT", "ROLLBACK"]
    finally:
        store.close()


@pytest.mark.mysql
def test_mysql_engine_passed_in_keeps_its_waits_outside_the_stores_calls(
    mariadb_server: MariadbServer, table_name: str
) -> None:
    engine = sa.create_engine(mariadb_server.url)
    store = SqlStore(engine, table_name=table_name, timeout=1.0)
    try:
        assert isinstance(store.claim("job", A, 10), Acquired)
        with engine.connect() as conn:
            # longer than the store's limit of 1 s on each of its own waits
            assert conn.exec_driver_sql("SELECT SLEEP(2)").scalar_one() == 0
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgresql_calls_are_one_round_trip_each(
    postgres_server: PostgresServer, table_name: str
) -> None:
    proxy = Proxy("127.0.0.1", postgres_server.port)
    url = postgres_server.url.replace(f":{postgres_server.port}/", f":{proxy.port}/")
    store = SqlStore.from_url(url, table_name=table_name)

    def trips(call: Callable[[], object]) -> int:
        before = proxy.requests
        call()
        return proxy.requests - before

    try:
        # past psycopg's prepare threshold (5), whose preparing costs a trip once
        for n in range(8):
            warm = _acquire(store, f"warm-{n}")
            store.renew(warm.job_id, A, warm.generation, 10)
            store.renew_many([RenewRequest(warm.job_id, A, warm.generation, 10)])
            store.complete(warm.job_id, A, warm.generation)
            released = _acquire(store, f"released-{n}")
            store.release(released.job_id, A, released.generation)
        job = _acquire(store, "job")
        other = _acquire(store, "other")
        assert trips(lambda: _acquire(store, "new")) == 1
        assert trips(lambda: store.renew("job", A, job.generation, 10)) == 1
        assert trips(lambda: store.renew_many([RenewRequest("job", A, job.generation, 10)])) == 1
        assert trips(lambda: store.complete("job", A, job.generation)) == 1
        assert trips(lambda: store.release("other", A, other.generation)) == 1
        time.sleep(PING_AFTER_IDLE)  # an idle connection is pinged first: two
        assert trips(lambda: store.get("job")) == 2
    finally:
        store.close()
        proxy.close()


@pytest.mark.postgres
def test_postgresql_calls_run_in_autocommit_and_the_engine_keeps_transactions(
    postgres_server: PostgresServer, table_name: str
) -> None:
    # one engine: the store's calls run in autocommit (an execution option
    # of their connections); the engine keeps transactions for the DDL,
    # fenced transactions and its other users
    store = SqlStore.from_url(postgres_server.url, table_name=table_name)
    autocommit: list[bool] = []

    def seen(conn: Any, *_: Any) -> None:
        autocommit.append(conn.connection.dbapi_connection.autocommit)

    try:
        event.listen(store.engine, "before_cursor_execute", seen)
        job = _acquire(store, "job")
        store.renew("job", A, job.generation, 10)
        store.complete("job", A, job.generation)
        assert store.get("job") is not None
        event.remove(store.engine, "before_cursor_execute", seen)
        assert autocommit
        assert all(autocommit)
        with store.engine.connect() as conn:
            assert conn.connection.dbapi_connection.autocommit is False  # type: ignore[union-attr]
            conn.execute(sa.text("SELECT 1"))
            assert conn.in_transaction()
    finally:
        store.close()
    assert store.engine.pool.checkedin() == 0  # type: ignore[attr-defined]


class Stop(BaseException):
    """Not an error of the driver: an exit, or a green library's timeout."""


@pytest.mark.postgres
def test_a_statement_interrupted_mid_way_leaves_its_connection_out_of_the_pool(
    postgres_server: PostgresServer, table_name: str
) -> None:
    import psycopg

    class Interrupted(psycopg.Cursor[Any]):
        def execute(self, *args: Any, **kwargs: Any) -> Any:
            raise Stop

    used: list[Any] = []

    def interrupting(dbapi_connection: Any, *_: Any) -> None:
        dbapi_connection.cursor_factory = Interrupted
        used.append(dbapi_connection)

    store = SqlStore.from_url(postgres_server.url, table_name=table_name)
    try:
        event.listen(store.engine.pool, "checkout", interrupting)
        try:
            with pytest.raises(Stop):
                store.claim("job", A, 30)
        finally:
            event.remove(store.engine.pool, "checkout", interrupting)
        assert used
        assert used[-1].closed  # SQLAlchemy invalidated it
        assert isinstance(store.claim("job", A, 30), Acquired)  # on a fresh connection
    finally:
        store.close()
