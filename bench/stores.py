"""Benchmark the lease stores against baselines measured in the same run.

For each store (memory, redis, postgres, sqlite, mysql) it times claim, renew,
complete and claim-after-release, and compares them with what the same
server and connection can do without the library:

- Redis: claim+complete pairs against redis-py ``Lock`` acquire+release
  pairs and against bare ``PING``, on the store's own client;
- PostgreSQL, SQLite and MySQL: claim against ``SELECT 1`` through
  ``store.engine`` (on PostgreSQL also in autocommit, as the store runs, which
  sets the target; on MySQL a claim is a transaction of two statements and a
  COMMIT, so its ratio is shown for information);
- every store: one ``renew_many`` of ``--batch`` leases against as many
  single renews.

The machine may be shared and noisy, so each case runs once per round, the
order of the cases rotates from round to round, and the table reports the
median of the rounds and ratios of medians taken in the same run. Loops are
sequential on one connection: they measure latency, like the baselines.

The script starts its own throwaway redis-server, PostgreSQL and MariaDB (from
``tests/servers.py``) and SQLite in a temporary folder, and always stops
them. Run it from the repository root::

    .venv/bin/python bench/stores.py
    .venv/bin/python bench/stores.py --stores redis,postgres --ops 1000 --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import json
import os
import platform
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # run as a script: make the package and tests/servers.py importable
    sys.path.insert(0, str(ROOT))

from celery_leases import (  # noqa: E402 - needs ROOT on sys.path
    Acquired,
    Completed,
    LeaseError,
    LeaseStore,
    Released,
    Renewed,
    RenewRequest,
    open_store,
)
from celery_leases.values import as_text  # noqa: E402
from tests.servers import (  # noqa: E402
    MariadbServer,
    PostgresServer,
    RedisServer,
    ServerMissing,
)

STORE_KINDS = ("memory", "redis", "postgres", "sqlite", "mysql")

#: A case runs ``n`` operations and returns the seconds the timed part took.
Case = Callable[[int], float]


class BenchError(RuntimeError):
    """A store answered something a benchmark loop did not expect."""


@dataclass(frozen=True)
class Target:
    """A ratio to report: ``subject`` over ``baseline``, both by ops/s.

    ``kind="speed"`` compares ops/s (higher is better); ``kind="time"``
    compares the seconds one case takes against the other (lower is better).
    ``limit`` is ``None`` for ratios shown for information only.
    """

    label: str
    subject: str
    baseline: str
    kind: str = "speed"
    limit: float | None = None


@dataclass
class StoreBench:
    """The cases of one store, its targets, and what was measured."""

    kind: str
    cases: dict[str, Case]
    #: how many operations one case counts as one (``n`` for most cases)
    fixed_ops: dict[str, int] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    #: seconds per round, by case
    seconds: dict[str, list[float]] = field(default_factory=dict)
    #: operations per round, by case
    ops: dict[str, int] = field(default_factory=dict)
    note: str = ""

    def rate(self, case: str) -> list[float]:
        """Operations per second of each round of ``case``."""
        return [self.ops[case] / s for s in self.seconds[case]]


# --- timing ---------------------------------------------------------------


@contextlib.contextmanager
def _quiet_gc() -> Iterator[None]:
    """Collect first, then keep the collector out of the timed loop (as timeit does)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def timed(loop: Callable[[], object]) -> float:
    """Run ``loop`` once and return the seconds it took."""
    with _quiet_gc():
        start = time.perf_counter()
        loop()
        return time.perf_counter() - start


def timed_with_cpu(loop: Callable[[], object]) -> tuple[float, float]:
    """Run ``loop`` once: the seconds it took, and this process's CPU seconds in it."""
    with _quiet_gc():
        start, cpu_start = time.perf_counter(), time.process_time()
        loop()
        return time.perf_counter() - start, time.process_time() - cpu_start


def run_rounds(bench: StoreBench, n: int, rounds: int) -> None:
    """Run every case once per round, rotating their order between rounds."""
    names = list(bench.cases)
    for index in range(rounds):
        shift = index % len(names)
        order = names[shift:] + names[:shift]
        if index % 2:
            order.reverse()
        for name in order:
            seconds = bench.cases[name](n)
            bench.seconds.setdefault(name, []).append(seconds)
            bench.ops[name] = bench.fixed_ops.get(name, n)


