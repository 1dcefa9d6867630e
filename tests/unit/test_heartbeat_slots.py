"""Renewal slots: a call that hangs gives its slot up at its leases' deadline.

Real time, short leases, bounded waits (see tests/unit/test_heartbeat.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from celery_leases import LeaseTiming
from celery_leases.heartbeat import MAX_IN_FLIGHT, Heartbeat
from celery_leases.lease import Lease
from celery_leases.stores.base import RenewRequest, RenewResult
from celery_leases.stores.deadline import time_left
from celery_leases.stores.memory import MemoryStore
from tests.leases import claimed_lease

SHORT = LeaseTiming(ttl=0.6, renew_interval=0.15, drift_margin=0.1)
LONG = LeaseTiming(ttl=3.0, renew_interval=0.3, drift_margin=0.1)


class FirstCallsHang(MemoryStore):
    """A memory store whose first ``count`` batched renewals hang (a black
    hole that swallowed them) until the test ends; later ones answer."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.release = threading.Event()
        self.calls = 0
        self.time_left: list[float | None] = []
        self._lock = threading.Lock()

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        with self._lock:
            self.calls += 1
            hangs = self.calls <= self.count
            self.time_left.append(time_left())
        if hangs:
            self.release.wait(60)
        return super()._renew_many(requests)


@pytest.fixture
def heartbeat() -> Iterator[Heartbeat]:
    beat = Heartbeat()
    yield beat
    beat.stop()


def wait_for(condition: object, timeout: float = 15.0) -> bool:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


def test_hung_renewals_give_their_slots_up_at_their_leases_deadline(
    heartbeat: Heartbeat,
) -> None:
    store = FirstCallsHang(MAX_IN_FLIGHT)
    lost: list[Lease] = []
    try:
        # one hung call per lease: the second is added once the first hangs
        first = claimed_lease(store, "first", SHORT, on_lost=lost.append)
        heartbeat.add(first)
        assert wait_for(lambda: store.calls >= 1)
        second = claimed_lease(store, "second", SHORT, on_lost=lost.append)
        heartbeat.add(second)
        assert wait_for(lambda: store.calls >= MAX_IN_FLIGHT)
        # every slot is held by a call that hangs, past the first deadline
        assert wait_for(lambda: first.lost)
        later = claimed_lease(store, "later", LONG, on_lost=lost.append)
        heartbeat.add(later)
        # the hung calls still hang, but no longer hold the slots
        assert wait_for(lambda: (r := store.get("later")) is not None and r.renew_count >= 2)
        assert not later.lost
        assert not store.release.is_set()
    finally:
        store.release.set()


def test_a_renewal_call_is_bounded_by_its_leases_earliest_deadline(
    heartbeat: Heartbeat,
) -> None:
    store = FirstCallsHang(0)
    lease = claimed_lease(store, "job", SHORT, on_lost=lambda lease: None)
    heartbeat.add(lease)
    assert wait_for(lambda: store.calls >= 2)
    bounds = list(store.time_left)
    # each call ran inside a deadline, never past the lease's own (ttl less
    # the drift margin, counted from before the claim)
    assert all(b is not None and 0 < b <= SHORT.ttl for b in bounds), bounds
    assert not lease.lost
