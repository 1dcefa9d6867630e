"""Claims per second from many processes at once, and where the CPU goes.

N client processes each claim and complete distinct jobs on one store for a
fixed time; the script compares N = 8 with N = 16 (``--processes``) in
alternating repetitions and reports the median claims per second of each and
their ratio. Beside each run it samples, from ``/proc``, how busy the
machine's cores were and how that time was split between the database
server's processes and the clients: when the cores are saturated and the
server gets the same share at both sizes, more processes cannot make more
claims, and the limit is the machine, not the store.

The script starts its own throwaway PostgreSQL and redis-server (from
``tests/servers.py``) and always stops them. Run it from the repository root::

    .venv/bin/python bench/concurrency.py
    .venv/bin/python bench/concurrency.py --stores postgres --seconds 8 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proc_stat import cpu_ticks, stat_fields  # noqa: E402 - beside this file

from celery_leases.stores import open_store  # noqa: E402 - needs ROOT on sys.path
from tests.servers import PostgresServer, RedisServer  # noqa: E402


def _claimer(url: str, seconds: float, start: float, counts: multiprocessing.Queue[int]) -> None:
    """Claim and complete distinct jobs from ``start`` for ``seconds``; put the count."""
    store = open_store(url)
    prefix = uuid.uuid4().hex[:8]
    while time.time() < start:
        time.sleep(0.001)
    done, end = 0, start + seconds
    while time.time() < end:
        job = f"c-{prefix}-{done}"
        claim = store.claim(job, owner=prefix, ttl=30, task_name="bench")
        store.complete(job, owner=prefix, generation=claim.generation)  # type: ignore[union-attr]
        done += 1
    store.close()
    counts.put(done)


def _cpu_ticks(pids: list[int]) -> int:
    """utime + stime of ``pids`` (ticks), the ones that have exited counting 0."""
    total = 0
    for pid in pids:
        try:
            total += cpu_ticks(stat_fields(pid))
        except OSError:
            continue
    return total


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) ticks of all cores since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclass
class Run:
    processes: int
    claims_per_s: float
    busy: float  # share of all cores' time that was busy
    server: float  # share of all cores' time used by the database server
    clients: float  # share used by the client processes


def one_run(url: str, processes: int, seconds: float, server_pids: Callable[[], list[int]]) -> Run:
    context = multiprocessing.get_context("spawn")
    counts: multiprocessing.Queue[int] = context.Queue()
    start = time.time() + 3.0  # every process has opened its store by then
    workers = [
        context.Process(target=_claimer, args=(url, seconds, start, counts))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    while time.time() < start:
        time.sleep(0.005)
    client_pids = [w.pid for w in workers if w.pid is not None]
    servers = server_pids()
    busy0, total0 = _machine_ticks()
    server0, clients0 = _cpu_ticks(servers), _cpu_ticks(client_pids)
    time.sleep(seconds * 0.9)
    busy1, total1 = _machine_ticks()
    server1, clients1 = _cpu_ticks(server_pids()), _cpu_ticks(client_pids)
    claims = sum(counts.get(timeout=seconds + 60) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
    total = max(total1 - total0, 1)
    return Run(
        processes,
        claims / seconds,
        (busy1 - busy0) / total,
        max(server1 - server0, 0) / total,
        (clients1 - clients0) / total,
    )


def _children(pid: int) -> list[int]:
    """``pid`` and every process below it (PostgreSQL forks one per connection)."""
    found = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int(stat_fields(entry.name)[1])
            except OSError:
                continue
            if parent == pid:
                found.append(int(entry.name))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="postgres,redis", help="postgres, redis (default both)")
    parser.add_argument("--processes", default="8,16", help="the two sizes (default 8,16)")
    parser.add_argument("--seconds", type=float, default=6.0, help="claiming time per run")
    parser.add_argument("--rounds", type=int, default=5, help="alternating repetitions")
    args = parser.parse_args(argv)
    small, large = (int(n) for n in args.processes.split(","))
    print(f"load average before: {os.getloadavg()[0]:.2f}, cores: {os.cpu_count()}")
    for kind in [k.strip() for k in args.stores.split(",") if k.strip()]:
        if kind == "postgres":
            pg = PostgresServer()
            url, stop = pg.url, pg.stop
            postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])

            def server_pids(postmaster: int = postmaster) -> list[int]:
                return _children(postmaster)
        else:
            redis = RedisServer()
            url, stop = redis.url, redis.stop

            def server_pids(redis: RedisServer = redis) -> list[int]:
                return [redis.proc.pid] if redis.proc else []  # type: ignore[list-item]

        try:
            runs: dict[int, list[Run]] = {small: [], large: []}
            for round_ in range(args.rounds):
                order = (small, large) if round_ % 2 == 0 else (large, small)
                for processes in order:
                    runs[processes].append(one_run(url, processes, args.seconds, server_pids))
        finally:
            stop()
        print(f"\n{kind}: {args.rounds} alternating rounds of {args.seconds:g} s")
        print("| processes | claims/s (median) | range | cores busy | server | clients |")
        print("|---|---|---|---|---|---|")
        for processes in (small, large):
            rs = runs[processes]
            rates = [r.claims_per_s for r in rs]
            print(
                f"| {processes} | {statistics.median(rates):,.0f} | "
                f"{min(rates):,.0f}-{max(rates):,.0f} | "
                f"{statistics.median(r.busy for r in rs):.0%} | "
                f"{statistics.median(r.server for r in rs):.0%} | "
                f"{statistics.median(r.clients for r in rs):.0%} |"
            )
        base = statistics.median(r.claims_per_s for r in runs[small])
        if base == 0:
            print(f"{large} processes / {small} processes: no claim in the runs of {small}")
        else:
            ratio = statistics.median(r.claims_per_s for r in runs[large]) / base
            print(f"{large} processes / {small} processes: {ratio:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
