"""Benchmark: the instructions a task costs, counted by cachegrind instead of timed.

Run it from the repository root (``pip install -e '.[dev,bench]'`` and
``apt-get install valgrind`` first)::

    .venv/bin/python bench/instructions.py              # about 10 minutes
    .venv/bin/python bench/instructions.py --quick      # a smoke profile, about 30 s

On a shared machine a second of CPU stretches with the host's load (the
worker's CPU per task of one kind moved by a third within two minutes on
the machine of docs/performance.md), so a difference of 2% between two
kinds is below what timing resolves. The instructions a process executes
do not depend on the load. For each kind this script runs a solo ``celery
worker`` of ``bench/peer_tasks.py`` under ``valgrind --tool=cachegrind``,
beside a Redis store's ``redis-server`` under it too, once with ``--small``
tasks and once with ``--large``: the difference of the two counts, over the
difference of tasks, is what one task costs each process, start-up and
shutdown left out. The broker's and result backend's redis-server runs
natively; it does the same for every kind. The store's server runs with
``--hz 1`` so that its idle timer adds almost nothing to a longer run.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from peers import publish, worker_args, worker_env  # noqa: E402

from tests.servers import RedisServer  # noqa: E402

#: the kinds this script can count: a worker, and a Redis store or none
KINDS = ("plain", "plain-acks-late", "floor", "leases-redis")
#: seconds a counted worker may take for its tasks (valgrind is about 50 times slower)
WAIT = 1800.0


def _counted(out: Path) -> tuple[str, ...]:
    """The valgrind prefix that counts a process's instructions into ``out``."""
    return ("valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}")


def _instructions(out: Path) -> int:
    """The instructions cachegrind counted (its ``summary:`` line)."""
    found = re.search(r"^summary:\s+(\d+)", out.read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no summary in {out}")
    return int(found[1])


def count(kind: str, tasks: int, broker_port: int, folder: Path) -> tuple[int, int]:
    """Instructions of a solo worker running ``tasks`` tasks of ``kind``, and of its store."""
    folder.mkdir(parents=True)
    # the peers benchmark's store (AOF, ``everysec``); ``--hz 1``: its idle
    # timer adds almost nothing to the longer run
    store = RedisServer(
        "--appendfsync", "everysec", "--hz", "1", prefix=_counted(folder / "store.cg")
    )
    broker_url = f"redis://127.0.0.1:{broker_port}/0"
    backend_url = f"redis://127.0.0.1:{broker_port}/1"
    store_url = store.url
    backend = redis.Redis.from_url(backend_url)
    backend.flushdb()
    queue = f"instructions-{kind}-{time.monotonic_ns()}"
    try:
        queues = publish(kind, broker_url, store_url, queue, 0.0, 30.0, tasks)
        worker = subprocess.Popen(
            [
                *_counted(folder / "worker.cg"), sys.executable,
                *worker_args("solo", 1, queues, queue, folder / "worker.log"),
            ],
            cwd=BENCH_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=worker_env(kind, broker_url, backend_url, store_url, queue, 0.0, 30.0),
        )  # fmt: skip
        try:
            deadline = time.monotonic() + WAIT
            while int(backend.dbsize()) < tasks:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not finish; see {folder}")
                time.sleep(0.2)
        finally:
            worker.send_signal(signal.SIGTERM)  # a warm shutdown writes the count
            worker.wait(timeout=WAIT)
    finally:
        store.close()  # a clean shutdown (SIGTERM) writes the count
        backend.close()
    return _instructions(folder / "worker.cg"), _instructions(folder / "store.cg")


def per_task(
    kind: str, small: int, large: int, broker_port: int, folder: Path
) -> tuple[float, float]:
    """Instructions one task costs the worker and the store: two runs' difference."""
    worker_small, store_small = count(kind, small, broker_port, folder / f"{kind}-{small}")
    worker_large, store_large = count(kind, large, broker_port, folder / f"{kind}-{large}")
    tasks = large - small
    return (worker_large - worker_small) / tasks, (store_large - store_small) / tasks


def table(results: dict[str, list[tuple[float, float]]]) -> str:
    """The Markdown table: per kind, the medians over the rounds and their spread."""
    lines = [
        "| kind | worker, instructions per task | store's redis-server | both | rounds |",
        "|---|---:|---:|---:|---|",
    ]
    for kind, rounds in results.items():
        worker = statistics.median(w for w, _ in rounds)
        store = statistics.median(s for _, s in rounds)
        totals = [w + s for w, s in rounds]
        spread = f"{min(totals):,.0f}\u2013{max(totals):,.0f}" if len(rounds) > 1 else "one"
        both = statistics.median(totals)
        lines.append(f"| {kind} | {worker:,.0f} | {store:,.0f} | {both:,.0f} | {spread} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="plain-acks-late,floor,leases-redis",
                        help=f"comma-separated, of {', '.join(KINDS)}")  # fmt: skip
    parser.add_argument("--small", type=int, default=100, help="tasks of the shorter run")
    parser.add_argument("--large", type=int, default=1100, help="tasks of the longer run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every kind")
    parser.add_argument(
        "--quick", action="store_true", help="smoke: leases-redis, 5 and 25 tasks, 1 round"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.kinds, args.small, args.large, args.rounds = "leases-redis", 5, 25, 1
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"cannot count {', '.join(unknown)}: only {', '.join(KINDS)}")
    if not 0 < args.small < args.large:
        parser.error("--small must be above 0 and below --large")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (apt-get install valgrind)")
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python bench/instructions.py", *given])

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    folder = Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    broker = RedisServer("--appendonly", "no")
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    try:
        for round_ in range(args.rounds):
            for kind in kinds:
                worker, store = per_task(
                    kind, args.small, args.large, broker.port, folder / str(round_)
                )
                results[kind].append((worker, store))
                print(f"  {round_} {kind:16} worker {worker:12,.0f}  store {store:10,.0f}",
                      flush=True)  # fmt: skip
    finally:
        broker.close()
    print(
        f"\nCounted with `{command}`: a solo worker, {args.large} and {args.small} tasks of "
        f"0 ms, {args.rounds} round(s); Python {platform.python_version()}, "
        f"{os.cpu_count()} cores.\n"
    )
    print(table(results))
    print(f"\ncachegrind files and logs: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
