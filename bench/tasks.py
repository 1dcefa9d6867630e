"""Benchmark: throughput of a trivial leased task against a plain Celery task.

Run it from the repository root::

    .venv/bin/python bench/tasks.py --tasks 2000

It starts two throwaway redis-servers (broker + result backend, and the lease
store, so the store's command count is clean), then for each pool (prefork,
threads, solo; same ``-c``) alternates plain and leased runs. Each run loads
the queue first, starts a real ``celery worker``, and times the stretch from
the first to the last result written (the worker's start-up is left out).
It prints tasks/s per kind, the leased/plain ratio beside its target, and
the lease store's round trips per leased task from ``INFO commandstats``:
script calls, since every store operation is one script (claim + complete
≈ 2; renewals are batched and rare for tasks this short), and all commands
including those the scripts run.

This file is also the worker's app: the worker imports it as ``tasks``
(``celery -A tasks worker`` run inside ``bench/``), configured from
``BENCH_*`` environment variables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import redis
from celery import Celery

from celery_leases import LeasedTask

if TYPE_CHECKING:
    from tests.servers import RedisServer

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

PLAIN = "bench.plain"
LEASED = "bench.leased"

#: the leased/plain throughput each pool should reach
TARGETS = {"prefork": 0.93, "threads": 0.75, "solo": 0.75}


def make_app() -> Celery:
    """The benchmark app, configured from ``BENCH_*`` environment variables."""
    broker = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0")
    bench_app = Celery("bench", broker=broker, backend=os.environ.get("BENCH_BACKEND", broker))
    bench_app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
        broker_connection_retry_on_startup=True,
        leases_store=os.environ.get("BENCH_STORE", "memory://"),
        leases_store_options={"prefix": "bench:"},
        leases_ttl=float(os.environ.get("BENCH_TTL", "30")),
    )

    @bench_app.task(name=PLAIN, shared=False)
    def plain() -> int:
        return 1

    @bench_app.task(name=LEASED, base=LeasedTask, shared=False)
    def leased() -> int:
        return 1

    return bench_app


app = make_app()


# --- the driver ---------------------------------------------------------------


@dataclass
class Run:
    pool: str
    kind: str
    tasks: int
    seconds: float
    store_commands: dict[str, int]

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds

    @property
    def scripts_per_task(self) -> float:
        """Store round trips per task: every store operation is one script."""
        return sum(self.store_commands.get(name, 0) for name in _SCRIPT_COMMANDS) / self.tasks

    @property
    def commands_per_task(self) -> float:
        """All store commands per task, including those run inside scripts."""
        return sum(self.store_commands.values()) / self.tasks


def _redis_servers(store_appendfsync: str) -> tuple[RedisServer, RedisServer]:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from tests.servers import RedisServer

    # the broker needs no persistence here; the store keeps the AOF the docs
    # ask for, with the chosen fsync policy (later arguments win)
    broker = RedisServer("--appendonly", "no")
    store = RedisServer("--appendfsync", store_appendfsync)
    return broker, store


#: commands that run a whole Lua script in one round trip; the commands a
#: script runs inside are counted by INFO commandstats as well
_SCRIPT_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


def _store_commands(client: redis.Redis) -> dict[str, int]:
    """Commands the server ran since CONFIG RESETSTAT, minus our own probes."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name not in ("cmdstat_info", "cmdstat_config", "cmdstat_flushdb")
    }


