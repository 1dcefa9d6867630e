"""Benchmark: what a copy waiting for a held job costs, and how soon it starts.

Run it from the repository root::

    .venv/bin/python bench/waiting.py                        # Redis store, 20 s holder
    .venv/bin/python bench/waiting.py --stores redis,postgres --holder 60 --ttl 30

For each store it runs one leased job (``acceptance.steps``) of ``--holder``
seconds on two real prefork workers, and once that run holds its lease it
sends the same task id again: a second send of the job, which waits under
``lease_on_busy="wait"``. From the workers' logs and the tasks' side channel
it reports:

- re-published messages of the waiting send: every delivery of the job
  after the two sends (its fallback or polling copies, ``lease deferred``
  lines, and the copy the holder's end woke), and the same per minute of
  waiting;
- the gap from the holder's end (its last step) to the copy's start.

It starts its own throwaway redis-server (broker, result backend, side
channel, Redis store) and, when asked, PostgreSQL, and always stops them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import uuid
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from celery_leases import LeaseState  # noqa: E402
from tests.acceptance.app import STEPS, AcceptanceConfig  # noqa: E402
from tests.acceptance.conftest import Cluster  # noqa: E402
from tests.acceptance.test_keep_invisible import count_deliveries, start_two_workers  # noqa: E402
from tests.servers import PostgresServer, RedisServer  # noqa: E402


def one_run(config: AcceptanceConfig, holder: float, log_dir: Path) -> tuple[int, float, float]:
    """(re-published messages, seconds from the copy's send to its start, gap
    from the holder's end to the copy's start)."""
    cluster = Cluster(config, log_dir)
    try:
        start_two_workers(cluster)
        job = f"waiting-{uuid.uuid4().hex[:10]}"
        cluster.send(STEPS, holder, task_id=job)
        cluster.wait_record(job, state=LeaseState.HELD, timeout=60, message="the holder")
        sent = time.time()
        cluster.send(STEPS, 0.1, task_id=job)  # another send of the same job
        cluster.side.wait_event(job, "done", count=2, timeout=holder + 120)
        starts = sorted(e["at"] for e in cluster.side.events(job, "start"))
        dones = sorted(e["at"] for e in cluster.side.events(job, "done"))
        received, _ = count_deliveries(cluster, job)
        return received - 2, starts[1] - sent, starts[1] - dones[0]
    finally:
        cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="redis", help="redis, postgres or both")
    parser.add_argument("--holder", type=float, default=20.0, help="the holder's run (s)")
    parser.add_argument("--ttl", type=float, default=30.0, help="the lease TTL (s)")
    args = parser.parse_args()
    rows = []
    with contextlib.ExitStack() as stack:
        redis_server = RedisServer()
        stack.callback(redis_server.close)
        stores = {"redis": (redis_server.url, "prefix")}
        if "postgres" in args.stores:
            postgres = PostgresServer()
            stack.callback(postgres.close)
            stores["postgres"] = (postgres.url, "table_name")
        log_root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-wait-")))
        for name in [s for s in args.stores.split(",") if s]:
            url, option = stores[name]
            queue = f"q{uuid.uuid4().hex[:10]}"
            side = redis_server.url.replace("/0", "/1")
            config = AcceptanceConfig(
                broker=side, backend=side, side=side, queue=queue, store=url,
                store_options={option: f"bench_{queue}"}, ttl=args.ttl,
            )  # fmt: skip
            log_dir = log_root / queue
            log_dir.mkdir()
            deferred, waited, gap = one_run(config, args.holder, log_dir)
            rows.append((name, deferred, waited, deferred / waited * 60, gap))
            print(f"{name}: {deferred} re-published in {waited:.1f} s, gap {gap:.2f} s", flush=True)
    print()
    print(f"holder {args.holder:g} s, TTL {args.ttl:g} s, one waiting copy")
    print()
    print("| store | re-published | waited | per minute of waiting | start after holder's end |")
    print("|---|---|---|---|---|")
    for name, deferred, waited, per_minute, gap in rows:
        print(f"| {name} | {deferred} | {waited:.1f} s | {per_minute:.0f} | {gap:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
