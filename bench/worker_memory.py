"""Benchmark: the memory a real threads worker spends per running leased task.

Run it from the repository root::

    .venv/bin/python bench/worker_memory.py                 # 1,000 tasks at once
    .venv/bin/python bench/worker_memory.py --tasks 500 --rounds 3
    .venv/bin/python bench/worker_memory.py --tasks 200 --trace   # where, by source line


Each round starts a throwaway redis-server (broker and lease store), then,
one after the other, two ``celery worker --pool threads -c N`` processes on
the same app module (this file): one whose task is a plain Celery task and
one whose task is a :class:`~celery_leases.LeasedTask` (ttl 60 s). Each
worker gets N tasks that all run at once and wait for a key in Redis; the
worker's resident memory (``VmRSS`` of its one process) is read once it is
idle and once every task runs. The figure per task is

    ((leased busy - leased idle) - (plain busy - plain idle)) / N

the memory a running task costs with a lease beyond what it costs in plain
Celery (its thread, request and message are in both). The idle gap (the
library's imports) is printed apart. The same difference is also split by
the kind of mapping its pages are in (``/proc/<pid>/smaps``): the threads'
stacks (anonymous mappings of the stack limit's size: how deep each task's
thread has reached), the heap and malloc's arenas (the objects), and files.

``--trim`` has each worker collect garbage and call glibc's ``malloc_trim(0)``
before each reading, so freed memory that malloc kept in its arenas (which
depends on how the threads' allocations happened to interleave) is not
counted.

``--trace`` runs both workers under ``tracemalloc`` instead and prints the
source lines whose live allocations grew more per running task in the leased
worker than in the plain one (what a running task keeps alive, by where it
was made; malloc's own overhead is not in it).

The worker imports this module as its app (``-A bench.worker_memory``); the
``BENCH_*`` environment variables say which task it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import redis  # noqa: E402
from celery import Celery  # noqa: E402

from celery_leases import LeasedTask  # noqa: E402

TASK_NAME = "bench.hold"
STARTED_KEY = "bench:started"
RELEASE_KEY = "bench:release"


def make_app() -> Celery:
    """The worker's app, from ``BENCH_BROKER``, ``BENCH_STORE`` and ``BENCH_LEASED``."""
    celery_app = Celery("bench-memory", broker=os.environ.get("BENCH_BROKER", "memory://"))
    celery_app.conf.update(
        leases_store=os.environ.get("BENCH_STORE", "memory://"),
        leases_ttl=60.0,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )
    side = os.environ.get("BENCH_SIDE")
    leased = os.environ.get("BENCH_LEASED") == "1"

    def hold(n: int) -> int:
        client = redis.Redis.from_url(side or "redis://127.0.0.1:6379/0")
        client.incr(STARTED_KEY)
        while not client.exists(RELEASE_KEY):
            time.sleep(1.0)  # 1,000 threads polling faster starve the heartbeat of the GIL
        client.close()
        return n

    if os.environ.get("BENCH_TRIM") == "1":
        signal.signal(TRIM_SIGNAL, lambda *_: _trim())
    trace = os.environ.get("BENCH_TRACE")
    if trace and tracemalloc.is_tracing():
        # Celery takes SIGUSR1 for itself; the handler runs in the main thread
        signal.signal(signal.SIGRTMIN, lambda *_: _dump(Path(trace)))

    options: dict[str, Any] = {"name": TASK_NAME, "acks_late": True}
    if leased:
        options["base"] = LeasedTask
    celery_app.task(**options)(hold)
    return celery_app


#: tells a worker to collect garbage and hand freed heap pages back (``--trim``)
TRIM_SIGNAL = signal.SIGRTMIN + 1


def _trim() -> None:
    """Collect garbage, then ask glibc to return every arena's free pages to the OS."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _dump(path: Path) -> None:
    """Write this process's ``tracemalloc`` snapshot to ``path`` (whole, by rename)."""
    part = path.with_suffix(".part")
    tracemalloc.take_snapshot().dump(str(part))
    part.rename(path)


app = make_app()


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


#: the kinds of mapping :func:`_rss_split_kb` sorts resident pages into
SPLIT = ("thread stacks", "heap and arenas", "files")


