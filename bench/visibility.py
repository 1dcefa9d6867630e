"""Benchmark: deliveries of a long leased run, with and without visibility extensions.

Run it from the repository root::

    .venv/bin/python bench/visibility.py                          # Redis and SQS, 3x and 6x
    .venv/bin/python bench/visibility.py --brokers redis --multiples 3,10

For each broker (a throwaway redis-server; a local SQS server, moto) and
each body length (a multiple of the visibility timeout, 2 s), it runs one
leased job on two real prefork workers, once with
``leases_broker_keep_invisible`` and once without, and counts what the
workers logged: deliveries (``Task ... received``), deferred copies, and
broker redeliveries (deliveries beyond the first of each message). The
lease TTL is 1.5 s (a renewal every 0.5 s). The same counting is what
``tests/acceptance/test_keep_invisible.py`` asserts on.
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
from tests.acceptance.test_keep_invisible import (  # noqa: E402
    SWEEP,
    TTL,
    VISIBILITY,
    count_deliveries,
    start_two_workers,
)
from tests.broker_servers import SqsServer  # noqa: E402
from tests.servers import RedisServer  # noqa: E402


def one_run(config: AcceptanceConfig, body: float, log_dir: Path) -> tuple[int, int, int]:
    """(deliveries, deferred copies, broker redeliveries) of one job of ``body`` seconds."""
    cluster = Cluster(config, log_dir)
    try:
        start_two_workers(cluster)
        result = cluster.send(STEPS, body)
        cluster.wait_record(
            result.id, state=LeaseState.COMPLETED, timeout=body + 60, message="the job"
        )
        time.sleep(VISIBILITY + SWEEP["redis"])  # the last deferred copy comes back
        received, deferred = count_deliveries(cluster, result.id)
        return received, deferred, received - 1 - deferred
    finally:
        cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="redis,sqs", help="redis, sqs or both")
    parser.add_argument(
        "--multiples", default="3,6", help="body lengths, in visibility timeouts (2 s)"
    )
    args = parser.parse_args()
    brokers = [b for b in args.brokers.split(",") if b]
    multiples = [float(m) for m in args.multiples.split(",") if m]
    rows = []
    with contextlib.ExitStack() as stack:
        side = RedisServer()
        stack.callback(side.close)
        urls = {"redis": side.url.replace("/0", "/1")}
        if "sqs" in brokers:
            sqs = SqsServer()
            stack.callback(sqs.close)
            urls["sqs"] = sqs.url
        log_root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vis-")))
        for broker in brokers:
            for multiple in multiples:
                for keep in (False, True):
                    queue = f"q{uuid.uuid4().hex[:10]}"
                    config = AcceptanceConfig(
                        broker=urls[broker], backend=side.url.replace("/0", "/2"),
                        side=side.url.replace("/0", "/2"), queue=queue, store=side.url,
                        store_options={"prefix": f"bench{queue}:"}, ttl=TTL,
                        visibility_timeout=VISIBILITY, keep_invisible=keep,
                    )  # fmt: skip
                    log_dir = log_root / queue
                    log_dir.mkdir()
                    body = multiple * VISIBILITY
                    counts = one_run(config, body, log_dir)
                    rows.append((broker, f"{body:g} s ({multiple:g} x)", keep, *counts))
                    print(f"{broker} body {body:g} s keep_invisible={keep}: {counts}", flush=True)
    print()
    print("| broker | body | setting | deliveries | deferred copies | broker redeliveries |")
    print("|---|---|---|---|---|---|")
    for broker, body_text, keep, received, deferred, redelivered in rows:
        setting = "on" if keep else "off"
        print(f"| {broker} | {body_text} | {setting} | {received} | {deferred} | {redelivered} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
