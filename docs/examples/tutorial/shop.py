"""The tutorial's shop: one leased task that charges an order, fenced.

Everything lives in local files under ``$SHOP_DATA`` (default: the current
folder), so it runs with no server: kombu's ``filesystem://`` broker,
SQLite for results, leases and orders.
"""

# --8<-- [start:app]
from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.fencing.sql import fenced_update

DATA = Path(os.environ.get("SHOP_DATA", ".")).resolve()
BROKER = DATA / "broker"
for folder in ("messages", "processed", "control"):
    (BROKER / folder).mkdir(parents=True, exist_ok=True)

app = Celery("shop", broker="filesystem://", backend=f"db+sqlite:///{DATA / 'results.db'}")
# kombu's filesystem transport, writing each message file whole before a
# worker can take it (kombu's own can hand out a file still being written),
# and keeping it until the worker acknowledges it: a killed worker's job
# goes back to the queue
app.conf.broker_transport = "celery_leases.filesystem:Transport"
app.conf.broker_transport_options = {
    "data_folder_in": str(BROKER / "messages"),
    "data_folder_out": str(BROKER / "messages"),
    # acknowledged messages are kept here
    "store_processed": True,
    "processed_folder": str(BROKER / "processed"),
    "control_folder": str(BROKER / "control"),
}
app.conf.worker_enable_remote_control = False  # the filesystem broker has no fan-out
app.conf.leases_store = f"sqlite:///{DATA / 'leases.db'}"  # an absolute path: four slashes
app.conf.leases_ttl = 30  # renewed every 10 s while the task runs
# --8<-- [end:app]

# --8<-- [start:table]
engine = sa.create_engine(f"sqlite:///{DATA / 'shop.db'}")
metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("status", sa.String(20), nullable=False, server_default="open"),
    # the newest generation that wrote the row; fenced_update compares it
    sa.Column("fence_generation", sa.BigInteger, nullable=True),
)
metadata.create_all(engine)


def add_order() -> int:
    """Insert an open order; return its id."""
    with engine.begin() as conn:
        key = conn.execute(sa.insert(orders)).inserted_primary_key
    assert key is not None
    return int(key[0])


# --8<-- [end:table]


# --8<-- [start:task]
@app.task(base=LeasedTask, bind=True)
def charge(self: LeasedTask, order_id: int) -> int:
    """Mark an order charged, unless a newer run of this job wrote it already."""
    with engine.begin() as conn:
        fenced_update(
            conn,
            orders,
            {"status": "charged"},
            where=orders.c.id == order_id,
            token=self.lease,  # the lease carries job_id and generation
        )
    return self.lease.generation


# --8<-- [end:task]
