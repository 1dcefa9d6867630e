"""Benchmark: celery-leases beside plain Celery, a two-round-trip floor and other lock libraries.

Run it from the repository root (``pip install -e '.[dev,bench]'`` first)::

    .venv/bin/python bench/peers.py                     # everything, about 20 minutes
    .venv/bin/python bench/peers.py --quick             # a smoke profile, seconds

Every kind runs the same task (``bench/peer_tasks.py``) on a real ``celery
worker``, for each workload and pool. A repetition runs every kind once,
the kinds a target compares next to each other and to plain Celery, forwards
and backwards in turn (``peer_targets.run_order``); a kind's ratio in a repetition is
its throughput over plain Celery's in that repetition, and the table shows
the median ratio over the repetitions and its spread. Throughput is timed
from the first to the last result the backend holds (worker start-up is
left out). Worker CPU per task comes from ``/proc`` (the worker and its pool
children) over the same stretch, and so does the CPU of the two
redis-servers (the broker and result backend's, and the Redis store's; a
PostgreSQL or SQLite store's own work is not in it): on two cores the
servers' work per task takes its share of the CPU everyone else needs.
Store round trips per task come from a separate, untimed run per kind and
workload (solo pool) with ``MONITOR`` on the store: commands sent by
clients, not those a Lua script runs inside, are the round trips; ``INFO
commandstats`` of the timed runs gives all commands
per task. It writes the Markdown table and a PNG plot into ``docs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from peer_targets import ratios_to, run_order, target_lines  # noqa: E402
from peer_tasks import (  # noqa: E402
    GUARANTEE_NAMES,
    GUARANTEES,
    KINDS,
    create_sql_floor_table,
    make_app,
)
from proc_stat import CLK_TCK, cpu_ticks, stat_fields  # noqa: E402

WORKLOADS = {"trivial": (2000, 0.0), "50ms": (200, 0.05)}
#: kinds that cannot run in this benchmark, and why (shown in the table)
NOT_RUN: dict[str, str] = {}
#: the queues relier's README has its worker consume; its tasks go to "default"
RELIER_QUEUES = ("high_priority", "default", "low_priority", "re-queue")
#: the kinds whose store is SQL (no Redis round trips or commands to count)
SQL_KINDS = ("leases-postgres", "leases-sqlite", "floor-postgres", "floor-sqlite")
#: the dash of an empty cell or a range, in the Markdown
DASH = "\u2013"


@dataclass
class Result:
    kind: str
    workload: str
    pool: str
    repetition: int
    rate: float | None
    cpu_ms_per_task: float | None
    commands_per_task: float | None
    load: float
    error: str = ""
    #: CPU of the broker's and the Redis store's redis-server, ms per task
    redis_cpu_ms_per_task: float | None = None


@dataclass
class Servers:
    broker: Any
    store: Any
    postgres: Any
    sqlite_dir: Path

    def redis_cpu_seconds(self) -> float:
        """CPU seconds so far of the broker's and the store's redis-server."""
        return sum(_process_cpu_seconds(server.proc.pid) for server in (self.broker, self.store))

    def store_url(self, kind: str) -> str:
        if kind in ("leases-postgres", "floor-postgres"):
            return str(self.postgres.url)
        if kind == "leases-sqlite":
            return f"sqlite:///{self.sqlite_dir / 'leases.db'}"
        if kind == "floor-sqlite":
            return f"sqlite:///{self.sqlite_dir / 'floor.db'}"
        return str(self.store.url)


def _process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all its threads) of one process."""
    return cpu_ticks(stat_fields(pid)) / CLK_TCK


def _group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in the process group."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = stat_fields(entry.name)
        except OSError:
            continue
        if int(fields[2]) == pgid:  # the process group
            total += cpu_ticks(fields)
    return total / CLK_TCK


class _Monitor:
    """Counts the commands clients send to a Redis server (not those scripts run)."""

    STOP = "bench-monitor-stop"

    def __init__(self, url: str) -> None:
        self.url = url
        self.count = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _listen(self) -> None:
        client = redis.Redis.from_url(self.url)
        with client.monitor() as monitor:
            self._ready.set()
            while True:
                command = monitor.next_command()
                if self.STOP in command["command"]:
                    return
                if command["client_type"] != "lua":
                    self.count += 1

    def stop(self) -> int:
        redis.Redis.from_url(self.url).echo(self.STOP)
        self._thread.join(10)
        return self.count