def _run_once(
    *,
    pool: str,
    kind: str,
    tasks: int,
    concurrency: int,
    broker_url: str,
    backend_url: str,
    store_url: str,
    ttl: float,
    log_dir: Path,
) -> Run:
    queue = f"bench-{pool}-{kind}-{time.monotonic_ns()}"
    env = {
        **os.environ,
        "BENCH_BROKER": broker_url,
        "BENCH_BACKEND": backend_url,
        "BENCH_STORE": store_url,
        "BENCH_QUEUE": queue,
        "BENCH_TTL": str(ttl),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(BENCH_DIR)]),
    }
    backend = redis.Redis.from_url(backend_url)
    store = redis.Redis.from_url(store_url)
    backend.flushdb()
    store.flushdb()

    client = Celery("bench-client", broker=broker_url, backend=backend_url)
    client.conf.broker_connection_retry_on_startup = True
    name = LEASED if kind == "leased" else PLAIN
    with client.producer_or_acquire() as producer:
        for _ in range(tasks):
            client.send_task(name, queue=queue, producer=producer)
    client.close()

    store.config_resetstat()
    log = log_dir / f"{queue}.log"
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "celery", "-A", "tasks", "worker",
            "--pool", pool, "-c", str(concurrency), "-Q", queue,
            "-n", f"{queue}@%h",
            "--without-mingle", "--without-gossip", "--without-heartbeat",
            "--loglevel", "WARNING", "--logfile", str(log),
        ],
        cwd=BENCH_DIR,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + max(120.0, tasks / 20)
        while backend.dbsize() < tasks:
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited with {worker.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{pool}/{kind}: only {backend.dbsize()} of {tasks} done")
            time.sleep(0.05)
    finally:
        worker.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=30)
        # the worker leads its own process group: no pool child outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    commands = _store_commands(store)

    done = []
    keys = list(backend.scan_iter("celery-task-meta-*", count=1000))
    for raw in backend.mget(keys):
        if raw is None:
            continue
        meta = json.loads(raw)
        done.append(datetime.fromisoformat(meta["date_done"]).timestamp())
    if len(done) < 2:
        raise RuntimeError(f"{pool}/{kind}: {len(done)} results, need at least 2")
    backend.close()
    store.close()
    seconds = max(done) - min(done)
    return Run(pool, kind, len(done) - 1, seconds, commands)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Throughput of a trivial leased task vs a plain Celery task, per pool."
    )
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per run (2000)")
    parser.add_argument(
        "--pools", default="prefork,threads,solo", help="comma-separated pools (all three)"
    )
    parser.add_argument("-c", "--concurrency", type=int, default=2, help="pool size (2)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="plain/leased pairs per pool, alternated (2)"
    )
    parser.add_argument("--ttl", type=float, default=30.0, help="lease TTL in seconds (30)")
    parser.add_argument(
        "--store-appendfsync",
        choices=("always", "everysec"),
        default="everysec",
        help="AOF fsync policy of the store's redis-server (everysec, the Redis default)",
    )
    parser.add_argument(
        "--show-commands",
        action="store_true",
        help="also print each leased run's store commands per task, by command",
    )
    args = parser.parse_args(argv)

    broker, store = _redis_servers(args.store_appendfsync)
    runs: list[Run] = []
    try:
        log_dir = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
        port = broker.port
        for pool in args.pools.split(","):
            for _ in range(args.rounds):
                for kind in ("plain", "leased"):
                    run = _run_once(
                        pool=pool,
                        kind=kind,
                        tasks=args.tasks,
                        concurrency=args.concurrency,
                        broker_url=f"redis://127.0.0.1:{port}/0",
                        backend_url=f"redis://127.0.0.1:{port}/1",
                        store_url=store.url,
                        ttl=args.ttl,
                        log_dir=log_dir,
                    )
                    runs.append(run)
                    print(f"  {pool:8} {kind:7} {run.rate:8.0f} tasks/s", flush=True)
    finally:
        broker.close()
        store.close()

    print()
    print(
        f"{args.tasks} tasks per run, -c {args.concurrency}, {args.rounds} rounds, "
        f"alternated; store appendfsync {args.store_appendfsync}"
    )
    header = ("pool", "plain/s", "leased/s", "ratio", "target", "trips/task", "cmds/task")
    print("{:8} {:>9} {:>9} {:>6} {:>7} {:>11} {:>10}".format(*header))
    for pool in args.pools.split(","):
        plain = [r for r in runs if r.pool == pool and r.kind == "plain"]
        leased = [r for r in runs if r.pool == pool and r.kind == "leased"]
        plain_rate = sum(r.tasks for r in plain) / sum(r.seconds for r in plain)
        leased_rate = sum(r.tasks for r in leased) / sum(r.seconds for r in leased)
        ratio = leased_rate / plain_rate
        trips = statistics.mean(r.scripts_per_task for r in leased)
        commands = statistics.mean(r.commands_per_task for r in leased)
        target = TARGETS.get(pool, 0.0)
        verdict = "ok" if ratio >= target else "BELOW"
        print(
            f"{pool:8} {plain_rate:9.0f} {leased_rate:9.0f} {ratio:6.2f} "
            f"{'>=' + format(target, '.2f'):>7} {trips:11.2f} {commands:10.2f}  {verdict}"
        )
        if args.show_commands:
            for run in leased:
                counts = ", ".join(
                    f"{name} {calls / run.tasks:.2f}"
                    for name, calls in sorted(run.store_commands.items())
                )
                print(f"{'':8} store commands per task: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
