"""The heartbeat against a real SQLite store whose write lock another body holds.

One body's long ``fenced_transaction`` holds SQLite's write lock, so every
renewal of the process waits for it (up to the 10 s busy timeout). The other
leases of the process must still be lost on time, by their own deadlines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_leases import LeaseTiming, open_store
from celery_leases.fencing.sql import fenced_transaction
from celery_leases.heartbeat import Heartbeat
from celery_leases.lease import Lease
from celery_leases.stores.base import LeaseStore
from tests.leases import claimed_lease

TIMING = LeaseTiming(ttl=1.2, renew_interval=0.3, drift_margin=0.2)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LeaseStore]:
    opened = open_store(f"sqlite:///{tmp_path / 'leases.db'}")
    yield opened
    opened.close()


def claim(store: LeaseStore, job_id: str, lost: list[tuple[Lease, float]]) -> Lease:
    return claimed_lease(
        store, job_id, TIMING, on_lost=lambda lease: lost.append((lease, time.monotonic()))
    )


def test_a_transaction_holding_the_store_does_not_hide_other_deadlines(
    store: LeaseStore,
) -> None:
    lost: list[tuple[Lease, float]] = []
    holder = claim(store, "long-transaction", lost)
    other = claim(store, "other-job", lost)
    heartbeat = Heartbeat()
    heartbeat.add(other)
    inside = threading.Event()
    finish = threading.Event()

    def long_transaction() -> None:
        with fenced_transaction(store, holder) as conn:  # type: ignore[arg-type]  # an SqlStore
            inside.set()
            finish.wait(8)
            conn.exec_driver_sql("SELECT 1")

    body = threading.Thread(target=long_transaction)
    body.start()
    try:
        assert inside.wait(5)
        deadline = other.deadline
        end = time.monotonic() + 5
        while not lost and time.monotonic() < end:
            time.sleep(0.01)
        [(lease, noticed)] = lost
        assert lease is other
        assert other.lost_reason == "deadline"
        assert deadline <= noticed < deadline + 0.3  # while the renewal still waits
    finally:
        finish.set()
        body.join(10)
        heartbeat.stop()