# --- lease cases, shared by every store -------------------------------------


class LeaseSupply:
    """Held leases for the cases that need one (renew, complete, release).

    Claims made as set-up are not timed; a timed claim hands its lease on
    here, so most set-up comes for free.
    """

    def __init__(self, store: LeaseStore, owner: str, ttl: float) -> None:
        self.store = store
        self.owner = owner
        self.ttl = ttl
        self.held: list[Acquired] = []

    def fresh_job(self) -> str:
        return f"bench-{uuid.uuid4().hex}"

    def claim(self, job_id: str) -> Acquired:
        result = self.store.claim(job_id, self.owner, self.ttl)
        if not isinstance(result, Acquired):
            raise BenchError(f"claim of new job {job_id!r} returned {result!r}")
        return result

    def take(self, n: int) -> list[Acquired]:
        """``n`` held leases, claiming more (untimed) when short."""
        while len(self.held) < n:
            self.held.append(self.claim(self.fresh_job()))
        taken, self.held = self.held[:n], self.held[n:]
        return taken


def _expect(result: object, kind: type, action: str, job_id: str) -> None:
    if not isinstance(result, kind):
        raise BenchError(f"{action} of {job_id!r} returned {result!r}")


def lease_cases(
    supply: LeaseSupply, batch: list[Acquired], batch_calls: int = 1
) -> dict[str, Case]:
    """claim, renew, complete, re-claim and the batched-renew pair of cases.

    The batched case renews the batch ``batch_calls`` times in a row (one
    call is over in a few milliseconds, shorter than the machine's noise);
    its single-renew baseline renews the batch once, one lease at a time.
    """
    store, owner, ttl = supply.store, supply.owner, supply.ttl

    def claim(n: int) -> float:
        jobs = [supply.fresh_job() for _ in range(n)]
        got: list[Acquired] = []

        def loop() -> None:
            for job_id in jobs:
                result = store.claim(job_id, owner, ttl)
                _expect(result, Acquired, "claim", job_id)
                got.append(result)  # type: ignore[arg-type]

        seconds = timed(loop)
        supply.held.extend(got)
        return seconds

    def renew(n: int) -> float:
        leases = supply.take(n)

        def loop() -> None:
            for lease in leases:
                result = store.renew(lease.job_id, owner, lease.generation, ttl)
                _expect(result, Renewed, "renew", lease.job_id)

        seconds = timed(loop)
        supply.held.extend(leases)
        return seconds

    def complete(n: int) -> float:
        leases = supply.take(n)

        def loop() -> None:
            for lease in leases:
                result = store.complete(lease.job_id, owner, lease.generation)
                _expect(result, Completed, "complete", lease.job_id)

        return timed(loop)

    def reclaim(n: int) -> float:
        leases = supply.take(n)
        for lease in leases:
            result = store.release(lease.job_id, owner, lease.generation)
            _expect(result, Released, "release", lease.job_id)
        got: list[Acquired] = []

        def loop() -> None:
            for lease in leases:
                result = store.claim(lease.job_id, owner, ttl)
                _expect(result, Acquired, "claim after release", lease.job_id)
                got.append(result)  # type: ignore[arg-type]

        seconds = timed(loop)
        supply.held.extend(got)
        return seconds

    requests = [RenewRequest(lease.job_id, owner, lease.generation, ttl) for lease in batch]

    def renew_singles(_n: int) -> float:
        def loop() -> None:
            for request in requests:
                result = store.renew(request.job_id, owner, request.generation, ttl)
                _expect(result, Renewed, "renew", request.job_id)

        return timed(loop)

    def renew_many(_n: int) -> float:
        def loop() -> None:
            for _ in range(batch_calls):
                results = store.renew_many(requests)
                refused = [r for r in results if not isinstance(r, Renewed)]
                if len(results) != len(requests) or refused:
                    raise BenchError(f"renew_many refused {len(refused)} leases: {refused[:3]!r}")

        return timed(loop) / batch_calls  # the time of one call

    return {
        "claim": claim,
        "renew": renew,
        "complete": complete,
        "claim after release": reclaim,
        "renew x batch": renew_singles,
        "renew_many(batch)": renew_many,
    }


