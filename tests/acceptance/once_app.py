"""The acceptance app with a task whose effect is one row in the lease store's database.

``celery -A tests.acceptance.once_app worker`` reads the ``LEASES_TEST_*``
variables of :mod:`tests.acceptance.app`, and these:

- ``LEASES_TEST_ONCE_TABLE``: the effects table (``job_id``, ``generation``),
  in the lease store's database; the test creates it;
- ``LEASES_TEST_ONCE_MODE``: ``together`` (the row and the completion in one
  ``exactly_once`` transaction), ``separate`` (the row in a transaction of
  its own, then the library's completion: the variant that applies an
  effect twice, which the tests must catch) or ``retry-inside`` (as
  ``together``, but the first run calls ``self.retry(countdown=0)`` inside
  the block, after its row) or ``retry-after`` (the first run raises inside
  the block, after its row, and calls ``self.retry(countdown=0)`` after it,
  as the docs advise);
- ``LEASES_TEST_ONCE_URL``: the URL of the task's own engine (default: the
  lease store's), for a connection through a proxy or with another role;
- ``LEASES_TEST_ONCE_INSIDE``: seconds the ``together`` block stays open
  after its row was written (a block longer than the lease, or one a test
  freezes inside);
- ``LEASES_TEST_ONCE_KILL_AT``: comma-separated steps at which the pool
  process SIGKILLs itself, once per job and step: ``before`` (the body
  started, no transaction yet), ``inside`` (the row written, not
  committed), ``after-commit`` (committed, Celery has no result yet) and
  ``after-result`` (Celery stored the result, the message is not acked).

Each kill is counted in the side channel (``side:once-kills:<step>``)
before it happens; each run of a job's body (``side:once-runs:<job_id>``)
and each block that wrote its row (``side:once-inside:<job_id>``) too.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import sqlalchemy as sa
from celery.signals import task_success

from celery_leases import LeasedTask
from celery_leases.exactly_once import exactly_once
from tests.acceptance.app import _sleep_steps, config_from_env, make_app, side_channel

__all__ = ["ONCE", "STEPS", "app", "effects_table"]

ONCE = "acceptance.once"

#: the steps a pool process can be killed at, in the order a run meets them
STEPS = ("before", "inside", "after-commit", "after-result")

config = config_from_env()
app = make_app(config)
MODE = os.environ.get("LEASES_TEST_ONCE_MODE", "together")
URL = os.environ.get("LEASES_TEST_ONCE_URL") or config.store
INSIDE = float(os.environ.get("LEASES_TEST_ONCE_INSIDE", "0"))
KILL_AT = frozenset(filter(None, os.environ.get("LEASES_TEST_ONCE_KILL_AT", "").split(",")))
_engines: dict[int, sa.Engine] = {}


def effects_table(name: str) -> sa.Table:
    """The effects table: one row per applied effect."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(64), nullable=False, index=True),
        sa.Column("generation", sa.BigInteger, nullable=False),
    )


EFFECTS = effects_table(os.environ.get("LEASES_TEST_ONCE_TABLE", "once_effects"))


def engine_for(url: str) -> sa.Engine:
    """An engine of the task's own on the lease store's database."""
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return sa.create_engine(parsed)


def _engine() -> sa.Engine:
    pid = os.getpid()
    if pid not in _engines:  # one per pool process: no connection crosses a fork
        _engines[pid] = engine_for(URL)
    return _engines[pid]


class TryLater(Exception):
    """Raised inside the block of ``retry-after``: the block rolls back."""


def _kill_once(job_id: str, step: str) -> None:
    if step not in KILL_AT:
        return
    side = side_channel(config.side)
    if side.set(f"side:once-killed:{job_id}:{step}", 1, nx=True):
        side.incr(f"side:once-kills:{step}")
        os.kill(os.getpid(), signal.SIGKILL)


@app.task(base=LeasedTask, bind=True, shared=False, name=ONCE)
def once(self: Any, seconds: float = 0.0) -> dict[str, Any]:
    """Insert one row for the job, with its completion or (variant) apart from it."""
    lease = self.lease
    side_channel(config.side).incr(f"side:once-runs:{lease.job_id}")
    _kill_once(lease.job_id, "before")
    _sleep_steps(seconds, 0.05)
    row = {"job_id": lease.job_id, "generation": lease.generation}
    if MODE == "separate":
        with _engine().begin() as conn:
            conn.execute(sa.insert(EFFECTS).values(row))
            _kill_once(lease.job_id, "inside")
        _kill_once(lease.job_id, "after-commit")
        return row
    try:
        with exactly_once(self, _engine()) as tx:
            tx.connection.execute(sa.insert(EFFECTS).values(row))
            _kill_once(lease.job_id, "inside")
            side_channel(config.side).incr(f"side:once-inside:{lease.job_id}")
            _sleep_steps(INSIDE, 0.05)
            if MODE.startswith("retry-") and self.request.retries == 0:
                if MODE == "retry-inside":
                    self.retry(countdown=0)
                raise TryLater(lease.job_id)
            value = tx.complete(row)
    except TryLater as busy:
        raise self.retry(exc=busy, countdown=0) from busy
    _kill_once(lease.job_id, "after-commit")
    return value


@task_success.connect(weak=False)
def _after_result(sender: Any = None, **_: Any) -> None:
    # Celery sends task_success after it stored the result, before the ack
    if sender is not None and sender.name == ONCE:
        _kill_once(sender.request.id, "after-result")
