"""Task code that records a payment through a fenced SQL write.

The task passes its lease (``self.lease`` inside a leased task); here the
function takes it as an argument so the same code runs in a test.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_leases.fencing import FenceResult, FencingToken
from celery_leases.fencing.sql import fence_table, fenced_execute

metadata = sa.MetaData()
fences = fence_table(metadata)
balances = sa.Table(
    "balances",
    metadata,
    sa.Column("account", sa.String(64), primary_key=True),
    sa.Column("balance", sa.Integer, nullable=False),
)


def set_balance(engine: sa.Engine, lease: FencingToken, account: str, balance: int) -> FenceResult:
    """Set an account's balance, unless a newer run of the job already wrote it.

    Raises:
        StaleFencingToken: a newer generation wrote this account; nothing changed.
    """
    with engine.begin() as conn:  # the fence and the write commit together
        return fenced_execute(
            conn,
            sa.update(balances).where(balances.c.account == account).values(balance=balance),
            resource=f"balance:{account}",
            token=lease,
        )