def batch_target(size: int, limit: float | None) -> Target:
    return Target(
        f"renew_many({size}) / {size} renews",
        "renew_many(batch)",
        "renew x batch",
        kind="time",
        limit=limit,
    )


# --- per-store set-up -------------------------------------------------------


def _redis_client(store: LeaseStore, url: str) -> tuple[Any, str]:
    """The store's own redis-py client, or a new one on the same server."""
    import redis

    for name in ("client", "redis", "_client", "_redis"):
        candidate = getattr(store, name, None)
        if isinstance(candidate, redis.Redis):
            return candidate, f"store.{name}"
    return redis.Redis.from_url(url), "a separate client (the store exposes none)"


def redis_cases(store: LeaseStore, url: str, supply: LeaseSupply) -> tuple[dict[str, Case], str]:
    """claim+complete pairs, redis-py Lock pairs and PING on one client."""
    client, where = _redis_client(store, url)
    owner, ttl = supply.owner, supply.ttl

    def pairs(n: int) -> float:
        jobs = [supply.fresh_job() for _ in range(n)]

        def loop() -> None:
            for job_id in jobs:
                got = store.claim(job_id, owner, ttl)
                if not isinstance(got, Acquired):
                    raise BenchError(f"claim of {job_id!r} returned {got!r}")
                done = store.complete(job_id, owner, got.generation)
                _expect(done, Completed, "complete", job_id)

        return timed(loop)

    def lock_pairs(n: int) -> float:
        names = [f"bench-lock:{uuid.uuid4().hex}" for _ in range(n)]

        def loop() -> None:
            for name in names:
                lock = client.lock(name, timeout=ttl)
                if not lock.acquire(blocking=False):
                    raise BenchError(f"redis-py Lock {name!r} was not acquired")
                lock.release()

        return timed(loop)

    def ping(n: int) -> float:
        def loop() -> None:
            for _ in range(n):
                client.ping()

        return timed(loop)

    cases: dict[str, Case] = {
        "claim+complete pair": pairs,
        "redis-py Lock pair": lock_pairs,
        "PING": ping,
    }
    return cases, f"baselines on {where}"


def other_policy_lock_pairs(fsync: str, ttl: float, cleanup: list[Callable[[], None]]) -> Case:
    """redis-py ``Lock`` pairs on a second redis-server with AOF policy ``fsync``.

    A lock without fencing needs every write durable to keep its promise
    (``appendfsync always``); leases keep theirs with ``everysec`` (the clock
    bound on generations). This case measures the lock where it is safe.
    """
    import redis

    server = RedisServer("--appendfsync", fsync)
    client = redis.Redis.from_url(server.url)
    cleanup.append(server.close)
    cleanup.insert(0, client.close)

    def lock_pairs(n: int) -> float:
        names = [f"bench-lock:{uuid.uuid4().hex}" for _ in range(n)]

        def loop() -> None:
            for name in names:
                lock = client.lock(name, timeout=ttl)
                if not lock.acquire(blocking=False):
                    raise BenchError(f"redis-py Lock {name!r} was not acquired")
                lock.release()

        return timed(loop)

    return lock_pairs


def sql_cases(store: LeaseStore, kind: str) -> dict[str, Case]:
    """``SELECT 1`` through the store's engine, one pooled connection per query.

    On PostgreSQL also in autocommit, as the store runs its statements: a
    plain ``engine.connect()`` adds a BEGIN and a ROLLBACK around the query,
    two round trips the store does not pay.
    """
    from sqlalchemy import text

    engine = store.engine  # type: ignore[attr-defined]
    select_one = text("SELECT 1")

    def select_on(target: Any) -> Case:
        def select(n: int) -> float:
            def loop() -> None:
                for _ in range(n):
                    with target.connect() as connection:
                        connection.execute(select_one).scalar_one()

            return timed(loop)

        return select

    cases = {"SELECT 1": select_on(engine)}
    if kind == "postgres":
        autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        cases["SELECT 1 autocommit"] = select_on(autocommit)
    return cases


