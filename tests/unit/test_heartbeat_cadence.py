"""The heartbeat renews at the configured cadence, measured on the store's clock.

A heartbeat that renews too seldom still keeps a lease alive while the
interval stays below the TTL minus the margin, so "the lease stayed alive"
cannot tell a heartbeat renewing every interval from one renewing every
1.5 intervals. This test times each renewal the store accepts, in store
time, over many intervals, and bounds the typical gap between two renewals.

What the heartbeat does with interval ``I`` and jitter ``j`` (0.1): each
wake-up comes early by a random part of ``j * I``, so the gap between two
renewals is uniform in ``[0.9 I, I]`` (median 0.95 I), plus the latency of
waking a thread and one store call. A cadence 1.5 times slower has gaps in
``[1.4 I, 1.5 I]``. The median gap must lie below 1.2 I: load can delay a
renewal (never bring one forward), and the median ignores the few gaps that
a stalled machine stretches, while a slower cadence moves every gap.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from celery_leases import LeaseTiming
from celery_leases.heartbeat import Heartbeat
from celery_leases.lease import Lease
from celery_leases.stores.base import RenewRequest, RenewResult
from celery_leases.stores.memory import MemoryStore
from tests.leases import claimed_lease

INTERVAL = 0.4
TIMING = LeaseTiming(ttl=3.0, renew_interval=INTERVAL, drift_margin=0.3)
#: gaps measured: enough that a few stretched by load do not move the median
GAPS = 25


class TimedStore(MemoryStore):
    """A memory store that notes the store time of every renewal it accepts."""

    def __init__(self) -> None:
        super().__init__()
        self.renewed_at_ms: list[int] = []
        self.changed = threading.Condition()

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        results = super()._renew_many(requests)
        with self.changed:
            self.renewed_at_ms.append(self.now_ms())
            self.changed.notify_all()
        return results


@pytest.fixture
def heartbeat() -> Iterator[Heartbeat]:
    beat = Heartbeat()
    yield beat
    beat.stop()


def test_the_heartbeat_renews_once_per_interval_in_store_time(heartbeat: Heartbeat) -> None:
    store = TimedStore()
    lost: list[Lease] = []
    lease = claimed_lease(store, "job", TIMING, on_lost=lost.append)
    heartbeat.add(lease)
    # generous: a 1.5 times slower cadence still ends well inside it
    limit = time.monotonic() + GAPS * INTERVAL * 3
    with store.changed:
        while len(store.renewed_at_ms) < GAPS + 1 and time.monotonic() < limit:
            store.changed.wait(timeout=0.5)
        times = list(store.renewed_at_ms)
    assert lost == []
    assert len(times) >= GAPS + 1, f"only {len(times)} renewals in {GAPS * INTERVAL * 3:g} s"
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(times[: GAPS + 1])]
    median = statistics.median(gaps)
    # never more often than the jitter allows (a renewal in a tight loop)
    assert median >= 0.85 * INTERVAL, f"median gap {median:.3f} s: renewing too often"
    # a cadence 1.5 times slower gives a median of about 1.45 intervals
    assert median <= 1.2 * INTERVAL, (
        f"median gap {median:.3f} s for an interval of {INTERVAL:g} s: renewing too seldom "
        f"(gaps {[round(g, 3) for g in gaps]})"
    )
    # over the whole window too: at most a handful of gaps stretched by load
    window = (times[GAPS] - times[0]) / 1000
    assert window <= GAPS * INTERVAL * 1.3, (
        f"{GAPS} renewals took {window:.2f} s of store time; expected about "
        f"{GAPS * INTERVAL * 0.95:.2f} s"
    )
