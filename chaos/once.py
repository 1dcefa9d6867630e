"""The exactly-once effect of a chaos job: one row in the store's own database.

A job of the ``once`` profile ends by inserting one row for itself into
``config.once_table``, inside ``exactly_once`` (or, in the
``separate-commit`` variant, in a transaction of its own before the
library's separate completion). Each job is also killed once, by its own
pool process, at the step its number picks (the steps in turn, and none): ``before`` the
transaction, ``inside`` it (row written, not committed), ``after-commit``
(no result yet) or ``after-result`` (Celery stored the result, the message
is not acked). The kills are counted in Redis (``chaos:once-kills:<step>``)
and the checker counts the rows per job: each must be exactly 1.
"""

from __future__ import annotations

import os
import signal
import zlib
from typing import Any

import redis
import sqlalchemy as sa
from celery.signals import task_success

from celery_leases.exactly_once import exactly_once
from celery_leases.runtime import in_prefork_child
from chaos.config import JOB, ChaosConfig

__all__ = ["STEPS", "count_effects", "create_effects", "kills", "once_step"]

STEPS = ("before", "inside", "after-commit", "after-result")


def effects_table(name: str) -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
    )


def engine_for(url: str) -> sa.Engine:
    """An engine of the job's own on the store's database, every wait bounded."""
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    connect_args: dict[str, Any]
    if parsed.get_backend_name() == "mysql":
        connect_args = {
            "connect_timeout": 3,
            "read_timeout": 10,
            "write_timeout": 10,
            "init_command": "SET SESSION innodb_lock_wait_timeout=3, max_statement_time=3",
        }
    else:
        connect_args = {
            "connect_timeout": 3,
            "options": "-c statement_timeout=3000 -c lock_timeout=3000",
        }
    return sa.create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)


def create_effects(url: str, name: str) -> None:
    engine = engine_for(url)
    try:
        effects_table(name).create(engine, checkfirst=True)
    finally:
        engine.dispose()


def count_effects(url: str, name: str, jobs: list[str]) -> dict[str, int]:
    """How many rows each job inserted."""
    table = effects_table(name)
    engine = engine_for(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(table.c.job_id, sa.func.count()).group_by(table.c.job_id))
            counted = {job_id: int(count) for job_id, count in rows}
    finally:
        engine.dispose()
    return {job: counted.get(job, 0) for job in jobs}


def kills(broker: str) -> dict[str, int]:
    client = redis.Redis.from_url(broker)
    try:
        return {step: int(client.get(f"chaos:once-kills:{step}") or 0) for step in STEPS}
    finally:
        client.close()


def once_step(job_id: str) -> str:
    """The step at which ``job_id`` is killed ("" for none): by the number
    that ends its name (``job-<seed>-<n>``), in turn, so every step is met."""
    tail = job_id.rsplit("-", 1)[-1]
    number = int(tail) if tail.isdigit() else zlib.crc32(job_id.encode())
    index = number % (len(STEPS) + 1)
    return STEPS[index] if index < len(STEPS) else ""


class OnceEffects:
    """The effect step of the chaos job, in one worker process."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.table = effects_table(config.once_table)
        self._engines: dict[int, sa.Engine] = {}
        self._side: dict[int, redis.Redis] = {}
        task_success.connect(self._after_result, weak=False)

    def _engine(self) -> sa.Engine:
        pid = os.getpid()
        if pid not in self._engines:  # made after fork: no shared sockets
            self._engines[pid] = engine_for(self.config.store)
        return self._engines[pid]

    def _kill_at(self, job_id: str, step: str) -> None:
        # only a pool process may die alone; its message comes back
        if once_step(job_id) != step or not in_prefork_child():
            return
        side = self._side.setdefault(os.getpid(), redis.Redis.from_url(self.config.broker))
        if side.set(f"chaos:once-killed:{job_id}", 1, nx=True):
            side.incr(f"chaos:once-kills:{step}")
            os.kill(os.getpid(), signal.SIGKILL)

    def apply(self, task: Any, lease: Any) -> dict[str, Any]:
        """Insert the job's row, with its completion (or apart, in the variant)."""
        job_id = lease.job_id
        self._kill_at(job_id, "before")
        row = {"job_id": job_id, "generation": lease.generation}
        if self.config.variant == "separate-commit":
            with self._engine().begin() as conn:
                conn.execute(sa.insert(self.table).values(row))
                self._kill_at(job_id, "inside")
            self._kill_at(job_id, "after-commit")
            return {"generation": lease.generation}
        with exactly_once(task, self._engine()) as tx:
            tx.connection.execute(sa.insert(self.table).values(row))
            self._kill_at(job_id, "inside")
            value = tx.complete({"generation": lease.generation})
        self._kill_at(job_id, "after-commit")
        return value

    def _after_result(self, sender: Any = None, **_: Any) -> None:
        # Celery sends task_success after it stored the result, before the ack
        if sender is not None and sender.name == JOB:
            self._kill_at(sender.request.id, "after-result")
