"""The fenced targets the chaos jobs write to, and what each one accepted.

- SQL: a row per job in ``chaos_target`` with a fence column, written with
  :func:`celery_leases.fencing.sql.fenced_update`; every accepted write also
  inserts a row in ``chaos_audit`` in the same transaction, whose serial id
  gives the order in which the target accepted writes.
- Redis: a stream per job, appended with :meth:`RedisFence.xadd`; the stream
  is the target's own log, in the order it accepted entries.

The ``unfenced-target`` variant writes both without a fence.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from celery_leases.fencing import FencingToken
from celery_leases.fencing.redis import RedisFence
from celery_leases.fencing.sql import fenced_update

__all__ = ["SqlTarget", "RedisTarget", "Write"]

#: (job_id, generation, step, pid) of one accepted write, in the target's order
Write = tuple[str, int, int, int]

_metadata = sa.MetaData()
TARGET = sa.Table(
    "chaos_target",
    _metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("step", sa.Integer, nullable=False, default=0),
    sa.Column("fence_generation", sa.BigInteger, nullable=True),
)
AUDIT = sa.Table(
    "chaos_audit",
    _metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("job_id", sa.Text, nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)


class SqlTarget:
    """The SQL target on ``url`` (PostgreSQL)."""

    def __init__(self, url: str) -> None:
        self.engine: Engine = sa.create_engine(url, pool_pre_ping=True)

    def create(self, jobs: Iterable[str]) -> None:
        _metadata.drop_all(self.engine)
        _metadata.create_all(self.engine)
        with self.engine.begin() as conn:
            conn.execute(TARGET.insert(), [{"job_id": job, "step": 0} for job in jobs])

    def write(self, token: FencingToken, step: int, pid: int, *, fenced: bool = True) -> bool:
        """One write; True when the target accepted it.

        Raises:
            StaleFencingToken: refused by the fence.
            LeaseLost: the token is a lease that is lost locally.
        """
        with self.engine.begin() as conn:
            if fenced:
                result = fenced_update(
                    conn, TARGET, {"step": step}, where=TARGET.c.job_id == token.job_id, token=token
                )
                if not result.applied:
                    return False
            else:
                conn.execute(
                    TARGET.update()
                    .where(TARGET.c.job_id == token.job_id)
                    .values(step=step, fence_generation=token.generation)
                )
            conn.execute(
                AUDIT.insert().values(
                    job_id=token.job_id, generation=token.generation, step=step, pid=pid
                )
            )
        return True

    def accepted(self) -> list[Write]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(AUDIT.c.job_id, AUDIT.c.generation, AUDIT.c.step, AUDIT.c.pid).order_by(
                    AUDIT.c.id
                )
            )
            return [(str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows]

    def close(self) -> None:
        self.engine.dispose()


class RedisTarget:
    """The Redis target: one stream per job on ``url``."""

    PREFIX = "chaos:target:"

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.fence = RedisFence(self.client, prefix="chaos:fence:")

    def stream(self, job_id: str) -> str:
        return f"{self.PREFIX}{job_id}"

    def write(self, token: FencingToken, step: int, pid: int, *, fenced: bool = True) -> bool:
        fields = {"generation": token.generation, "step": step, "pid": pid}
        if fenced:
            self.fence.xadd(self.stream(token.job_id), fields, token)
        else:
            self.client.xadd(self.stream(token.job_id), fields)  # type: ignore[arg-type]
        return True

    def accepted(self, jobs: Iterable[str]) -> list[Write]:
        writes: list[Write] = []
        for job in jobs:
            entries: Any = self.client.xrange(self.stream(job))
            for _entry, fields in entries:
                writes.append(
                    (job, int(fields[b"generation"]), int(fields[b"step"]), int(fields[b"pid"]))
                )
        return writes

    def close(self) -> None:
        self.client.close()
