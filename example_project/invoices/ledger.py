"""The ledger: invoices, and one ledger entry per charged invoice.

Two ways to write a charge:

- :func:`post_charge` writes its entry through a fence
  (``celery_leases_fences``, one row per invoice with the newest generation
  accepted) in the same transaction, so a stale run of the job is refused
  by the database itself, also when its write was already on the wire when
  a newer run took over. The ledger may be in any database.
- :func:`post_charge_once` writes plainly, on the connection of an
  ``exactly_once`` transaction in the lease store's own database: the
  entry commits with the job's completion, so it is written exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from celery_leases.fencing import FencingToken
from celery_leases.fencing.sql import fence_table, fenced_execute

__all__ = [
    "Entry",
    "add_invoice",
    "amount_of",
    "entries",
    "invoices",
    "ledger",
    "open_ledger",
    "post_charge",
    "post_charge_once",
]

metadata = sa.MetaData()
fences = fence_table(metadata)
invoices = sa.Table(
    "invoices",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("customer", sa.String(100), nullable=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("status", sa.String(20), nullable=False, server_default="open"),
)
ledger = sa.Table(
    "ledger",
    metadata,
    sa.Column("invoice_id", sa.Integer, sa.ForeignKey("invoices.id"), primary_key=True),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("job_id", sa.String(255), nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("worker", sa.String(100), nullable=False),
)


@dataclass(frozen=True)
class Entry:
    """One ledger row."""

    invoice_id: int
    amount_cents: int
    job_id: str
    generation: int
    worker: str


def open_ledger(url: str) -> sa.Engine:
    """An engine on the ledger database, its tables created if missing."""
    options: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # two worker processes write: wait for the other's write lock
        options["connect_args"] = {"timeout": 30}
    engine = sa.create_engine(url, **options)
    metadata.create_all(engine)
    return engine


def add_invoice(engine: sa.Engine, customer: str, amount_cents: int) -> int:
    """Insert an open invoice; return its id."""
    with engine.begin() as conn:
        result = conn.execute(
            sa.insert(invoices).values(customer=customer, amount_cents=amount_cents)
        )
        key = result.inserted_primary_key
        assert key is not None
        return int(key[0])


def post_charge(engine: sa.Engine, lease: FencingToken, invoice_id: int, worker: str) -> Entry:
    """Write the ledger entry of ``invoice_id`` and mark it paid, fenced by ``lease``.

    Raises:
        StaleFencingToken: a newer run of the job already wrote this invoice;
            nothing was written.
        LeaseLost: the lease is known lost before the write was sent.
    """
    with engine.begin() as conn:
        amount = conn.execute(
            sa.select(invoices.c.amount_cents).where(invoices.c.id == invoice_id)
        ).scalar_one()
        entry = Entry(invoice_id, int(amount), lease.job_id, lease.generation, worker)
        fenced_execute(
            conn,
            sa.insert(ledger).values(
                invoice_id=invoice_id,
                amount_cents=entry.amount_cents,
                job_id=entry.job_id,
                generation=entry.generation,
                worker=worker,
            ),
            resource=f"invoice:{invoice_id}",
            token=lease,
        )
        conn.execute(sa.update(invoices).where(invoices.c.id == invoice_id).values(status="paid"))
        return entry


def amount_of(engine: sa.Engine, invoice_id: int) -> int:
    """The amount of ``invoice_id``, in cents."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(invoices.c.amount_cents).where(invoices.c.id == invoice_id)
            ).scalar_one()
        )


def post_charge_once(
    conn: sa.Connection, lease: FencingToken, invoice_id: int, amount_cents: int, worker: str
) -> Entry:
    """Write the ledger entry of ``invoice_id`` and mark it paid, on ``conn``.

    No fence: ``conn`` is in an ``exactly_once`` transaction, which commits
    only with this run's fenced completion.
    """
    entry = Entry(invoice_id, amount_cents, lease.job_id, lease.generation, worker)
    conn.execute(
        sa.insert(ledger).values(
            invoice_id=invoice_id,
            amount_cents=amount_cents,
            job_id=entry.job_id,
            generation=entry.generation,
            worker=worker,
        )
    )
    conn.execute(sa.update(invoices).where(invoices.c.id == invoice_id).values(status="paid"))
    return entry


def entries(engine: sa.Engine) -> list[Entry]:
    """Every ledger entry, by invoice."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(ledger).order_by(ledger.c.invoice_id)).all()
    return [
        Entry(r.invoice_id, r.amount_cents, r.job_id, int(r.generation), r.worker) for r in rows
    ]
