"""The charge task in a worker of the test process, with the pytest plugin.

Nothing here needs a server: the plugin's memory store and in-process
worker, an in-memory broker, SQLite for the ledger, and the real receipt
service on a local port.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from celery.result import AsyncResult
from invoices.config import Config
from invoices.ledger import add_invoice, entries, post_charge
from invoices.receipts import ReceiptService
from invoices.tasks import CHARGE
from invoices.timeline import Timeline

from celery_leases import Acquired, LeaseState, LeaseStore, Refusal, RefusalReason, signals
from celery_leases.pytest_plugin import LeaseFaults

WAIT = 30.0


def wait_for(probe: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT
    while not (value := probe()):
        assert time.monotonic() < deadline, f"waited {WAIT} s for {what}"
        time.sleep(0.05)
    return value


def events(config: Config, job_id: str) -> list[tuple[str, int | None]]:
    return [(e.event, e.generation) for e in Timeline(config.timeline_path).events(job_id)]


@pytest.mark.usefixtures("leases_worker")
def test_a_charge_writes_one_ledger_entry_and_a_receipt(
    leases_app: Any,
    lease_store: LeaseStore,
    ledger: sa.Engine,
    receipts: ReceiptService,
    config: Config,
) -> None:
    invoice = add_invoice(ledger, "ACME Ltd", 4_200)
    result = leases_app.send_task(CHARGE, args=[invoice])
    value = result.get(timeout=WAIT)
    record = lease_store.get(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert value["generation"] == record.generation
    [entry] = entries(ledger)
    assert (entry.invoice_id, entry.amount_cents, entry.generation) == (
        invoice,
        4_200,
        record.generation,
    )
    assert receipts.receipts[str(invoice)]["generation"] == record.generation
    assert [event for event, _ in events(config, result.id)] == [
        "claimed",
        "ledger write accepted",
        "receipt accepted",
        "completed",
    ]


# --8<-- [start:lost-lease]
@pytest.mark.usefixtures("leases_worker")
def test_a_lost_lease_writes_nothing_and_records_no_result(
    leases_app: Any,
    lease_store: LeaseStore,
    lease_faults: LeaseFaults,
    ledger: sa.Engine,
    receipts: ReceiptService,
    config: Config,
) -> None:
    """The lease is taken over right after the claim, before this run hears
    of it; a newer run writes first."""
    invoice = add_invoice(ledger, "ACME Ltd", 900)
    newer: list[Any] = []

    def lose_it(sender: Any, lease: Any, **_: Any) -> None:
        # runs in the worker thread, between the claim and the body
        # steal(), not lose(): a lease already seen lost never starts its body
        stolen = lease_faults.steal(lease)
        post_charge(ledger, stolen, invoice, "newer run")
        lease_store.complete(stolen.job_id, stolen.owner, stolen.generation)
        newer.append((lease.generation, stolen))

    signals.lease_claimed.connect(lose_it, weak=False)
    try:
        result = leases_app.send_task(CHARGE, args=[invoice])
        wait_for(
            lambda: "completion refused" in [e for e, _ in events(config, result.id)],
            "the stale run to be fenced out",
        )
    finally:
        signals.lease_claimed.disconnect(lose_it)
    [(stale, stolen)] = newer
    assert stolen.generation > stale
    seen = events(config, result.id)
    assert ("ledger write refused", stale) in seen
    assert ("completion refused", stale) in seen
    assert "completed" not in [event for event, _ in seen]
    assert [(e.worker, e.generation) for e in entries(ledger)] == [("newer run", stolen.generation)]
    assert str(invoice) not in receipts.receipts
    assert AsyncResult(result.id, app=leases_app).state not in ("SUCCESS", "FAILURE")


# --8<-- [end:lost-lease]


# --8<-- [start:store-down]
@pytest.mark.usefixtures("leases_worker")
def test_a_charge_sent_while_the_store_is_down_runs_once_it_is_back(
    leases_app: Any,
    lease_faults: LeaseFaults,
    ledger: sa.Engine,
    config: Config,
) -> None:
    invoice = add_invoice(ledger, "ACME Ltd", 1_000)
    timeline = Timeline(config.timeline_path)
    with lease_faults.store_down():
        result = leases_app.send_task(CHARGE, args=[invoice])
        [deferred] = wait_for(lambda: timeline.events(result.id), "the deferral")
        assert deferred.event == "deferred"
        assert deferred.detail.startswith("store-unavailable")
        assert entries(ledger) == []
    assert result.get(timeout=WAIT)["invoice"] == invoice
    assert [e.invoice_id for e in entries(ledger)] == [invoice]


# --8<-- [end:store-down]


def test_steal_without_a_worker_makes_the_holder_stale(
    lease_store: LeaseStore, lease_faults: LeaseFaults
) -> None:
    first = lease_store.claim("invoice-7", "worker-a", 30.0)
    assert isinstance(first, Acquired)
    stolen = lease_faults.steal("invoice-7")
    assert stolen.generation > first.generation  # max(previous + 1, the store's clock)
    refused = lease_store.complete("invoice-7", "worker-a", first.generation)
    assert isinstance(refused, Refusal)
    assert refused.reason is RefusalReason.SUPERSEDED
