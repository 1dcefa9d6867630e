"""The fenced writes of the fencing guide, as leased tasks that the tests run.

The app and its targets come from environment variables (the tests set
them): ``FENCING_DB`` (a SQLAlchemy URL; the lease store lives there too)
and ``FENCING_REDIS`` (a Redis URL). The tasks are ``shared=False``: the
tests load this module next to other apps, which must not receive these
tasks. The HTTP task is a module of its own, ``fenced_http_task.py``.
"""

from __future__ import annotations

import os

import redis
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask, open_store
from celery_leases.fencing.redis import RedisFence
from celery_leases.fencing.sql import (
    create_fence_table,
    fenced_execute,
    fenced_transaction,
    fenced_update,
    fenced_upsert,
)

DB_URL = os.environ.get("FENCING_DB", "sqlite:////tmp/fencing-example.db")
engine = sa.create_engine(DB_URL)
metadata = sa.MetaData()
balances = sa.Table(
    "balances",
    metadata,
    sa.Column("account", sa.String(64), primary_key=True),
    sa.Column("balance", sa.Integer, nullable=False),
)
reports = sa.Table(
    "reports",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("fence_generation", sa.BigInteger, nullable=True),
)
results = sa.Table(
    "results",
    metadata,
    sa.Column("job_id", sa.String(255), primary_key=True),
    sa.Column("total", sa.Integer, nullable=False),
)
metadata.create_all(engine)

app = Celery("fencing", broker="memory://", backend="cache+memory://")
app.conf.leases_store = DB_URL
store = open_store(DB_URL)  # the same database as the tables: fenced_transaction
redis_client = redis.Redis.from_url(os.environ.get("FENCING_REDIS", "redis://localhost:6379/0"))


# --8<-- [start:fence-table]
fences = create_fence_table(engine)  # table celery_leases_fences


@app.task(base=LeasedTask, bind=True, shared=False)
def set_balance(self: LeasedTask, account: str, balance: int) -> None:
    with engine.begin() as conn:  # one transaction: the fence and the write
        fenced_execute(
            conn,
            sa.update(balances).where(balances.c.account == account).values(balance=balance),
            resource=f"balance:{account}",
            token=self.lease,
            fences=fences,
        )


# --8<-- [end:fence-table]


# --8<-- [start:fence-column]
@app.task(base=LeasedTask, bind=True, shared=False)
def write_report(self: LeasedTask, report_id: int, body: str) -> None:
    with engine.begin() as conn:
        # insert the row, or update it if no newer generation wrote it
        fenced_upsert(conn, reports, {"id": report_id, "body": body}, token=self.lease)
        fenced_update(
            conn, reports, {"body": body.upper()}, where=reports.c.id == report_id, token=self.lease
        )


# --8<-- [end:fence-column]


# --8<-- [start:transaction]
@app.task(base=LeasedTask, bind=True, shared=False)
def record_total(self: LeasedTask, total: int) -> None:
    with fenced_transaction(store, self.lease) as conn:
        conn.execute(sa.insert(results).values(job_id=self.lease.job_id, total=total))


# --8<-- [end:transaction]


# --8<-- [start:redis]
fence = RedisFence(redis_client)  # prefix "celery_leases:"


@app.task(base=LeasedTask, bind=True, shared=False)
def export_report(self: LeasedTask, report_id: int, body: str) -> None:
    fence.set(f"report:{report_id}", body, self.lease, ex=3600)
    fence.hset(f"job-status:{report_id}", {"state": "done", "rows": "118"}, self.lease)
    fence.xadd("events", {"type": "exported"}, self.lease, maxlen=10_000)


# --8<-- [end:redis]
