"""Tests of the tutorial's shop, on the celery-leases pytest plugin."""

from __future__ import annotations

from typing import Any

import pytest
import shop
import sqlalchemy as sa

from celery_leases import LeaseStore, StaleFencingToken
from celery_leases.fencing.sql import fenced_update
from celery_leases.pytest_plugin import LeaseFaults


@pytest.fixture
def leases_app() -> Any:
    """The plugin's app is ours, on the in-memory broker and result backend."""
    shop.app.conf.update(broker_url="memory://", result_backend="cache+memory://")
    return shop.app


def status(order: int) -> tuple[str, int | None]:
    with shop.engine.connect() as conn:
        row = conn.execute(sa.select(shop.orders).where(shop.orders.c.id == order)).one()
    return row.status, row.fence_generation


@pytest.mark.usefixtures("leases_worker")
def test_charge_marks_the_order_with_its_generation(lease_store: LeaseStore) -> None:
    order = shop.add_order()
    result = shop.charge.delay(order)
    generation = result.get(timeout=30)
    record = lease_store.get(result.id)
    assert record is not None
    assert record.generation == generation
    assert status(order) == ("charged", generation)


def test_a_stale_holder_cannot_write_after_a_newer_one(
    lease_store: LeaseStore, lease_faults: LeaseFaults
) -> None:
    order = shop.add_order()
    old = lease_store.claim("charge-order", "worker-a", 30.0)
    new = lease_faults.steal("charge-order")  # worker-a is now a stale holder
    with shop.engine.begin() as conn:
        fenced_update(
            conn, shop.orders, {"status": "charged"}, where=shop.orders.c.id == order, token=new
        )
    with pytest.raises(StaleFencingToken), shop.engine.begin() as conn:
        fenced_update(
            conn, shop.orders, {"status": "open"}, where=shop.orders.c.id == order, token=old
        )
    assert status(order) == ("charged", new.generation)
