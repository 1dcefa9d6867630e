"""A small app for the testing guide: one leased task that marks a payment paid, fenced.

Stands for your own app: the tests in ``test_payments.py`` point it at the
pytest plugin's in-memory broker, lease store and a temporary database.
"""

from __future__ import annotations

import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.fencing.sql import fenced_update

app = Celery("payments", broker="redis://localhost:6379/0")
app.conf.leases_store = "redis://localhost:6379/1"
app.conf.leases_ttl = 30

metadata = sa.MetaData()
payments = sa.Table(
    "payments",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("status", sa.String(20), nullable=False, server_default="due"),
    # the newest generation that wrote the row; fenced_update compares it
    sa.Column("fence_generation", sa.BigInteger, nullable=True),
)
engine = sa.create_engine("sqlite:///payments.db")  # connects on first use only


@app.task(base=LeasedTask, bind=True)
def pay(self: LeasedTask, payment_id: int) -> int:
    """Mark a payment paid, unless a newer run of this job wrote it already."""
    with engine.begin() as conn:
        fenced_update(
            conn,
            payments,
            {"status": "paid"},
            where=payments.c.id == payment_id,
            token=self.lease,
        )
    return self.lease.generation
