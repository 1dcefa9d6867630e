"""``python -m chaos run|check``: see ``python -m chaos --help``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a profile and check its history")
    run.add_argument("--profile", default="ci", choices=["ci", "green", "variant", "once", "long"])
    run.add_argument("--store", default="redis", choices=["redis", "postgres", "mysql"])
    run.add_argument(
        "--broker", default="redis", choices=["redis", "amqp"],
        help="amqp: a private RabbitMQ node (results stay on Redis)",
    )  # fmt: skip
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--variant", default="", help="a broken variant (see docs/testing.md)")
    run.add_argument(
        "--pool", default="", choices=["", "prefork", "threads", "gevent", "eventlet"],
        help="put every worker of the profile on this pool (default: the profile's)",
    )  # fmt: skip
    run.add_argument("--out", type=Path, default=Path("chaos-out"))
    args = parser.parse_args(argv)

    from chaos.runner import PROFILES
    from chaos.runner import run as run_profile

    report = run_profile(
        PROFILES[args.profile], store_kind=args.store, seed=args.seed, out=args.out,
        variant=args.variant, broker_kind=args.broker, pool=args.pool,
    )  # fmt: skip
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