def _stamps(backend: redis.Redis) -> list[float]:
    """When each finished task finished (a started task's entry has no date yet)."""
    metas = backend.mget(list(backend.scan_iter("celery-task-meta-*", count=1000)))
    done = [json.loads(raw)["date_done"] for raw in metas if raw is not None]
    return [datetime.fromisoformat(date).timestamp() for date in done if date]


def _done(backend: redis.Redis, tasks: int) -> int:
    """Finished tasks; entries are counted until there are enough, then read."""
    count = int(backend.dbsize())
    return count if count < tasks else len(_stamps(backend))


async def _apush(task: Any, tasks: int) -> None:
    """relier's own dispatch, ``apush`` (an admission check and an envelope per task)."""
    from relier.storage.redis import redis_manager

    try:
        for n in range(tasks):
            await task.apush(n)
    finally:
        await redis_manager.close()  # its client is bound to this event loop


def publish(
    kind: str, broker_url: str, store_url: str, queue: str, work: float, ttl: float, tasks: int
) -> str:
    """Send ``tasks`` tasks of ``kind`` to ``queue``; the queues its worker consumes."""
    # The publisher reads no results: on the Redis backend every send would
    # subscribe to its result's channel, and every dropped AsyncResult
    # unsubscribe, leaving the connection behind after the run
    client, task = make_app(
        kind, broker=broker_url, backend="disabled://", store=store_url,
        queue=queue, work=work, ttl=ttl,
    )  # fmt: skip
    queues = queue
    if kind == "relier":  # its own queues, emptied first as their names are fixed
        queues = ",".join(RELIER_QUEUES)
        redis.Redis.from_url(broker_url).delete(*RELIER_QUEUES)
        asyncio.run(_apush(task, tasks))  # one event loop (push starts one per task)
    else:
        with client.producer_or_acquire() as producer:
            for n in range(tasks):
                task.apply_async((n,), queue=queue, producer=producer)
    client.close()
    return queues


def worker_env(
    kind: str, broker_url: str, backend_url: str, store_url: str, queue: str,
    work: float, ttl: float, prefetch: int = 1,
) -> dict[str, str]:  # fmt: skip
    """The environment ``bench/peer_tasks.py`` reads its worker's app from."""
    return {
        **os.environ,
        "BENCH_KIND": kind, "BENCH_BROKER": broker_url, "BENCH_BACKEND": backend_url,
        "BENCH_STORE": store_url, "BENCH_QUEUE": queue, "BENCH_WORK": str(work),
        "BENCH_TTL": str(ttl), "BENCH_PREFETCH": str(prefetch),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(BENCH_DIR)]),
    }  # fmt: skip


def worker_args(pool: str, concurrency: int, queues: str, queue: str, log: Path) -> list[str]:
    """``python``'s arguments that start a quiet ``celery worker`` of ``peer_tasks``."""
    return [
        "-m", "celery", "-A", "peer_tasks", "worker",
        "--pool", pool, "-c", str(concurrency), "-Q", queues, "-n", f"{queue}@%h",
        "--without-mingle", "--without-gossip", "--without-heartbeat",
        "--loglevel", "WARNING", "--logfile", str(log),
    ]  # fmt: skip