@dataclass
class Opened:
    """A store under test and how to get rid of it."""

    store: LeaseStore
    url: str
    cleanup: list[Callable[[], None]]


def open_kind(kind: str, fsync: str, unique: str, pre_ping: bool = True) -> Opened:
    """Start the server for ``kind`` (if any) and open a store on it.

    ``pre_ping`` is the ``pool_pre_ping`` of the PostgreSQL engine (the
    store's default is on).

    Raises:
        ServerMissing: the server's binaries are not installed.
        LeaseError: the store could not be opened.
    """
    cleanup: list[Callable[[], None]] = []
    options: dict[str, Any]
    try:
        if kind == "memory":
            url, options = "memory://", {}
        elif kind == "redis":
            redis_server = RedisServer("--appendfsync", fsync)
            cleanup.append(redis_server.close)
            url, options = redis_server.url, {"prefix": f"bench{unique}:"}
        elif kind == "postgres":
            pg_server = PostgresServer()
            cleanup.append(pg_server.close)
            url = pg_server.url
            options = {"table_name": f"bench_{unique}", "pool_pre_ping": pre_ping}
        elif kind == "mysql":
            mariadb_server = MariadbServer()
            cleanup.append(mariadb_server.close)
            url = mariadb_server.url
            options = {"table_name": f"bench_{unique}"}
        elif kind == "sqlite":
            folder = tempfile.mkdtemp(prefix="leases-bench-sqlite-")
            cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
            url = f"sqlite:///{folder}/leases.db"
            options = {"table_name": f"bench_{unique}"}
        else:
            raise ValueError(f"unknown store kind {kind!r}")
        store = open_store(url, **options)
        cleanup.insert(0, store.close)
    except BaseException:
        close_all(cleanup)
        raise
    return Opened(store, url, cleanup)


def close_all(cleanup: list[Callable[[], None]]) -> None:
    """Run every clean-up step, even when one of them fails."""
    for step in cleanup:
        try:
            step()
        except Exception as exc:  # report it and keep stopping servers
            print(f"  clean-up step failed: {exc!r}", file=sys.stderr)


def build_bench(kind: str, opened: Opened, args: argparse.Namespace) -> StoreBench:
    """The cases and targets of one store; claims the batch leases (untimed)."""
    store = opened.store
    owner = f"bench-{platform.node()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    supply = LeaseSupply(store, owner, args.ttl)
    batch = [supply.claim(supply.fresh_job()) for _ in range(args.batch)]
    cases = lease_cases(supply, batch, args.batch_calls)
    bench = StoreBench(kind, cases, fixed_ops={"renew x batch": args.batch})
    bench.fixed_ops["renew_many(batch)"] = args.batch
    # an in-process store has no round trip to save, so the batch target is
    # informative; Redis renews a batch in one script call per node
    limit = {"memory": None, "redis": 0.05}.get(kind, 0.1)
    bench.targets.append(batch_target(args.batch, limit))
    if kind == "redis":
        extra, bench.note = redis_cases(store, opened.url, supply)
        cases.update(extra)
        bench.targets[:0] = [
            Target("claim+complete pairs / Lock pairs, same fsync policy",
                   "claim+complete pair", "redis-py Lock pair", limit=1.0),
            Target("claim+complete pairs / PING", "claim+complete pair", "PING"),
            Target("claim / PING", "claim", "PING"),
        ]  # fmt: skip
        lock_fsync = args.lock_appendfsync
        if lock_fsync and lock_fsync != args.redis_appendfsync:
            name = f"redis-py Lock pair, appendfsync {lock_fsync}"
            cases[name] = other_policy_lock_pairs(lock_fsync, args.ttl, opened.cleanup)
            bench.targets.insert(
                1,
                Target(f"claim+complete pairs / Lock pairs on appendfsync {lock_fsync}",
                       "claim+complete pair", name, limit=1.5),
            )  # fmt: skip
    elif kind == "postgres":
        cases.update(sql_cases(store, kind))
        # the target against the cheaper baseline: autocommit, as the store runs
        bench.targets[:0] = [
            Target("claim / SELECT 1 autocommit", "claim", "SELECT 1 autocommit", limit=0.5),
            Target("claim / SELECT 1", "claim", "SELECT 1"),
        ]
    elif kind in ("sqlite", "mysql"):
        cases.update(sql_cases(store, kind))
        bench.targets.insert(0, Target("claim / SELECT 1", "claim", "SELECT 1"))
    return bench


