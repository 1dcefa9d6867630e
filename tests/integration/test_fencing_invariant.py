"""I5 under concurrency: a fenced target never accepts a write older than one
it accepted.

Real processes, each with its own connection, write with generations that
hypothesis draws, either one at a time in the drawn order or all at once.
Every accepted write is recorded atomically with it (a log row in the same
transaction, a stream entry in the same script, the previous generation the
script saw), and the accepted sequence must be strictly increasing.

The same-transaction form (``fenced_transaction``) is raced against a real
claim by another worker on PostgreSQL, SQLite and MariaDB.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_leases.errors import LeaseLost, StaleFencingToken
from celery_leases.fencing import Token
from celery_leases.fencing.redis import RedisFence
from celery_leases.fencing.sql import fence_table, fenced_execute, fenced_transaction
from celery_leases.stores.base import Acquired
from celery_leases.stores.sql import SqlStore
from tests.servers import MariadbServer, PostgresServer, RedisServer

WRITERS = 4
JOB = "job-1"
#: seconds to wait for one answer of a writer process
ANSWER_TIMEOUT = 60

# (process index, generation): one write of the schedule
Write = tuple[int, int]
# (generation, accepted?, previous-or-accepted generation reported)
Outcome = tuple[int, bool, int | None]


# --- targets, as each writer process builds them ----------------------------------


def sql_tables(suffix: str) -> tuple[sa.Table, sa.Table, sa.Table]:
    """(fences, values, log) of one test run."""
    metadata = sa.MetaData()
    fences = fence_table(metadata, f"fences_{suffix}")
    values = sa.Table(
        f"values_{suffix}",
        metadata,
        sa.Column("resource", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(64), nullable=True),
    )
    log = sa.Table(
        f"log_{suffix}",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("resource", sa.String(64), nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column("writer", sa.Integer, nullable=False),
    )
    return fences, values, log


class SqlWriter:
    """Fenced UPDATE of a value plus a log row, in one transaction."""

    def __init__(self, url: str, suffix: str) -> None:
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.fences, self.values, self.log = sql_tables(suffix)

    def write(self, resource: str, generation: int, writer: int, fenced: bool) -> Outcome:
        update = (
            sa.update(self.values)
            .where(self.values.c.resource == resource)
            .values(value=f"{generation}:{writer}")
        )
        record = sa.insert(self.log).values(resource=resource, generation=generation, writer=writer)
        try:
            with self.engine.begin() as conn:
                if fenced:
                    fenced_execute(
                        conn,
                        update,
                        resource=resource,
                        token=Token(JOB, generation),
                        fences=self.fences,
                        on_repeat="refuse",
                    )
                else:
                    conn.execute(update)
                conn.execute(record)
        except StaleFencingToken as refused:
            return generation, False, refused.accepted
        return generation, True, None


class RedisWriter:
    """Fenced SET (reporting the previous generation) and fenced XADD."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.fence = RedisFence(self.client, prefix=prefix, on_repeat="refuse")
        self.prefix = prefix

    def write(self, resource: str, generation: int, writer: int, fenced: bool) -> Outcome:
        key = f"{self.prefix}{resource}"
        token = Token(JOB, generation)
        if not fenced:
            self.client.set(key, f"{generation}:{writer}")
            self.client.xadd(f"{key}:log", {"generation": generation, "writer": writer})
            return generation, True, None
        try:
            result = self.fence.set(key, f"{generation}:{writer}", token)
        except StaleFencingToken as refused:
            return generation, False, refused.accepted
        # the stream is a second fenced resource fed the same writes: its
        # entries are exactly the writes it accepted, in the server's order
        with contextlib.suppress(StaleFencingToken):
            self.fence.xadd(f"{key}:log", {"generation": generation, "writer": writer}, token)
        return generation, True, result.previous


def writer_main(kind: str, target: tuple[str, str], index: int, inbox: Any, outbox: Any) -> None:
    """A writer process: runs batches of writes until it receives ``None``."""
    writer: SqlWriter | RedisWriter = SqlWriter(*target) if kind == "sql" else RedisWriter(*target)
    outbox.put("ready")
    while True:
        message = inbox.get()
        if message is None:
            return
        resource, generations, fenced = message
        outbox.put([writer.write(resource, g, index, fenced) for g in generations])


# --- the pool of writer processes ---------------------------------------------------


