"""Tests of ``payments.py`` on the celery-leases pytest plugin: copy them next to your app."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import payments
import pytest
import sqlalchemy as sa
from celery.result import AsyncResult

from celery_leases import LeaseStore, signals
from celery_leases.fencing.sql import fenced_update
from celery_leases.pytest_plugin import LeaseFaults

WAIT = 30.0


# --8<-- [start:fixtures]
@pytest.fixture
def leases_app() -> Any:
    """The plugin's app is ours, on the in-memory broker and result backend."""
    payments.app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        leases_defer_backoff=0.2,  # a store outage is retried quickly
    )
    return payments.app


@pytest.fixture(autouse=True)
def database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[sa.Engine]:
    """The task writes to a temporary database, never to the real one."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'payments.db'}")
    payments.metadata.create_all(engine)
    monkeypatch.setattr(payments, "engine", engine)
    yield engine
    engine.dispose()


def add_payment(engine: sa.Engine) -> int:
    with engine.begin() as conn:
        key = conn.execute(sa.insert(payments.payments)).inserted_primary_key
    assert key is not None
    return int(key[0])


def status(engine: sa.Engine, payment: int) -> tuple[str, int | None]:
    table = payments.payments
    with engine.connect() as conn:
        row = conn.execute(sa.select(table).where(table.c.id == payment)).one()
    return row.status, row.fence_generation


@contextlib.contextmanager
def signal_seen(signal: Any) -> Iterator[threading.Event]:
    """An event set when ``signal`` is sent (the worker runs in a thread of this process)."""
    seen = threading.Event()

    def receiver(**_: Any) -> None:
        seen.set()

    signal.connect(receiver, weak=False)
    try:
        yield seen
    finally:
        signal.disconnect(receiver)


# --8<-- [end:fixtures]


# --8<-- [start:runs]
@pytest.mark.usefixtures("leases_worker")
def test_pay_marks_the_payment_with_its_generation(
    lease_store: LeaseStore, database: sa.Engine
) -> None:
    payment = add_payment(database)
    result = payments.pay.delay(payment)
    generation = result.get(timeout=WAIT)
    record = lease_store.get(result.id)
    assert record is not None
    assert record.generation == generation
    assert status(database, payment) == ("paid", generation)


# --8<-- [end:runs]


# --8<-- [start:lost-lease]
@pytest.mark.usefixtures("leases_worker")
def test_a_lost_lease_writes_nothing_and_records_no_result(
    leases_app: Any, lease_faults: LeaseFaults, database: sa.Engine
) -> None:
    """The lease is lost right after the claim; a newer run writes first."""
    payment = add_payment(database)
    newer: list[int] = []

    def lose_it(sender: Any, lease: Any, **_: Any) -> None:
        # runs in the worker thread, between the claim and the body
        stolen = lease_faults.lose(lease)
        with database.begin() as conn:
            table = payments.payments
            fenced_update(
                conn, table, {"status": "paid"}, where=table.c.id == payment, token=stolen
            )
        newer.append(stolen.generation)

    signals.lease_claimed.connect(lose_it, weak=False)
    try:
        with signal_seen(signals.lease_fenced_out) as fenced_out:
            result = payments.pay.delay(payment)
            assert fenced_out.wait(WAIT), "the stale run was not fenced out"
    finally:
        signals.lease_claimed.disconnect(lose_it)
    assert status(database, payment) == ("paid", newer[0])  # the newer run's write stays
    assert AsyncResult(result.id, app=leases_app).state not in ("SUCCESS", "FAILURE")


# --8<-- [end:lost-lease]


# --8<-- [start:store-down]
@pytest.mark.usefixtures("leases_worker")
def test_a_payment_sent_while_the_store_is_down_runs_once_it_is_back(
    lease_faults: LeaseFaults, database: sa.Engine
) -> None:
    payment = add_payment(database)
    with signal_seen(signals.duplicate_deferred) as deferred, lease_faults.store_down():
        result = payments.pay.delay(payment)
        assert deferred.wait(WAIT), "the claim was not deferred"
        assert status(database, payment) == ("due", None)
    generation = result.get(timeout=WAIT)
    assert status(database, payment) == ("paid", generation)


# --8<-- [end:store-down]