# --- where the time of one operation goes -------------------------------------


def _per_op_us(loop: Callable[[], object], n: int) -> float:
    return timed(loop) / n * 1e6


def _redis_split_round(
    store: LeaseStore, client: Any, n: int, ttl: float, shas: tuple[str, str]
) -> dict[str, tuple[float, float, float]]:
    """One round of :func:`split_redis`: (total, client CPU, in Redis) us per operation."""
    claim_sha, complete_sha = shas
    key = store.key  # type: ignore[attr-defined]
    owner, ttl_ms = f"bench-split-{os.getpid()}", round(ttl * 1000)
    jobs = [f"bench-split-{uuid.uuid4().hex}" for _ in range(n)]
    scripted = [f"bench-split-{uuid.uuid4().hex}" for _ in range(n)]
    got: list[Any] = []
    raw: list[Any] = []
    locks = [client.lock(f"bench-split-lock:{uuid.uuid4().hex}", timeout=ttl) for _ in range(n)]

    def claims() -> None:
        got.extend(store.claim(job_id, owner, ttl) for job_id in jobs)

    def completes() -> None:
        for lease in got:
            store.complete(lease.job_id, owner, lease.generation)

    def claim_scripts() -> None:
        raw.extend(
            client.evalsha(claim_sha, 1, key(j), f"{owner}\0{ttl_ms}\0\0\0000\0{j}\0")
            for j in scripted
        )

    def complete_scripts() -> None:
        for job_id, reply in zip(scripted, raw, strict=True):
            client.evalsha(complete_sha, 1, key(job_id), owner, reply.split()[0])

    def lock_acquires() -> None:
        for lock in locks:
            lock.acquire(blocking=False)

    def lock_releases() -> None:
        for lock in locks:
            lock.release()

    def pings() -> None:
        for _ in range(n):
            client.ping()

    steps = {
        "claim (store)": (claims, "evalsha"),
        "complete (store)": (completes, "evalsha"),
        "claim (bare EVALSHA)": (claim_scripts, "evalsha"),
        "complete (bare EVALSHA)": (complete_scripts, "evalsha"),
        "Lock acquire (SET NX PX)": (lock_acquires, "set"),
        "Lock release (script)": (lock_releases, "evalsha"),
        "PING": (pings, "ping"),
    }
    result = {}
    for name, (loop, command) in steps.items():
        client.config_resetstat()
        seconds, cpu_seconds = timed_with_cpu(loop)
        stats = client.info("commandstats").get(f"cmdstat_{command}", {})
        in_redis = float(stats.get("usec_per_call", 0.0))
        result[name] = (seconds / n * 1e6, cpu_seconds / n * 1e6, in_redis)
    return result


def split_redis(store: LeaseStore, url: str, n: int, rounds: int, ttl: float) -> None:
    """Per-operation time of claim and complete, their bare scripts and ``Lock``'s steps.

    The bare scripts (``CLAIM_SCRIPT``, ``COMPLETE_SCRIPT``) run with
    ``client.evalsha`` on the same client, so ``store - bare`` is the
    library's own Python cost. ``client CPU`` is this process's CPU time per
    operation (redis-py, the library, the socket calls): steadier than the
    wall-clock difference on a busy machine. ``in Redis`` is the server's
    own time per command (``INFO commandstats``, reset before each step): it
    leaves out the network, the client and the AOF fsync, which Redis does
    after the command, before it answers.
    """
    from celery_leases.stores.redis._scripts import CLAIM_SCRIPT, COMPLETE_SCRIPT

    client, _ = _redis_client(store, url)
    shas = (as_text(client.script_load(CLAIM_SCRIPT)), as_text(client.script_load(COMPLETE_SCRIPT)))
    samples: dict[str, list[tuple[float, float, float]]] = {}
    for _ in range(rounds):
        for name, value in _redis_split_round(store, client, n, ttl, shas).items():
            samples.setdefault(name, []).append(value)
    print(f"\nredis: microseconds per operation, median of {rounds} rounds of {n}")
    print(f"  {'operation':<26} {'total':>7} {'client CPU':>11} {'in Redis':>9}")
    for name, values in samples.items():
        total, cpu, inside = (_median([v[i] for v in values]) for i in range(3))
        print(f"  {name:<26} {total:>7.0f} {cpu:>11.1f} {inside:>9.1f}")