@dataclass
class Writers:
    """Writer processes and their queues; ``run`` plays one schedule."""

    processes: list[SpawnProcess]
    inboxes: list[Any]
    outboxes: list[Any]
    results: list[Outcome] = field(default_factory=list)

    def answer(self, index: int) -> Any:
        try:
            return self.outboxes[index].get(timeout=ANSWER_TIMEOUT)
        except queue.Empty:
            alive = self.processes[index].is_alive()
            raise AssertionError(f"writer {index} did not answer (alive: {alive})") from None

    def run(
        self, resource: str, schedule: list[Write], *, in_order: bool, fenced: bool = True
    ) -> list[Outcome]:
        """Play ``schedule``: one write at a time in order, or all processes at once."""
        outcomes: list[Outcome] = []
        if in_order:
            for index, generation in schedule:
                self.inboxes[index].put((resource, [generation], fenced))
                outcomes.extend(self.answer(index))
            return outcomes
        batches: dict[int, list[int]] = {}
        for index, generation in schedule:
            batches.setdefault(index, []).append(generation)
        for index, generations in batches.items():
            self.inboxes[index].put((resource, generations, fenced))
        for index in batches:
            outcomes.extend(self.answer(index))
        return outcomes


def start_writers(kind: str, target: tuple[str, str]) -> Iterator[Writers]:
    # spawn, not fork: the test process has threads (servers, pools)
    context = multiprocessing.get_context("spawn")
    inboxes = [context.Queue() for _ in range(WRITERS)]
    outboxes = [context.Queue() for _ in range(WRITERS)]
    processes = [
        context.Process(
            target=writer_main,
            args=(kind, target, i, inboxes[i], outboxes[i]),
            name=f"fenced-writer-{i}",
            daemon=True,
        )
        for i in range(WRITERS)
    ]
    for process in processes:
        process.start()
    writers = Writers(processes, inboxes, outboxes)
    try:
        for i in range(WRITERS):
            assert writers.answer(i) == "ready"
        yield writers
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for process in processes:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for q in (*inboxes, *outboxes):
            q.close()
            q.join_thread()


@pytest.fixture(scope="module", params=["postgres", pytest.param("mysql", marks=pytest.mark.mysql)])
def sql_writers(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[Writers, sa.Engine, tuple[sa.Table, sa.Table, sa.Table]]]:
    name = "postgres_server" if request.param == "postgres" else "mariadb_server"
    server: PostgresServer | MariadbServer = request.getfixturevalue(name)
    suffix = uuid.uuid4().hex[:10]
    engine = sa.create_engine(server.url)
    tables = sql_tables(suffix)
    tables[0].metadata.create_all(engine)
    try:
        for writers in start_writers("sql", (server.url, suffix)):
            yield writers, engine, tables
    finally:
        tables[0].metadata.drop_all(engine)
        engine.dispose()


@pytest.fixture(scope="module")
def redis_writers(redis_server: RedisServer) -> Iterator[tuple[Writers, redis.Redis, str]]:
    prefix = f"inv{uuid.uuid4().hex[:10]}:"
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        for writers in start_writers("redis", (redis_server.url, prefix)):
            yield writers, client, prefix
    finally:
        client.close()


# --- what every schedule must end with ----------------------------------------------

schedules = st.lists(
    st.tuples(st.integers(0, WRITERS - 1), st.integers(1, 40)), min_size=1, max_size=14
)
few_examples = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def running_maxima(schedule: list[Write]) -> list[int]:
    """Generations a fenced target accepts when the writes come in this order."""
    accepted: list[int] = []
    for _, generation in schedule:
        if not accepted or generation > accepted[-1]:
            accepted.append(generation)
    return accepted


def check_outcomes(schedule: list[Write], outcomes: list[Outcome], in_order: bool) -> list[int]:
    """Checks shared by the targets; returns the accepted generations, sorted."""
    accepted = sorted(g for g, ok, _ in outcomes if ok)
    top = max(g for _, g in schedule)
    assert len(outcomes) == len(schedule)
    # nothing is accepted twice (repeats are refused) and the newest always lands
    assert len(accepted) == len(set(accepted))
    assert accepted[-1] == top
    for generation, ok, reported in outcomes:
        if not ok:
            # refused for a reason: something at least as new was accepted
            assert reported is not None
            assert reported >= generation
    if in_order:
        assert accepted == running_maxima(schedule)
    return accepted


@few_examples
@given(schedule=schedules, in_order=st.booleans())
def test_sql_target_accepts_only_increasing_generations(
    sql_writers: tuple[Writers, sa.Engine, tuple[sa.Table, sa.Table, sa.Table]],
    schedule: list[Write],
    in_order: bool,
) -> None:
    writers, engine, (fences, values, log) = sql_writers
    resource = uuid.uuid4().hex
    with engine.begin() as conn:
        conn.execute(sa.insert(values).values(resource=resource, value=None))
    outcomes = writers.run(resource, schedule, in_order=in_order)
    accepted = check_outcomes(schedule, outcomes, in_order)
    with engine.connect() as conn:
        logged = list(
            conn.execute(
                sa.select(log.c.generation).where(log.c.resource == resource).order_by(log.c.id)
            ).scalars()
        )
        value = conn.execute(
            sa.select(values.c.value).where(values.c.resource == resource)
        ).scalar_one()
        fence = conn.execute(
            sa.select(fences.c.generation).where(fences.c.resource == resource)
        ).scalar_one()
    # the log, in commit order, is strictly increasing: I5
    assert logged == sorted(set(logged))
    assert logged == accepted
    assert int(value.split(":")[0]) == accepted[-1]
    assert fence == accepted[-1]


