"""Benchmark: one process holding 1 to 10,000 leases, renewed by its heartbeat.

Run it from the repository root::

    .venv/bin/python bench/held.py                       # 1, 100, 1000, 10000 leases
    .venv/bin/python bench/held.py --counts 1000 --ttl 3 --intervals 5

It starts a throwaway redis-server (AOF, ``appendfsync everysec``), claims
the leases through the Redis store, hands them to one
:class:`~celery_leases.heartbeat.Heartbeat` (the object a worker process
runs, driven here without Celery), lets it gather the leases (claimed one
after another, so due at scattered times) for two renew intervals, and then
watches it for a few more:

- round trips: ``renew_many`` calls per renew interval (each is one round
  trip to the one Redis node), and leases per call;
- renew latency: p50 and p99 of those calls;
- CPU: the process's CPU time over the window as a share of one core (the
  main thread only sleeps, so this is the heartbeat's deadline thread and its
  renewal threads, with redis-py);
- memory per held lease: what ``tracemalloc`` sees allocated by building
  the leases and adding them to the heartbeat;
- renewed in time: every lease's last accepted renewal is younger than one
  renew interval at the end, and none was lost;
- lost notice: the time from the store refusing one lease (released behind
  the heartbeat's back) to ``lease.lost`` turning true, what task code's
  next check raises on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from celery_leases.heartbeat import Heartbeat  # noqa: E402
from celery_leases.lease import Lease, make_owner  # noqa: E402
from celery_leases.settings import LeaseTiming  # noqa: E402
from celery_leases.stores import open_store  # noqa: E402
from celery_leases.stores.results import Acquired  # noqa: E402


class TimedStore:
    """The store, with every ``renew_many`` call counted and timed (nothing else changes)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.calls: list[tuple[float, int]] = []  # (seconds, leases)
        #: calls sent before this (monotonic) time are not counted
        self.counting_from = float("inf")
        self.renewed_at: dict[str, float] = {}

    def renew_many(self, requests: Any) -> Any:
        sent_at = time.monotonic()
        started = time.perf_counter()
        results = self._inner.renew_many(requests)
        now = time.monotonic()
        with self._lock:
            if sent_at >= self.counting_from:
                self.calls.append((time.perf_counter() - started, len(requests)))
            for request in requests:
                self.renewed_at[request.job_id] = now
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


#: renew intervals left out of the measurement, while the heartbeat gathers
#: the leases claimed at scattered times into one call
WARM_UP_INTERVALS = 2


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def measure(url: str, count: int, timing: LeaseTiming, intervals: int) -> dict[str, float]:
    store = open_store(url, prefix=f"held-{uuid.uuid4().hex[:6]}:")
    timed = TimedStore(store)
    owner = make_owner()
    claims: list[tuple[Acquired, float]] = []
    for n in range(count):
        started = time.monotonic()
        claim = store.claim(f"job-{n}", owner, timing.ttl)
        assert isinstance(claim, Acquired), claim
        claims.append((claim, started))

    heartbeat = Heartbeat()
    # start its thread before counting: a cost per process, not per lease
    starter = Lease(
        job_id="starter",
        owner=owner,
        generation=1,
        lease_until_ms=0,
        started_at=time.monotonic(),
        store=timed,
        timing=timing,
        task_name="bench.held",
    )
    heartbeat.add(starter)
    heartbeat.remove(starter)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    leases = [
        Lease(
            job_id=claim.job_id,
            owner=claim.owner,
            generation=claim.generation,
            lease_until_ms=claim.lease_until_ms,
            started_at=started,
            store=timed,
            timing=timing,
            task_name="bench.held",
        )
        for claim, started in claims
    ]
    for lease in leases:
        heartbeat.add(lease)
    per_lease = (tracemalloc.get_traced_memory()[0] - before) / count
    tracemalloc.stop()
    del claims

    # leases claimed one after another for a while are due at scattered
    # times; the heartbeat gathers them into one call within two intervals
    time.sleep(timing.renew_interval * WARM_UP_INTERVALS)
    cpu_before = time.process_time()
    window_start = timed.counting_from = time.monotonic()
    time.sleep(timing.renew_interval * intervals)
    window = time.monotonic() - window_start
    cpu = (time.process_time() - cpu_before) / window
    calls = list(timed.calls)
    now = time.monotonic()
    oldest = max(now - timed.renewed_at.get(lease.job_id, 0.0) for lease in leases)
    lost = sum(1 for lease in leases if lease.lost)

    # the store refuses one lease: how long until its holder knows
    victim = leases[0]
    store.release(victim.job_id, victim.owner, victim.generation)
    refused_at = time.monotonic()
    limit = refused_at + 3 * timing.renew_interval
    while not victim.lost and time.monotonic() < limit:
        time.sleep(0.001)
    notice = time.monotonic() - refused_at if victim.lost else float("nan")

    heartbeat.stop()
    store.close()
    latencies = [seconds for seconds, _ in calls] or [float("nan")]
    return {
        "leases": count,
        "trips_per_interval": len(calls) / (window / timing.renew_interval),
        "leases_per_call": statistics.mean(n for _, n in calls) if calls else 0.0,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": _percentile(latencies, 0.99) * 1000,
        "cpu_percent": cpu * 100,
        "bytes_per_lease": per_lease,
        "oldest_renewal_intervals": oldest / timing.renew_interval,
        "lost": lost,
        "lost_notice_ms": notice * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="1,100,1000,10000", help="leases held, per case")
    parser.add_argument("--ttl", type=float, default=3.0, help="lease ttl in seconds (3)")
    parser.add_argument("--renew-interval", type=float, help="default ttl / 3")
    parser.add_argument("--intervals", type=int, default=6, help="renew intervals watched (6)")
    parser.add_argument("--plot", type=Path, help="also draw the curve into this PNG")
    args = parser.parse_args(argv)
    interval = args.renew_interval or args.ttl / 3
    timing = LeaseTiming(args.ttl, interval, min(max(0.5, args.ttl * 0.05), args.ttl / 4))

    from tests.servers import RedisServer

    server = RedisServer("--appendfsync", "everysec")
    rows = []
    try:
        for count in (int(c) for c in args.counts.split(",")):
            rows.append(measure(server.url, count, timing, args.intervals))
            print(rows[-1], flush=True)
    finally:
        server.close()

    print()
    print(
        f"ttl {args.ttl:g} s, renew interval {interval:g} s, {args.intervals} intervals watched; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| held leases | trips/interval | leases/trip | renew p50 | renew p99 | heartbeat CPU "
        "| bytes/lease | oldest renewal | lost | lost notice |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['leases']:,} | {r['trips_per_interval']:.2f} | {r['leases_per_call']:.0f} "
            f"| {r['p50_ms']:.1f} ms | {r['p99_ms']:.1f} ms | {r['cpu_percent']:.2f} % "
            f"| {r['bytes_per_lease']:.0f} | {r['oldest_renewal_intervals']:.2f} intervals "
            f"| {r['lost']} | {r['lost_notice_ms']:.0f} ms |"
        )
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [r["leases"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    axes[0].plot(counts, [r["trips_per_interval"] for r in rows], marker="o")
    axes[0].set_title("renew round trips per interval")
    axes[1].plot(counts, [r["p50_ms"] for r in rows], marker="o", label="p50")
    axes[1].plot(counts, [r["p99_ms"] for r in rows], marker="o", label="p99")
    axes[1].set_title("renew_many latency (ms)")
    axes[1].legend()
    axes[2].plot(counts, [r["cpu_percent"] for r in rows], marker="o")
    axes[2].set_title("heartbeat CPU (% of a core)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("held leases")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