def _stack_kb() -> int:
    """The size of a new thread's stack mapping: the stack limit (glibc's default)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return 8192 if soft == resource.RLIM_INFINITY else soft // 1024


def _rss_split_kb(pid: int) -> dict[str, int]:
    """Resident KiB of ``pid`` by the kind of mapping (:data:`SPLIT`)."""
    split = dict.fromkeys(SPLIT, 0)
    stack_kb = _stack_kb()
    path, size = "", 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header
            path, size = (parts[5] if len(parts) > 5 else ""), 0
        elif parts[0] == "Size:":
            size = int(parts[1])
        elif parts[0] == "Rss:":
            if path and not path.startswith("["):
                kind = "files"
            elif path == "[stack]" or size == stack_kb:
                kind = "thread stacks"
            else:
                kind = "heap and arenas"
            split[kind] += int(parts[1])
    return split


def _settled_rss_kb(pid: int) -> int:
    """RSS once it stops growing (three reads 0.5 s apart within 64 KiB)."""
    reads = [_rss_kb(pid)]
    while len(reads) < 3 or max(reads[-3:]) - min(reads[-3:]) > 64:
        time.sleep(0.5)
        reads.append(_rss_kb(pid))
        if len(reads) > 60:
            break
    return reads[-1]


def _wait(probe: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


#: idle and busy RSS (KiB), the growth by kind of mapping, leases lost before busy was read
Measured = tuple[int, int, dict[str, int], int]


Traced = tuple[tracemalloc.Snapshot, tracemalloc.Snapshot]


def _snapshot(pid: int, path: Path) -> tracemalloc.Snapshot:
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGRTMIN)
    _wait(path.exists, 120, "the worker's tracemalloc snapshot")
    return tracemalloc.Snapshot.load(str(path))


def measure(
    server_url: str, db: int, *, leased: bool, tasks: int, trace: bool = False, trim: bool = False
) -> tuple[Measured, Traced | None]:
    """Start one worker, run ``tasks`` tasks at once; its idle and busy RSS in KiB,
    and the growth from idle to busy by the kind of mapping (and, with ``trace``,
    its idle and busy ``tracemalloc`` snapshots)."""
    broker = f"{server_url}/{db}"
    log = Path(f"/tmp/bench-worker-memory-{os.getpid()}-{int(leased)}.log")
    env = {
        **os.environ,
        "BENCH_BROKER": broker,
        "BENCH_STORE": f"{server_url}/{db + 1}",
        "BENCH_SIDE": f"{server_url}/{db + 2}",
        "BENCH_LEASED": "1" if leased else "0",
        "BENCH_TRACE": str(log.with_suffix(".trace")) if trace else "",
        "BENCH_TRIM": "1" if trim else "0",
        "PYTHONTRACEMALLOC": "1" if trace else "",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    side = redis.Redis.from_url(env["BENCH_SIDE"])
    side.delete(STARTED_KEY, RELEASE_KEY)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench.worker_memory", "worker",
         "--pool", "threads", "-c", str(tasks), "--loglevel", "WARNING",
         "--without-mingle", "--without-gossip", "--without-heartbeat", "--logfile", str(log)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = Celery("bench-client", broker=broker)
        _wait(lambda: client.control.ping(timeout=0.5) or False, 60, "the worker to start")
        if trim:
            os.kill(worker.pid, TRIM_SIGNAL)
        idle = _settled_rss_kb(worker.pid)
        idle_split = _rss_split_kb(worker.pid)
        traced = log.with_suffix(".trace")
        idle_trace = _snapshot(worker.pid, traced) if trace else None
        for n in range(tasks):
            client.send_task(TASK_NAME, args=(n,))
        _wait(lambda: int(side.get(STARTED_KEY) or 0) >= tasks, 600, f"{tasks} running tasks")
        if trim:
            os.kill(worker.pid, TRIM_SIGNAL)
        busy = _settled_rss_kb(worker.pid)
        busy_split = _rss_split_kb(worker.pid)
        busy_trace = _snapshot(worker.pid, traced) if trace else None
        lost = log.read_text(errors="replace").count("lease lost:") if log.exists() else 0
        side.set(RELEASE_KEY, "1")
        client.close()
        grew = {kind: busy_split[kind] - idle_split[kind] for kind in SPLIT}
        snapshots = None if idle_trace is None or busy_trace is None else (idle_trace, busy_trace)
        return (idle, busy, grew, lost), snapshots
    finally:
        worker.terminate()  # a warm shutdown; the tasks were told to end
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=30)
        worker.kill()  # nothing left to do once it exited
        worker.wait()
        side.close()


def _grown(snapshots: Traced) -> dict[tuple[str, int], int]:
    """Bytes of live memory by allocating line, busy minus idle."""
    idle, busy = snapshots
    return {
        (stat.traceback[0].filename, stat.traceback[0].lineno): stat.size_diff
        for stat in busy.compare_to(idle, "lineno")
    }


def _print_trace(plain: Traced, leased: Traced, tasks: int, lines: int) -> None:
    plain_grown, leased_grown = _grown(plain), _grown(leased)
    extra = {
        where: (leased_grown.get(where, 0) - plain_grown.get(where, 0)) / tasks
        for where in plain_grown.keys() | leased_grown.keys()
    }
    total = sum(extra.values())
    print(f"live Python memory a lease adds per running task: {total:.0f} bytes")
    print("bytes per task  where (the line that allocated it)")
    for (filename, lineno), size in sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:lines]:
        short = (
            os.path.relpath(filename, REPO_ROOT)
            if filename.startswith(str(REPO_ROOT))
            else filename
        )
        print(f"{size:14.0f}  {short}:{lineno}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000, help="tasks running at once")
    parser.add_argument("--rounds", type=int, default=1, help="rounds (each: plain, then leased)")
    parser.add_argument(
        "--trace", action="store_true",
        help="instead: one round under tracemalloc, the lines whose live memory grew most",
    )  # fmt: skip
    parser.add_argument(
        "--trim", action="store_true",
        help="have each worker collect garbage and malloc_trim(0) before each reading",
    )  # fmt: skip
    parser.add_argument("--lines", type=int, default=25, help="lines printed by --trace")
    args = parser.parse_args(argv)

    from tests.servers import RedisServer

    per_task: list[float] = []
    per_kind: dict[str, list[float]] = {kind: [] for kind in SPLIT}
    server = RedisServer()
    try:
        url = f"redis://127.0.0.1:{server.port}"
        if args.trace:
            _, plain_trace = measure(url, 0, leased=False, tasks=args.tasks, trace=True)
            _, leased_trace = measure(url, 4, leased=True, tasks=args.tasks, trace=True)
            assert plain_trace is not None
            assert leased_trace is not None
            _print_trace(plain_trace, leased_trace, args.tasks, args.lines)
            return 0
        for n in range(args.rounds):
            (plain_idle, plain_busy, plain_grew, _), _ = measure(
                url, 0, leased=False, tasks=args.tasks, trim=args.trim
            )
            (leased_idle, leased_busy, leased_grew, lost), _ = measure(
                url, 4, leased=True, tasks=args.tasks, trim=args.trim
            )
            extra = ((leased_busy - leased_idle) - (plain_busy - plain_idle)) / args.tasks
            print(
                f"round {n + 1}: plain idle {plain_idle} KiB busy {plain_busy} KiB "
                f"({(plain_busy - plain_idle) / args.tasks:.1f} KiB per task); leased idle "
                f"{leased_idle} KiB busy {leased_busy} KiB "
                f"({(leased_busy - leased_idle) / args.tasks:.1f} KiB per task); "
                f"a lease adds {extra:.1f} KiB per running task; imports add "
                f"{leased_idle - plain_idle} KiB"
            )
            if lost:
                # a lost lease's run is fenced out and its message published again
                print(f"round {n + 1} left out: {lost} leases were lost before busy was read")
                continue
            per_task.append(extra)
            for kind in SPLIT:
                per_kind[kind].append((leased_grew[kind] - plain_grew[kind]) / args.tasks)
    finally:
        server.close()
    if not per_task:
        print("no round held every lease")
        return 1
    print(f"median over {len(per_task)} rounds: {statistics.median(per_task):.1f} KiB per task")
    print(
        "of which (medians, KiB per task): "
        + ", ".join(f"{kind} {statistics.median(per_kind[kind]):.1f}" for kind in SPLIT)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