class _DriverClock:
    """Time spent in the driver: statements (cursor events) and commits."""

    def __init__(self) -> None:
        self.started = 0.0
        self.inside = 0.0
        self.statements = 0

    def before(self, *_args: object) -> None:
        self.started = time.perf_counter()

    def after(self, *_args: object) -> None:
        self.inside += time.perf_counter() - self.started
        self.statements += 1

    def timing_commit(self, commit: Callable[[Any], None]) -> Callable[[Any], None]:
        """Wrap the dialect's ``do_commit`` (SQLite's fsync happens in COMMIT)."""

        def do_commit(dbapi_connection: Any) -> None:
            started = time.perf_counter()
            try:
                commit(dbapi_connection)
            finally:
                self.inside += time.perf_counter() - started

        return do_commit


def _sql_split_round(
    store: LeaseStore, n: int, ttl: float, clock: _DriverClock
) -> dict[str, tuple[float, float, float]]:
    """One round of :func:`split_sql`: (total us, in-driver us, statements) per op."""
    owner = f"bench-split-{os.getpid()}"
    jobs = [f"bench-split-{uuid.uuid4().hex}" for _ in range(n)]
    got: list[Any] = []

    def claims() -> None:
        got.extend(store.claim(job_id, owner, ttl) for job_id in jobs)

    def renews() -> None:
        for lease in got:
            store.renew(lease.job_id, owner, lease.generation, ttl)

    def completes() -> None:
        for lease in got:
            store.complete(lease.job_id, owner, lease.generation)

    result = {}
    for name, loop in {"claim": claims, "renew": renews, "complete": completes}.items():
        clock.inside, clock.statements = 0.0, 0
        total = _per_op_us(loop, n)
        result[name] = (total, clock.inside / n * 1e6, clock.statements / n)
    return result


def split_sql(store: LeaseStore, n: int, rounds: int, ttl: float) -> None:
    """Per-operation time of claim, renew and complete, split by where it goes.

    ``in driver`` is the time inside the driver's execute (SQLAlchemy cursor
    events) and commit (the dialect's ``do_commit``, wrapped for the run):
    round trips and the database's work. ``checkout`` is taking a pooled
    connection and giving it back (with ``pool_pre_ping``, one more round
    trip). The rest is Python: building the statement, SQLAlchemy's
    compilation cache, reading the result.
    """
    from sqlalchemy import event

    engine = store.engine  # type: ignore[attr-defined]
    clock = _DriverClock()
    rows: dict[str, list[tuple[float, float, float]]] = {}
    event.listen(engine, "before_cursor_execute", clock.before)
    event.listen(engine, "after_cursor_execute", clock.after)
    dialect = engine.dialect
    dialect.do_commit = clock.timing_commit(dialect.do_commit)
    try:
        for _ in range(rounds):
            for name, row in _sql_split_round(store, n, ttl, clock).items():
                rows.setdefault(name, []).append(row)
    finally:
        event.remove(engine, "before_cursor_execute", clock.before)
        event.remove(engine, "after_cursor_execute", clock.after)
        del dialect.do_commit  # the class's method again

    def checkout() -> None:
        for _ in range(n):
            with engine.connect():
                pass

    pooled = _median([_per_op_us(checkout, n) for _ in range(rounds)])
    print(f"\n{store.url}: microseconds per operation, median of {rounds} rounds of {n}")
    print(f"  {'operation':<10} {'total':>7} {'in driver':>10} {'statements':>11} "
          f"{'checkout':>9} {'rest (Python)':>14}")  # fmt: skip
    for name, values in rows.items():
        total, inside, statements = (_median([v[i] for v in values]) for i in range(3))
        rest = total - inside - pooled
        print(f"  {name:<10} {total:>7.0f} {inside:>10.0f} {statements:>11.2f} "
              f"{pooled:>9.0f} {rest:>14.0f}")  # fmt: skip