def _run(
    servers: Servers, kind: str, workload: str, pool: str, concurrency: int,
    tasks: int, ttl: float, log_dir: Path, monitor: bool = False, profile: Path | None = None,
    prefetch: int = 1,
) -> tuple[float, float, float, int, float]:  # fmt: skip
    """One worker run: (tasks/s, worker CPU ms per task, store commands per task, trips,
    CPU ms per task of the broker's and the store's redis-server)."""
    work = WORKLOADS[workload][1]
    queue = f"peers-{kind}-{pool}-{time.monotonic_ns()}"
    broker_url = f"redis://127.0.0.1:{servers.broker.port}/0"
    backend_url = f"redis://127.0.0.1:{servers.broker.port}/1"
    store_url = servers.store_url(kind)
    backend = redis.Redis.from_url(backend_url)
    store = redis.Redis.from_url(servers.store.url)
    backend.flushdb()
    store.flushdb()
    store.config_resetstat()
    watcher = _Monitor(servers.store.url) if monitor else None
    if kind in ("floor-postgres", "floor-sqlite"):
        create_sql_floor_table(store_url)

    queues = publish(kind, broker_url, store_url, queue, work, ttl, tasks)
    env = worker_env(kind, broker_url, backend_url, store_url, queue, work, ttl, prefetch)
    log = log_dir / f"{queue}.log"
    worker = subprocess.Popen(
        [
            sys.executable, *(("-m", "cProfile", "-o", str(profile)) if profile else ()),
            *worker_args(pool, concurrency, queues, queue, log),
        ],
        cwd=BENCH_DIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    cpu_first = cpu_last = redis_first = redis_last = 0.0
    try:
        deadline = time.monotonic() + 60 + tasks * (work + 0.05)
        while (done := _done(backend, tasks)) < tasks:
            if done and not cpu_first:
                cpu_first = _group_cpu_seconds(worker.pid)
                redis_first = servers.redis_cpu_seconds()
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited with {worker.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {done} of {tasks} done in time; see {log}")
            time.sleep(0.02)
        cpu_last = _group_cpu_seconds(worker.pid)
        redis_last = servers.redis_cpu_seconds()
    finally:
        worker.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # no pool child outlives the run
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        trips = watcher.stop() if watcher else 0
    stats = store.info("commandstats")
    commands = sum(
        int(value["calls"])
        for name, value in stats.items()
        if name not in ("cmdstat_info", "cmdstat_config", "cmdstat_flushdb", "cmdstat_echo")
        and not name.startswith("cmdstat_monitor")
    )  # fmt: skip
    stamps = _stamps(backend)
    backend.close()
    store.close()
    seconds = max(stamps) - min(stamps)
    measured = len(stamps) - 1
    cpu_ms = (cpu_last - cpu_first) * 1000 / measured
    redis_ms = (redis_last - redis_first) * 1000 / measured
    return measured / seconds, cpu_ms, commands / tasks, trips, redis_ms


def _trips(
    servers: Servers, kind: str, workload: str, ttl: float, log_dir: Path, tasks: int
) -> float:
    """Round trips per task to the Redis store, from an untimed MONITOR run on solo."""
    _, _, _, trips, _ = _run(servers, kind, workload, "solo", 1, tasks, ttl, log_dir, monitor=True)
    return trips / tasks


def _ratios_to_plain(results: list[Result], kind: str, workload: str, pool: str) -> list[float]:
    """``kind``'s throughput over plain Celery's, in each repetition."""
    return ratios_to(results, kind, "plain", workload, pool)


def _cell(values: list[float], digits: int = 2) -> str:
    if not values:
        return DASH
    middle = statistics.median(values)
    return f"{middle:.{digits}f}"


def write_report(
    results: list[Result], trips: dict[tuple[str, str], float], args: argparse.Namespace,
    kinds: list[str], out: Path, command: str,
) -> None:  # fmt: skip
    """The Markdown table and the PNG plot."""
    loads = [r.load for r in results]
    lines = [
        "# Peers benchmark: results",
        "",
        "<!-- written by bench/peers.py: run it again rather than editing -->",
        "",
        "What these numbers mean and how they are taken: [Performance](performance.md#peers); "
        "what each library does: [Comparison](comparison.md).",
        "",
        "![throughput ratio to plain Celery, per kind and pool](peers.png)",
        "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC with `{command}`: "
        f"{os.cpu_count()} cores, load average {min(loads):.1f}{DASH}{max(loads):.1f} "
        f"(1 min, sampled before each run), Python {platform.python_version()}. "
        f"Each cell is the median of {args.repetitions} alternating repetitions; "
        "the spread is the lowest and highest per-repetition ratio.",
        "",
    ]
    head = (
        "| workload | kind | pool | ratio to plain | spread | CPU ms/task "
        "| trips/task | cmds/task | Redis CPU ms/task |"
    )
    for workload in args.workloads.split(","):
        tasks, work = WORKLOADS[workload]
        tasks = args.tasks or tasks
        lines += [
            f"### {tasks} tasks of {work * 1000:g} ms, ttl {_ttl(args, workload):g} s",
            "",
            head,
            "|---|---|---|---:|---|---:|---:|---:|---:|",
        ]
        for kind in kinds:
            if kind in NOT_RUN:
                skipped = f"not run: {NOT_RUN[kind]}"
                lines.append(f"| {workload} | {kind} | {DASH} | {skipped} | | | | | |")
                continue
            for pool in args.pools.split(","):
                rows = [
                    r for r in results
                    if r.kind == kind and r.workload == workload and r.pool == pool
                ]  # fmt: skip
                ratios = _ratios_to_plain(results, kind, workload, pool)
                errors = [r.error for r in rows if r.error]
                spread = f"{min(ratios):.2f}{DASH}{max(ratios):.2f}" if ratios else ""
                if errors:
                    spread += f" ({len(errors)} failed: {errors[0][:60]})"
                cpu = _cell([r.cpu_ms_per_task for r in rows if r.cpu_ms_per_task is not None], 3)
                cmds = _cell([r.commands_per_task for r in rows if r.commands_per_task is not None])
                servers_cpu = [r.redis_cpu_ms_per_task for r in rows]
                redis_cpu = _cell([c for c in servers_cpu if c is not None], 3)
                trip = trips.get((kind, workload))
                trip_cell = f"{trip:.2f}" if trip is not None else DASH
                if kind in SQL_KINDS:
                    cmds, trip_cell = DASH, DASH
                lines.append(
                    f"| {workload} | {kind} | {pool} | {_cell(ratios)} | {spread} | {cpu} "
                    f"| {trip_cell} | {cmds} | {redis_cpu} |"
                )
        lines.append("")
    lines += target_lines(results, args.workloads.split(","), args.pools.split(","))
    lines += [
        "### What each kind guarantees",
        "",
        "| kind | " + " | ".join(GUARANTEE_NAMES) + " |",
        "|---|" + "---|" * len(GUARANTEE_NAMES),
    ]
    for kind in kinds:
        marks = " | ".join("yes" if g else "no" for g in GUARANTEES[kind])
        lines.append(f"| {kind} | {marks} |")
    (out / "peers.md").write_text("\n".join(lines) + "\n")
    _plot(results, args, kinds, out / "peers.png")


def _plot(results: list[Result], args: argparse.Namespace, kinds: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = args.workloads.split(",")
    pools = args.pools.split(",")
    shown = [k for k in kinds if k not in NOT_RUN]
    fig, axes = plt.subplots(len(workloads), 1, figsize=(10, 3.6 * len(workloads)), squeeze=False)
    width = 0.8 / len(pools)
    for ax, workload in zip(axes[:, 0], workloads, strict=True):
        for i, pool in enumerate(pools):
            values = [
                statistics.median(r) if (r := _ratios_to_plain(results, k, workload, pool)) else 0.0
                for k in shown
            ]
            ax.bar([x + i * width for x in range(len(shown))], values, width, label=pool)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([x + width * (len(pools) - 1) / 2 for x in range(len(shown))])
        ax.set_xticklabels(shown, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("throughput / plain")
        tasks, work = WORKLOADS[workload]
        ax.set_title(f"{tasks} tasks of {work * 1000:g} ms (median ratio to plain Celery)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _profile(servers: Servers, kinds: list[str], args: argparse.Namespace, log_dir: Path) -> None:
    """One cProfile'd worker per kind and pool (threads: the worker's own process)."""
    import pstats

    workload = args.workloads.split(",")[0]
    tasks = args.tasks or WORKLOADS[workload][0]
    for pool in args.pools.split(","):
        for kind in kinds:
            path = log_dir / f"{kind}-{pool}.prof"
            rate, _, _, _, _ = _run(
                servers, kind, workload, pool, args.concurrency, tasks, _ttl(args, workload),
                log_dir, profile=path,
            )  # fmt: skip
            print(f"== {kind} on {pool}: {rate:.0f} tasks/s under the profiler ({path})")
            stats = pstats.Stats(str(path))
            stats.sort_stats("tottime").print_stats(18)


def _ttl(args: argparse.Namespace, workload: str) -> float:
    return float(args.ttl if workload == "trivial" else args.short_ttl)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds (all)")
    parser.add_argument("--workloads", default="trivial,50ms", help="trivial,50ms")
    parser.add_argument("--pools", default="prefork,threads,solo")
    parser.add_argument("-c", "--concurrency", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--tasks", type=int, help="tasks per run (2000 trivial, 200 of 50 ms)")
    parser.add_argument(
        "--trivial-tasks", type=int, default=2000, help="tasks per run of the trivial workload"
    )
    parser.add_argument("--ttl", type=float, default=30.0, help="lease ttl, trivial workload")
    parser.add_argument(
        "--short-ttl", type=float, default=0.3, help="lease ttl of the 50 ms workload (renewals)"
    )
    parser.add_argument(
        "--prefetch-multiplier", type=int, default=1,
        help="the workers' worker_prefetch_multiplier (1)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs", help="docs/")
    parser.add_argument(
        "--quick", action="store_true",
        help="smoke profile: 20 trivial tasks, solo, plain/leases-redis/floor, one repetition",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="instead: run each kind once per pool under cProfile and print where time goes",
    )  # fmt: skip
    args = parser.parse_args(argv)
    WORKLOADS["trivial"] = (args.trivial_tasks, 0.0)
    if args.quick:
        args.kinds, args.workloads, args.pools = "plain,leases-redis,floor", "trivial", "solo"
        args.repetitions, args.tasks = 1, args.tasks or 20
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if "plain" not in kinds:
        kinds.insert(0, "plain")
    runnable = [k for k in kinds if k not in NOT_RUN]
    command = "python bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:])

    from tests.servers import PostgresServer, RedisServer

    # SIGTERM unwinds like Ctrl-C, so the workers and servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    broker = RedisServer("--appendonly", "no")
    store = RedisServer("--appendfsync", "everysec")
    postgres = PostgresServer() if any(k.endswith("-postgres") for k in kinds) else None
    servers = Servers(broker, store, postgres, log_dir)
    results: list[Result] = []
    trips: dict[tuple[str, str], float] = {}
    if args.profile:
        try:
            _profile(servers, runnable, args, log_dir)
        finally:
            broker.close()
            store.close()
            if postgres is not None:
                postgres.close()
        return 0
    try:
        for workload in args.workloads.split(","):
            tasks = args.tasks or WORKLOADS[workload][0]
            ttl = _ttl(args, workload)
            work = WORKLOADS[workload][1]
            for kind in runnable:
                if kind not in SQL_KINDS:
                    trips[kind, workload] = _trips(
                        servers, kind, workload, ttl, log_dir, min(tasks, 40 if work else 200)
                    )
            for pool in args.pools.split(","):
                for rep in range(args.repetitions):
                    for kind in run_order(runnable, rep):
                        load = os.getloadavg()[0]
                        try:
                            rate, cpu, cmds, _, redis_cpu = _run(
                                servers, kind, workload, pool, args.concurrency, tasks, ttl,
                                log_dir, prefetch=args.prefetch_multiplier,
                            )  # fmt: skip
                            result = Result(
                                kind, workload, pool, rep, rate, cpu, cmds, load, "", redis_cpu
                            )
                        except RuntimeError as exc:
                            result = Result(kind, workload, pool, rep, None, None, None, load,
                                            str(exc))  # fmt: skip
                        results.append(result)
                        shown = f"{result.rate:8.0f}/s" if result.rate else "  FAILED"
                        print(f"  {workload:7} {pool:8} {rep} {kind:17} {shown}  load "
                              f"{load:.1f} {result.error}", flush=True)  # fmt: skip
    finally:
        broker.close()
        store.close()
        if postgres is not None:
            postgres.close()
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(results, trips, args, kinds, args.out, command)
    (log_dir / "peers.json").write_text(json.dumps([r.__dict__ for r in results], indent=1) + "\n")
    print((args.out / "peers.md").read_text())
    print(f"per-run numbers: {log_dir / 'peers.json'}")
    return 0 if all(r.rate for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
