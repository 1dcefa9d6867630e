"""``invoices.charge_once``: the ledger entry commits with the job's completion.

The lease store here is SQLite (the example's embedded store), so the
ledger tables live in its database; a worker of the test process runs the
task, and the receipt service is real.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from invoices.config import Config
from invoices.ledger import add_invoice, entries, open_ledger
from invoices.receipts import ReceiptService
from invoices.tasks import CHARGE_ONCE

from celery_leases import LeaseState, LeaseStore, signals

WAIT = 30.0


@pytest.fixture
def lease_store_url(config: Config) -> str:
    return config.store_url


@pytest.fixture
def store_ledger(config: Config) -> Iterator[sa.Engine]:
    engine = open_ledger(config.store_url)
    yield engine
    engine.dispose()


@pytest.mark.usefixtures("leases_worker")
def test_a_charge_writes_its_entry_with_the_completion(
    leases_app: Any,
    lease_store: LeaseStore,
    store_ledger: sa.Engine,
    receipts: ReceiptService,
) -> None:
    invoice = add_invoice(store_ledger, "ACME Ltd", 4_200)
    result = leases_app.send_task(CHARGE_ONCE, args=[invoice])
    value = result.get(timeout=WAIT)
    record = lease_store.get(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert value["generation"] == record.generation
    [entry] = entries(store_ledger)
    assert (entry.invoice_id, entry.generation) == (invoice, record.generation)
    assert receipts.receipts[str(invoice)]["generation"] == record.generation


@pytest.mark.usefixtures("leases_worker")
def test_a_run_taken_over_before_its_commit_writes_nothing(
    leases_app: Any,
    lease_store: LeaseStore,
    store_ledger: sa.Engine,
) -> None:
    """The lease is stolen between the claim and the transaction: the
    transaction is refused and rolled back, and the stale run is fenced out."""
    invoice = add_invoice(store_ledger, "ACME Ltd", 900)
    fenced: list[str] = []

    def steal(sender: Any, lease: Any, **_: Any) -> None:
        # an operator's release, then another worker's claim: this run is stale
        lease_store.force_release(lease.job_id, by="test", reason="taken over")
        lease_store.claim(lease.job_id, "another worker", 60.0, task_name=CHARGE_ONCE)

    def fenced_out(sender: Any, reason: str, **_: Any) -> None:
        fenced.append(reason)

    signals.lease_claimed.connect(steal, weak=False)
    signals.lease_fenced_out.connect(fenced_out, weak=False)
    try:
        leases_app.send_task(CHARGE_ONCE, args=[invoice])
        deadline = time.monotonic() + WAIT
        while not fenced and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        signals.lease_claimed.disconnect(steal)
        signals.lease_fenced_out.disconnect(fenced_out)
    assert fenced[:1] == ["superseded"]
    assert entries(store_ledger) == []