# --- profiling --------------------------------------------------------------


def profile_claims(bench_store: LeaseStore, n: int, ttl: float) -> None:
    """Profile ``n`` claim+complete pairs and print where the time goes."""
    owner = f"bench-profile-{os.getpid()}"
    jobs = [f"bench-profile-{uuid.uuid4().hex}" for _ in range(n)]
    profiler = cProfile.Profile()
    profiler.enable()
    for job_id in jobs:
        got = bench_store.claim(job_id, owner, ttl)
        if isinstance(got, Acquired):
            bench_store.complete(job_id, owner, got.generation)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.strip_dirs().sort_stats("tottime").print_stats(12)


# --- report -----------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values)


def ratio_of(bench: StoreBench, target: Target) -> tuple[float, float, float]:
    """The ratio of medians, and the lowest and highest per-round ratio."""
    if target.kind == "time":
        subject, baseline = bench.seconds[target.subject], bench.seconds[target.baseline]
    else:
        subject, baseline = bench.rate(target.subject), bench.rate(target.baseline)
    per_round = [s / b for s, b in zip(subject, baseline, strict=True)]
    return _median(subject) / _median(baseline), min(per_round), max(per_round)


def verdict(target: Target, ratio: float) -> str:
    if target.limit is None:
        return "info"
    ok = ratio >= target.limit if target.kind == "speed" else ratio <= target.limit
    return "PASS" if ok else "MISS"


def print_rates(benches: list[StoreBench]) -> None:
    print(f"\n{'store':<9} {'case':<22} {'median ops/s':>13} {'min..max ops/s':>22}")
    for bench in benches:
        for case in bench.cases:
            rates = bench.rate(case)
            spread = f"{min(rates):,.0f}..{max(rates):,.0f}"
            print(f"{bench.kind:<9} {case:<22} {_median(rates):>13,.0f} {spread:>22}")
        if bench.note:
            print(f"{'':<9} ({bench.note})")


def print_ratios(benches: list[StoreBench]) -> list[dict[str, Any]]:
    print(f"\n{'store':<9} {'ratio':<37} {'median':>8} {'rounds':>14} {'target':>9}  result")
    rows = []
    for bench in benches:
        for target in bench.targets:
            ratio, low, high = ratio_of(bench, target)
            result = verdict(target, ratio)
            sign = ">=" if target.kind == "speed" else "<="
            limit = f"{sign} {target.limit:g}x" if target.limit is not None else "-"
            spread = f"{low:.2f}..{high:.2f}"
            print(
                f"{bench.kind:<9} {target.label:<37} {ratio:>7.3f}x {spread:>14} "
                f"{limit:>9}  {result}"
            )
            rows.append(
                {
                    "store": bench.kind,
                    "ratio": target.label,
                    "kind": target.kind,
                    "median": ratio,
                    "per_round_min": low,
                    "per_round_max": high,
                    "target": target.limit,
                    "result": result,
                }
            )
    print("  speed ratios compare ops/s (higher is better); renew_many compares time (lower).")
    return rows


def machine_line() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, "
        f"{os.cpu_count()} cores, load {load}, Python {platform.python_version()}"
    )