@few_examples
@given(schedule=schedules, in_order=st.booleans())
def test_redis_target_accepts_only_increasing_generations(
    redis_writers: tuple[Writers, redis.Redis, str],
    schedule: list[Write],
    in_order: bool,
) -> None:
    writers, client, prefix = redis_writers
    resource = uuid.uuid4().hex
    outcomes = writers.run(resource, schedule, in_order=in_order)
    accepted = check_outcomes(schedule, outcomes, in_order)
    # each accepted SET reported the generation it replaced: together they
    # form one chain None -> g1 -> g2 -> ... in the server's order
    previous = {g: reported for g, ok, reported in outcomes if ok}
    assert [previous[g] for g in accepted] == [None, *accepted[:-1]]
    key = f"{prefix}{resource}"
    value = client.get(key)
    assert isinstance(value, str)
    assert int(value.split(":")[0]) == accepted[-1]
    entries: list[tuple[str, dict[str, str]]] = client.xrange(f"{key}:log")  # type: ignore[assignment]
    streamed = [int(fields["generation"]) for _, fields in entries]
    assert streamed == sorted(set(streamed))
    assert streamed[-1] == accepted[-1]


def test_unfenced_sql_target_accepts_the_stale_write(
    sql_writers: tuple[Writers, sa.Engine, tuple[sa.Table, sa.Table, sa.Table]],
) -> None:
    """The worked example's schedule through the same processes, without a fence."""
    writers, engine, (_, values, log) = sql_writers
    resource = uuid.uuid4().hex
    with engine.begin() as conn:
        conn.execute(sa.insert(values).values(resource=resource, value=None))
    writers.run(resource, [(0, 8), (1, 7)], in_order=True, fenced=False)
    with engine.connect() as conn:
        value = conn.execute(
            sa.select(values.c.value).where(values.c.resource == resource)
        ).scalar_one()
        logged = list(
            conn.execute(
                sa.select(log.c.generation).where(log.c.resource == resource).order_by(log.c.id)
            ).scalars()
        )
    assert value == "7:1"
    assert logged == [8, 7]  # I5 broken: the check demonstrably can fail


def test_unfenced_redis_target_accepts_the_stale_write(
    redis_writers: tuple[Writers, redis.Redis, str],
) -> None:
    writers, client, prefix = redis_writers
    resource = uuid.uuid4().hex
    writers.run(resource, [(0, 8), (1, 7)], in_order=True, fenced=False)
    assert client.get(f"{prefix}{resource}") == "7:1"


def test_fenced_worked_example_through_processes(
    sql_writers: tuple[Writers, sa.Engine, tuple[sa.Table, sa.Table, sa.Table]],
    redis_writers: tuple[Writers, redis.Redis, str],
) -> None:
    """Same schedule as the unfenced tests: both targets refuse 7 after 8."""
    sql, engine, (_, values, _) = sql_writers
    resource = uuid.uuid4().hex
    with engine.begin() as conn:
        conn.execute(sa.insert(values).values(resource=resource, value=None))
    assert sql.run(resource, [(0, 8), (1, 7)], in_order=True) == [(8, True, None), (7, False, 8)]
    red, client, prefix = redis_writers
    assert red.run(resource, [(0, 8), (1, 7)], in_order=True) == [(8, True, None), (7, False, 8)]
    assert client.get(f"{prefix}{resource}") == "8:0"


# --- fenced_transaction against a concurrent claim ---------------------------------------

#: lease of worker A in the race, seconds
RACE_TTL = 0.8
#: how long A keeps its transaction open after the check
RACE_HOLD = 0.3


@pytest.fixture
def race_stores(sql_url: str, unique: str) -> Iterator[tuple[SqlStore, SqlStore, sa.Table]]:
    """Two handles on one lease store (workers A and B) and a results table."""
    store_a = SqlStore.from_url(sql_url, table_name=f"leases_{unique}")
    store_b = SqlStore.from_url(sql_url, table_name=f"leases_{unique}", create_table=False)
    metadata = sa.MetaData()
    results = sa.Table(
        f"results_{unique}",
        metadata,
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("seen_owner", sa.String(255), nullable=False),
        sa.Column("seen_generation", sa.BigInteger, nullable=False),
    )
    metadata.create_all(store_a.engine)
    yield store_a, store_b, results
    store_a.close()
    store_b.close()


