"""Run the live demo: ``python example_project/run.py [--broker URL --store URL]``.

Without URLs it needs no server (see ``invoices/config.py``). It prints a
timeline, the ledger and the stored result, and exits 0 only if the worked
example happened as described; 1 if not; 130 on Ctrl-C. Every process it
started is stopped on the way out.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))

from invoices.config import Config  # after the path is set
from invoices.demo import DemoReport, run_demo


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--broker", default="", help="broker URL (default: embedded)")
    parser.add_argument("--backend", default="", help="result backend URL")
    parser.add_argument("--store", default="", help="lease store URL (default: SQLite)")
    parser.add_argument("--ledger", default="", help="ledger database URL (default: SQLite)")
    # long enough for B to receive the copy while A's lease is live on a busy machine
    parser.add_argument("--ttl", type=float, default=4.0, help="lease TTL in seconds")
    parser.add_argument(
        "--work", type=float, default=2.0, help="seconds a charge prepares before it writes"
    )
    parser.add_argument("--data-dir", type=Path, help="folder for files and logs (default: temp)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the data folder")
    return parser.parse_args(argv)


def _print_report(report: DemoReport) -> None:
    events = report.timeline
    n = report.generation
    start = events[0].at if events else time.time()
    print("\ntimeline of job", report.job_id)
    if report.roles:
        print("  A is worker", report.roles["A"], "and B is worker", report.roles["B"])
    print(f"  {'time':>7}  {'who':<5} {'event':<28} generation")
    for event in events:
        label = ""
        if event.generation is not None and n is not None:
            offset = event.generation - n
            label = f"{event.generation} (N{f'{offset:+d}' if offset else ''})"
        detail = f"  {event.detail}" if event.detail else ""
        print(f"  {event.at - start:+6.2f}s  {event.worker:<5} {event.event:<28} {label}{detail}")
    print("\nledger:")
    for entry in report.ledger or [{"(empty)": ""}]:
        print("  ", entry)
    print("receipt:", report.receipt)
    result = report.result
    if isinstance(result, dict) and report.roles:
        role = {name: role for role, name in report.roles.items()}.get(str(result.get("worker")))
        result = {**result, "worker": f"{result.get('worker')} ({role})"}
    print(f"stored result ({report.result_state}):", result)
    print("\nchecks:")
    for name, ok in report.checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="invoices-demo-"))
    config = Config(
        data_dir=data_dir.resolve(),
        broker=args.broker,
        backend=args.backend,
        store=args.store,
        ledger=args.ledger,
        ttl=args.ttl,
        work_seconds=args.work,
        queue=f"invoices-{int(time.time() * 1000)}",
    )

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    report = DemoReport()
    code = 1
    try:
        run_demo(config, report)
        _print_report(report)
        code = 0 if report.ok else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopped every process the demo started", file=sys.stderr)
        report.error = "interrupted"
        code = 130
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        _print_report(report)
        print(f"\nthe demo failed: {report.error}", file=sys.stderr)
    if args.json:
        report.write_json(args.json)
    if code == 0:
        print(
            "\nproven: a worker frozen past its lease woke up to a refused ledger write and a "
            "refused completion, while the next generation's charge, receipt and result stand."
        )
    elif code == 1:
        print(f"\nNOT proven; logs and files are in {config.data_dir}", file=sys.stderr)
    if code == 0 and not args.keep and args.data_dir is None:
        shutil.rmtree(config.data_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