# --- main -------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark the lease stores against same-run baselines "
        "(redis-py Lock, PING, SELECT 1) and print ratios with their targets.",
    )
    parser.add_argument(
        "--stores",
        default=",".join(STORE_KINDS),
        help=f"comma-separated subset of {','.join(STORE_KINDS)} (default: all)",
    )
    parser.add_argument(
        "--ops", type=int, default=400, help="operations per case per round (default: 400)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds per store (default: 5)"
    )
    parser.add_argument(
        "--batch", type=int, default=1000, help="leases per renew_many (default: 1000)"
    )
    parser.add_argument(
        "--batch-calls",
        type=int,
        default=5,
        help="renew_many calls per round, timed together (default: 5)",
    )
    parser.add_argument(
        "--ttl", type=float, default=60.0, help="lease time in seconds (default: 60)"
    )
    parser.add_argument(
        "--redis-appendfsync",
        choices=("always", "everysec", "no"),
        default="always",
        help="AOF fsync policy of the throwaway redis-server (default: always, as in the tests)",
    )
    parser.add_argument(
        "--lock-appendfsync",
        choices=("always", "everysec", "no"),
        help="also time redis-py Lock on a second redis-server with this AOF fsync policy "
        "(for example: leases on everysec against Lock on always)",
    )
    parser.add_argument(
        "--postgres-pre-ping",
        choices=("on", "off"),
        default="on",
        help="pool_pre_ping of the PostgreSQL engine, for the store and SELECT 1 alike "
        "(default: on, the store's default)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument(
        "--split",
        action="store_true",
        help="also show where the time of one operation goes (Python, round trip, server)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile claim+complete pairs of each store"
    )
    parser.add_argument(
        "--fail-on-miss", action="store_true", help="exit with status 1 when a target is missed"
    )
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(STORE_KINDS))
    if unknown or not kinds:
        parser.error(f"--stores takes {','.join(STORE_KINDS)}; got {args.stores!r}")
    if args.ops < 1 or args.rounds < 1 or args.batch < 1 or args.ttl <= 0:
        parser.error("--ops, --rounds, --batch and --ttl must be positive")
    args.kinds = kinds
    return args


def bench_one(kind: str, args: argparse.Namespace) -> StoreBench | None:
    """Start, measure and stop one store; ``None`` when it is not available."""
    started = time.perf_counter()
    try:
        pre_ping = args.postgres_pre_ping == "on"
        opened = open_kind(kind, args.redis_appendfsync, uuid.uuid4().hex[:10], pre_ping)
    except (ServerMissing, LeaseError) as exc:
        print(f"{kind}: skipped, {exc}")
        return None
    try:
        bench = build_bench(kind, opened, args)
        run_rounds(bench, args.ops, args.rounds)
        if args.split and kind == "redis":
            split_redis(opened.store, opened.url, args.ops, args.rounds, args.ttl)
        elif args.split and kind in ("postgres", "sqlite", "mysql"):
            split_sql(opened.store, args.ops, args.rounds, args.ttl)
        if args.profile:
            print(f"\n--- profile of {args.ops} claim+complete pairs on {kind}")
            profile_claims(opened.store, args.ops, args.ttl)
    finally:
        close_all(opened.cleanup)
    print(f"{kind}: measured in {time.perf_counter() - started:.1f} s")
    return bench


def _stop_on_sigterm(signum: int, _frame: object) -> None:
    # SystemExit unwinds through the finally blocks that stop the servers
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    print(f"celery-leases store benchmark: {machine_line()}")
    print(
        f"{args.ops} operations per case per round, {args.rounds} rounds, batch of {args.batch}, "
        f"redis appendfsync {args.redis_appendfsync} (Lock also on "
        f"{args.lock_appendfsync or args.redis_appendfsync}), "
        f"postgres pre-ping {args.postgres_pre_ping}"
    )
    benches = [b for b in (bench_one(kind, args) for kind in args.kinds) if b is not None]
    if not benches:
        print("no store could be measured")
        return 1
    print_rates(benches)
    rows = print_ratios(benches)
    print(f"finished: {machine_line()}")
    if args.json is not None:
        report = {
            "machine": machine_line(),
            "options": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "rates": {b.kind: {case: b.rate(case) for case in b.cases} for b in benches},
            "ratios": rows,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    missed = [row for row in rows if row["result"] == "MISS"]
    return 1 if missed and args.fail_on_miss else 0


if __name__ == "__main__":
    sys.exit(main())
