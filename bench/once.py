"""Benchmark: a leased insert with ``exactly_once`` against the insert then the separate completion.

Run it from the repository root::

    .venv/bin/python bench/once.py --stores postgres,sqlite --tasks 400 --rounds 5

Both kinds are a ``LeasedTask`` that inserts one row into a table of the
lease store's own database, run in this process with ``apply()`` (the
claim, the body and the completion, no broker), so the numbers hold only
what differs:

- ``separate``: the insert commits in a transaction of its own, then the
  library completes the job with one more statement (today's way);
- ``once``: ``exactly_once`` locks the lease record, inserts and completes
  in one transaction.

It starts a throwaway PostgreSQL (``tests/servers.py``) and a SQLite file in
a temporary folder. Each round runs both kinds, alternating which goes
first; the ratio is once/separate of the medians (target
:data:`TARGET`), and the rows per job are checked to be exactly 1.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from celery_leases import LeasedTask  # noqa: E402
from celery_leases.exactly_once import exactly_once  # noqa: E402
from celery_leases.task import forget_runtime  # noqa: E402

#: the once/separate throughput to reach
TARGET = 0.9

KINDS = ("separate", "once")


def make_app(url: str, engine: sa.Engine, effects: sa.Table) -> Celery:
    """An app on the store at ``url`` with the two tasks."""
    app = Celery("bench-once", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        leases_store=url,
        leases_store_options={"table_name": "bench_leases"},
        leases_ttl=30,
    )

    @app.task(name="bench.separate", base=LeasedTask, bind=True, shared=False)
    def separate(self: Any) -> int:
        with engine.begin() as conn:
            conn.execute(sa.insert(effects).values(job_id=self.lease.job_id))
        return 1

    @app.task(name="bench.once", base=LeasedTask, bind=True, shared=False)
    def once(self: Any) -> int:
        with exactly_once(self, engine) as tx:
            tx.connection.execute(sa.insert(effects).values(job_id=self.lease.job_id))
            return tx.complete(1)

    return app


def effects_table() -> sa.Table:
    return sa.Table(
        "bench_effects",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(64), nullable=False),
    )


@contextlib.contextmanager
def database(kind: str) -> Iterator[str]:
    """The URL of a throwaway database of ``kind``."""
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as folder:
            yield f"sqlite:///{Path(folder) / 'bench.db'}"
        return
    from tests.servers import PostgresServer

    server = PostgresServer()
    try:
        yield server.url.replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        server.close()


def timed(task: Any, tasks: int) -> float:
    """Tasks per second of ``tasks`` runs of ``task``."""
    started = time.perf_counter()
    for _ in range(tasks):
        result = task.apply()
        if result.failed():
            raise RuntimeError(f"{task.name} failed: {result.result!r}")
    return tasks / (time.perf_counter() - started)


def measure(kind: str, tasks: int, rounds: int, log: Callable[[str], None]) -> float:
    """Run the rounds on one database; return the once/separate ratio."""
    with database(kind) as url:
        engine = sa.create_engine(url)
        effects = effects_table()
        effects.create(engine)
        app = make_app(url, engine, effects)
        try:
            rates: dict[str, list[float]] = {name: [] for name in KINDS}
            timed(app.tasks["bench.once"], 20)  # warm up: connections, compiled statements
            timed(app.tasks["bench.separate"], 20)
            for round_number in range(rounds):
                order = KINDS if round_number % 2 == 0 else KINDS[::-1]
                for name in order:
                    rates[name].append(timed(app.tasks[f"bench.{name}"], tasks))
            with engine.connect() as conn:
                most = conn.execute(
                    sa.select(sa.func.count())
                    .select_from(effects)
                    .group_by(effects.c.job_id)
                    .order_by(sa.func.count().desc())
                    .limit(1)
                ).scalar_one()
            medians = {name: statistics.median(values) for name, values in rates.items()}
            ratio = medians["once"] / medians["separate"]
            log(
                f"{kind:>8}: separate {medians['separate']:7.1f}/s  once "
                f"{medians['once']:7.1f}/s  ratio {ratio:.2f} (target >= {TARGET}; rounds "
                f"{min(o / s for o, s in zip(rates['once'], rates['separate'], strict=True)):.2f}"
                f"-{max(o / s for o, s in zip(rates['once'], rates['separate'], strict=True)):.2f})"
                f"  most rows per job {most}"
            )
            if most != 1:
                raise RuntimeError(f"a job wrote {most} rows")
            return ratio
        finally:
            forget_runtime(app)
            engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default="postgres,sqlite")
    parser.add_argument("--tasks", type=int, default=400, help="tasks per kind per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fail-on-miss", action="store_true")
    options = parser.parse_args(argv)
    ratios = {
        kind: measure(kind, options.tasks, options.rounds, print)
        for kind in options.stores.split(",")
    }
    missed = [kind for kind, ratio in ratios.items() if ratio < TARGET]
    if missed:
        print(f"missed the target on {', '.join(missed)}")
    return 1 if missed and options.fail_on_miss else 0


if __name__ == "__main__":
    sys.exit(main())