@dataclass
class RaceRound:
    """What happened in one round of A's fenced write against B's claim."""

    generation_a: int
    committed: bool = False
    refused: LeaseLost | None = None
    generation_b: int | None = None
    #: longest single claim call of B (seconds): long when it waited on A
    longest_claim: float = 0.0


def race_round(
    store_a: SqlStore, store_b: SqlStore, results: sa.Table, job_id: str, enter_at: float
) -> RaceRound:
    """A claims with RACE_TTL and opens its fenced transaction at ``enter_at``
    seconds; B claims over and over from just before A's lease runs out."""
    acquired = store_a.claim(job_id, "worker-a", RACE_TTL)
    assert isinstance(acquired, Acquired)
    start = time.monotonic()
    lease = Token(job_id, acquired.generation, "worker-a")
    outcome = RaceRound(acquired.generation)
    leases = store_a.table

    def worker_a() -> None:
        time.sleep(max(0.0, start + enter_at - time.monotonic()))
        try:
            with fenced_transaction(store_a, lease) as conn:
                time.sleep(RACE_HOLD)
                # who holds the job right now, as this transaction sees it
                seen = conn.execute(
                    sa.select(leases.c.owner, leases.c.generation).where(leases.c.job_id == job_id)
                ).one()
                conn.execute(
                    sa.insert(results).values(
                        job_id=job_id, seen_owner=seen.owner, seen_generation=seen.generation
                    )
                )
            outcome.committed = True
        except LeaseLost as lost:
            outcome.refused = lost

    def worker_b() -> None:
        time.sleep(max(0.0, start + RACE_TTL - 0.1 - time.monotonic()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            began = time.monotonic()
            claimed = store_b.claim(job_id, "worker-b", 30)
            outcome.longest_claim = max(outcome.longest_claim, time.monotonic() - began)
            if isinstance(claimed, Acquired):
                outcome.generation_b = claimed.generation
                return
            time.sleep(0.01)

    threads = [threading.Thread(target=worker_a), threading.Thread(target=worker_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcome


def test_fenced_transaction_serializes_with_a_concurrent_claim(
    race_stores: tuple[SqlStore, SqlStore, sa.Table],
) -> None:
    """Either A's write commits before B's claim is granted, or it is refused.

    A enters its transaction well before, around and well after the moment
    its lease runs out, while B keeps claiming the job.
    """
    store_a, store_b, results = race_stores
    rounds: list[RaceRound] = []
    for i, enter_at in enumerate((0.1, 0.7, 0.78, 0.82, 0.9, 1.3)):
        job_id = f"race-{i}"
        outcome = race_round(store_a, store_b, results, job_id, enter_at)
        rounds.append(outcome)
        with store_a.engine.connect() as conn:
            written = conn.execute(sa.select(results).where(results.c.job_id == job_id)).all()
        # B always ends up with a later generation
        assert outcome.generation_b > outcome.generation_a
        assert outcome.committed != (outcome.refused is not None)
        if outcome.committed:
            # A's write committed while A still held the job: no claim by B
            # had been granted when the transaction wrote
            assert [(r.seen_owner, r.seen_generation) for r in written] == [
                ("worker-a", outcome.generation_a)
            ]
        else:
            assert written == []
            assert outcome.refused is not None
            assert outcome.refused.reason in ("expired", "superseded")
    # the schedule covers both outcomes
    assert rounds[0].committed
    assert rounds[-1].refused is not None


def test_claim_waits_for_an_open_fenced_transaction(
    race_stores: tuple[SqlStore, SqlStore, sa.Table],
) -> None:
    """A's lease runs out while its fenced transaction is open: B's claim
    blocks until A commits, and only then gets the next generation."""
    store_a, store_b, results = race_stores
    acquired = store_a.claim("job-w", "worker-a", 0.4)
    assert isinstance(acquired, Acquired)
    lease = Token("job-w", acquired.generation, "worker-a")
    committing_at: list[float] = []
    checked = threading.Event()

    def worker_a() -> None:
        with fenced_transaction(store_a, lease) as conn:
            checked.set()
            time.sleep(1.2)  # far past lease_until
            conn.execute(
                sa.insert(results).values(
                    job_id="job-w", seen_owner="worker-a", seen_generation=lease.generation
                )
            )
            committing_at.append(time.monotonic())

    thread = threading.Thread(target=worker_a)
    thread.start()
    assert checked.wait(10)
    deadline = time.monotonic() + 10
    while store_b.now_ms() <= acquired.lease_until_ms + 50:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    claimed = store_b.claim("job-w", "worker-b", 30)
    granted_at = time.monotonic()
    thread.join(timeout=30)
    assert isinstance(claimed, Acquired)
    assert claimed.generation == max(lease.generation + 1, claimed.store_now_ms)
    assert committing_at
    # B's claim, sent long before, returned only after A began to commit
    assert granted_at >= committing_at[0]
    with store_a.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(results)).scalar_one() == 1
