"""Benchmark: a worker's CPU per task, leased against the floor, without the worker around it.

Run it from the repository root::

    .venv/bin/python bench/trace.py
    .venv/bin/python bench/trace.py --rounds 9 --tasks 2000 --profile

Real workers on a shared machine give throughput ratios whose spread is
wider than the gaps worth finding (see ``bench/peers.py``). This runs the
part of a worker that differs between the kinds, Celery's task tracer (the
function a pool calls for each message), in one process, in a loop, and
reads the process's CPU time: the leased task (``LeasedTask`` on the Redis
store), the floor (``bench/peer_tasks.FloorTask``: one claim script and one
complete script by ``EVALSHA``, nothing else) and a plain task, each with
``acks_late`` and ``ignore_result``, against one throwaway redis-server
(``appendfsync everysec``). The broker and result backend are Celery's
in-memory ones and are not touched by the tracer.

Kinds alternate within each round; the medians of the rounds are printed,
with the leased task's CPU beyond the floor's. ``--profile`` then runs the
leased task under cProfile and prints the library's functions by own time.
The CPU of the redis-server is not counted (``bench/peers.py`` shows it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path[:0] = [str(REPO_ROOT), str(BENCH_DIR)]

from celery import Celery  # noqa: E402
from celery.app.trace import build_tracer  # noqa: E402
from celery.signals import worker_init  # noqa: E402

from celery_leases import LeasedTask  # noqa: E402

KINDS = ("plain", "floor", "leased")


class _Worker:
    """What ``worker_init`` receivers read of a worker: its app, and ``-E``."""

    task_events = False

    def __init__(self, app: Celery) -> None:
        self.app = app


def _tracers(store_url: str) -> dict[str, Any]:
    import peer_tasks

    app = Celery("bench-trace", broker="memory://", backend="cache+memory://")
    app.conf.update(
        task_acks_late=True,
        task_ignore_result=True,
        leases_store=store_url,
        leases_ttl=30,
        leases_store_options={"prefix": "bench:"},
    )
    floor_base = type(
        "Floor", (peer_tasks.FloorTask,), {"floor_url": store_url, "floor_ttl_ms": 30000}
    )

    def body(n: int) -> int:
        return n

    tasks = {
        "plain": app.task(name="bench.plain", shared=False)(body),
        "floor": app.task(name="bench.floor", shared=False, base=floor_base)(body),
        "leased": app.task(name="bench.leased", shared=False, base=LeasedTask)(body),
    }
    app.finalize()
    # what a worker sends before its pool starts (without -E), so the library
    # reads its settings as it does in a worker
    worker_init.send(sender=_Worker(app))
    return {
        kind: build_tracer(task.name, task, app=app, hostname="bench@trace", eager=False)
        for kind, task in tasks.items()
    }


def _run(tracer: Any, kind: str, tasks: int) -> float:
    """CPU µs per task of ``tasks`` traced runs (the process's CPU, all threads)."""
    started = time.process_time()
    for n in range(tasks):
        task_id = str(uuid.uuid4())
        request = {
            "id": task_id, "task": f"bench.{kind}", "args": (n,), "kwargs": {},
            "delivery_info": {"exchange": "", "routing_key": "celery", "redelivered": False},
            "hostname": "bench@trace", "is_eager": False, "correlation_id": task_id,
            "ignore_result": True,
        }  # fmt: skip
        retval, info, _, _ = tracer(task_id, (n,), {}, request)
        if retval != n:
            raise RuntimeError(f"{kind} task {n} returned {retval!r} ({info!r})")
    return (time.process_time() - started) / tasks * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per kind per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="then profile the leased task")
    args = parser.parse_args(argv)

    from tests.servers import RedisServer

    server = RedisServer("--appendfsync", "everysec")
    try:
        tracers = _tracers(server.url)
        for kind in KINDS:  # warm up: connections, scripts loaded, imports
            _run(tracers[kind], kind, min(args.tasks, 200))
        cpu: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for rnd in range(args.rounds):
            shift = rnd % len(KINDS)
            for kind in KINDS[shift:] + KINDS[:shift]:
                cpu[kind].append(_run(tracers[kind], kind, args.tasks))
        print(f"CPU µs per task, median of {args.rounds} rounds of {args.tasks} (min..max)")
        for kind in KINDS:
            values = cpu[kind]
            print(
                f"  {kind:8s} {statistics.median(values):8.1f}"
                f"  ({min(values):.1f}..{max(values):.1f})"
            )
        beyond = [lease - floor for lease, floor in zip(cpu["leased"], cpu["floor"], strict=True)]
        print(
            f"  leased beyond the floor, per round: median {statistics.median(beyond):+.1f}"
            f"  ({min(beyond):+.1f}..{max(beyond):+.1f})"
        )
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            _run(tracers["leased"], "leased", args.tasks)
            profiler.disable()
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats("celery_leases", 25)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
