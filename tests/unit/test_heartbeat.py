"""Heartbeat: batched renewals on a daemon thread, losses, outages, failures.

These run on real time with short leases; every wait is bounded and generous.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import pytest

from celery_leases import LeaseLost, LeaseTiming, StoreUnavailable
from celery_leases.heartbeat import MAX_IN_FLIGHT, Heartbeat, process_heartbeat
from celery_leases.lease import Lease
from celery_leases.stores.base import Acquired, RenewRequest, RenewResult
from celery_leases.stores.memory import ManualClock, MemoryStore
from tests.leases import claimed_lease

TIMING = LeaseTiming(ttl=0.6, renew_interval=0.15, drift_margin=0.1)


class RecordingStore(MemoryStore):
    """A memory store that counts batched renewals and can fail on demand."""

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        super().__init__(clock)
        self.batches: list[int] = []
        self.down = False
        self.explode_once = False

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        if self.explode_once:
            self.explode_once = False
            raise RuntimeError("bug in a store (test)")
        if self.down:
            raise StoreUnavailable("store is down (test)")
        self.batches.append(len(requests))
        return super()._renew_many(requests)


def claim(
    store: MemoryStore, job_id: str, lost: list[Lease], timing: LeaseTiming = TIMING
) -> Lease:
    return claimed_lease(store, job_id, timing, on_lost=lost.append)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def heartbeat() -> Iterator[Heartbeat]:
    beat = Heartbeat()
    yield beat
    beat.stop()
    assert not beat.running


def test_keeps_a_lease_alive_for_several_ttls(heartbeat: Heartbeat) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    lease = claim(store, "job", lost)
    heartbeat.add(lease)
    assert heartbeat.running
    time.sleep(TIMING.ttl * 4)
    lease.check()
    record = store.get("job")
    assert record is not None
    assert record.renew_count >= 5
    assert record.is_live(store.now_ms())
    assert lost == []


def test_renews_all_leases_of_the_process_in_one_batch(heartbeat: Heartbeat) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    leases = [claim(store, f"job-{n}", lost) for n in range(3)]
    for lease in leases:
        heartbeat.add(lease)
    assert wait_for(lambda: len(store.batches) >= 3)
    assert max(store.batches) == 3  # one round trip renewed all three
    assert lost == []


def test_a_lease_due_within_half_an_interval_rides_in_the_same_call(
    heartbeat: Heartbeat,
) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    first, later = claim(store, "job-1", lost), claim(store, "job-2", lost)
    # as if claimed a third of an interval after the first
    later.next_renew_at = first.next_renew_at + TIMING.renew_interval / 3
    heartbeat.add(first)
    heartbeat.add(later)
    assert wait_for(lambda: len(store.batches) >= 2)
    assert store.batches[:2] == [2, 2]  # one round trip each time, not one per lease
    assert lost == []


def test_a_wake_up_brought_forward_by_the_jitter_renews_what_is_due() -> None:
    """The thread wakes up early by up to `jitter` of an interval, at random;
    the leases due within that much are renewed then, not after more wake-ups."""
    store = RecordingStore()
    lost: list[Lease] = []
    lease = claim(store, "job", lost)
    frozen = time.monotonic()
    lease.next_renew_at = frozen + 0.05 * TIMING.renew_interval
    heartbeat = Heartbeat(clock=lambda: frozen, jitter=0.1)
    try:
        heartbeat.add(lease)
        # the clock stands still: only the jitter can make the lease due
        assert wait_for(lambda: len(store.batches) >= 1, timeout=5)
    finally:
        heartbeat.stop()
    assert store.batches[0] == 1


def test_without_jitter_a_lease_is_renewed_only_once_due() -> None:
    store = RecordingStore()
    lease = claim(store, "job", [])
    frozen = time.monotonic()
    lease.next_renew_at = frozen + 0.05 * TIMING.renew_interval
    heartbeat = Heartbeat(clock=lambda: frozen, jitter=0.0)
    try:
        heartbeat.add(lease)
        assert heartbeat.tick() > 0
        time.sleep(0.2)
    finally:
        heartbeat.stop()
    assert store.batches == []


def test_a_renewal_in_flight_is_not_sent_again_within_the_jitter() -> None:
    """A call that takes its time holds its leases back for the wait it was
    given (here 1 s); the jitter's early allowance (here 2 s) does not apply."""
    release = threading.Event()

    class SlowStore(RecordingStore):
        def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
            self.batches.append(len(requests))
            release.wait(10)
            return MemoryStore._renew_many(self, requests)

    store = SlowStore()
    timing = LeaseTiming(ttl=60, renew_interval=20, drift_margin=1)
    lease = claim(store, "job", [], timing)
    frozen = time.monotonic()
    lease.next_renew_at = frozen
    heartbeat = Heartbeat(clock=lambda: frozen, jitter=0.1)
    try:
        heartbeat.add(lease)
        assert wait_for(lambda: store.batches == [1], timeout=5)
        for _ in range(3):  # wake-ups while the call hangs
            heartbeat.tick()
        time.sleep(0.1)
        assert store.batches == [1]
    finally:
        release.set()
        heartbeat.stop()


def test_short_runs_one_after_another_do_not_wake_the_idle_thread() -> None:
    store = RecordingStore()
    ticks: list[float] = []

    class CountingHeartbeat(Heartbeat):
        def tick(self) -> float:
            ticks.append(time.monotonic())
            return super().tick()

    heartbeat = CountingHeartbeat()
    timing = LeaseTiming(ttl=30, renew_interval=10, drift_margin=1)
    try:
        first = claim(store, "first", [], timing)
        heartbeat.add(first)
        assert wait_for(lambda: len(ticks) >= 1)
        heartbeat.remove(first)
        heartbeat._wake.set()  # a wake-up that finds no lease: the thread goes idle
        assert wait_for(lambda: len(ticks) >= 2)
        time.sleep(0.1)
        # the first add's own wake-up may land after the one above: idle now
        idle = len(ticks)
        for n in range(10):  # each lease is gone before the next one comes
            lease = claim(store, f"job-{n}", [], timing)
            heartbeat.add(lease)
            time.sleep(0.01)
            heartbeat.remove(lease)
        time.sleep(0.1)
    finally:
        heartbeat.stop()
    # idle, the thread sleeps one renew interval, not an hour: a lease added
    # meanwhile is due after it wakes anyway, so adding one does not wake it
    assert len(ticks) == idle, (idle, len(ticks))
    assert idle <= 3
    assert store.batches == []


def test_a_lease_due_more_than_half_an_interval_later_waits_for_its_own_turn(
    heartbeat: Heartbeat,
) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    first, fresh = claim(store, "job-1", lost), claim(store, "job-2", lost)
    # as if claimed just before the first one's renewal: a short task that
    # ends within half an interval is never renewed
    fresh.next_renew_at = first.next_renew_at + TIMING.renew_interval * 0.9
    heartbeat.add(first)
    heartbeat.add(fresh)
    assert wait_for(lambda: len(store.batches) >= 1)
    assert store.batches[0] == 1
    assert lost == []


def test_a_refused_renewal_makes_the_lease_lost(heartbeat: Heartbeat) -> None:
    clock = ManualClock()
    store = RecordingStore(clock)
    lost: list[Lease] = []
    lease = claim(store, "job", lost)
    clock.advance(1)  # by the store's clock the lease ran out ...
    assert isinstance(store.claim("job", "another-worker", 10), Acquired)  # ... and was taken
    heartbeat.add(lease)
    assert wait_for(lambda: lease.lost)
    assert lease.lost_reason == "superseded"
    assert lost == [lease]
    assert heartbeat.held() == []


def test_store_outage_past_the_deadline_loses_the_lease_on_time(heartbeat: Heartbeat) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    lease = claim(store, "job", lost)
    store.down = True
    heartbeat.add(lease)
    deadline = lease.deadline
    assert wait_for(lambda: lease.lost)
    assert lease.lost_reason == "deadline"
    # noticed within one renew interval of the deadline, never before it
    assert deadline <= time.monotonic() < deadline + TIMING.renew_interval + 1.0


def test_a_short_outage_does_not_lose_the_lease(heartbeat: Heartbeat) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    lease = claim(store, "job", lost)
    heartbeat.add(lease)
    assert wait_for(lambda: len(store.batches) >= 1)
    store.down = True
    time.sleep(TIMING.renew_interval * 1.5)
    store.down = False
    time.sleep(TIMING.ttl * 2)
    lease.check()
    assert lost == []


def test_an_unexpected_error_loses_the_leases_of_its_batch_and_the_thread_survives(
    heartbeat: Heartbeat, caplog: pytest.LogCaptureFixture
) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    first = claim(store, "first", lost)
    store.explode_once = True
    heartbeat.add(first)
    assert wait_for(lambda: first.lost)
    assert first.lost_reason == "heartbeat-error"
    # logged from the notifier thread, soon after
    assert wait_for(lambda: "the lease heartbeat failed" in caplog.text)
    assert "RuntimeError: bug in a store" in caplog.text  # with the traceback
    assert heartbeat.running
    second = claim(store, "second", lost)
    heartbeat.add(second)
    time.sleep(TIMING.ttl * 2)
    second.check()  # the same thread renews the next lease
    assert lost == [first]


def test_stop_joins_the_thread_and_add_starts_it_again(heartbeat: Heartbeat) -> None:
    store = RecordingStore()
    lease = claim(store, "job", [])
    heartbeat.add(lease)
    heartbeat.stop()
    assert not heartbeat.running
    heartbeat.add(lease)
    assert heartbeat.running
    assert wait_for(lambda: len(store.batches) >= 1)


def test_one_heartbeat_per_process() -> None:
    assert process_heartbeat() is process_heartbeat()
    assert process_heartbeat().pid == os.getpid()


def test_a_forked_child_gets_its_own_heartbeat() -> None:
    parent = process_heartbeat()
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a process with threads; the child
        # only reads module state and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: report whether it got a fresh heartbeat
        fresh = process_heartbeat() is not parent and process_heartbeat().pid == os.getpid()
        os.write(write, b"1" if fresh else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_the_thread_is_a_daemon(heartbeat: Heartbeat) -> None:
    heartbeat.add(claim(RecordingStore(), "job", []))
    threads = [t for t in threading.enumerate() if t.name == "celery-leases-heartbeat"]
    assert threads
    assert all(t.daemon for t in threads)


def test_a_lease_due_sooner_wakes_a_thread_asleep_for_a_long_lease(
    heartbeat: Heartbeat,
) -> None:
    store = RecordingStore()
    slow = LeaseTiming(ttl=300.0, renew_interval=100.0, drift_margin=1.0)
    heartbeat.add(claim(store, "slow", [], slow))
    # the thread has gone to sleep for about the long lease's interval
    assert wait_for(lambda: heartbeat._sleeping_until != float("inf"))
    fast = claim(store, "fast", [])
    heartbeat.add(fast)
    assert wait_for(lambda: (r := store.get("fast")) is not None and r.renew_count >= 2)
    assert not fast.lost


class HangingStore(MemoryStore):
    """A memory store whose batched renewals hang until released (a black hole)."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        self.calls += 1
        if self.hang.is_set():
            self.release.wait(30)
        return super()._renew_many(requests)


@pytest.fixture
def hanging_store() -> Iterator[HangingStore]:
    store = HangingStore()
    yield store
    store.release.set()


def test_a_renewal_that_hangs_does_not_postpone_the_deadline(
    heartbeat: Heartbeat, hanging_store: HangingStore
) -> None:
    lost: list[Lease] = []
    lease = claim(hanging_store, "job", lost)
    hanging_store.hang.set()
    heartbeat.add(lease)
    deadline = lease.deadline
    assert wait_for(lambda: lost != [])
    assert lease.lost_reason == "deadline"
    # the deadline thread noticed on time, while the renewal still hangs
    assert deadline <= time.monotonic() < deadline + 0.25
    assert not hanging_store.release.is_set()


def test_a_reply_that_comes_after_the_deadline_does_not_revive_the_lease(
    heartbeat: Heartbeat, hanging_store: HangingStore
) -> None:
    lost: list[Lease] = []
    lease = claim(hanging_store, "job", lost)
    hanging_store.hang.set()
    heartbeat.add(lease)
    assert wait_for(lambda: lost != [])
    hanging_store.release.set()  # the store answers "renewed", too late
    time.sleep(TIMING.renew_interval * 2)
    assert lease.lost
    with pytest.raises(LeaseLost):
        lease.check()


def test_hanging_renewals_of_one_store_do_not_pile_up_threads(
    heartbeat: Heartbeat, hanging_store: HangingStore
) -> None:
    # a renewal thread of an earlier test may still be ending: count only this test's
    earlier = set(threading.enumerate())
    leases = [claim(hanging_store, f"job-{n}", []) for n in range(3)]
    hanging_store.hang.set()
    for lease in leases:
        heartbeat.add(lease)
    time.sleep(TIMING.ttl * 2)
    renewers = [
        t for t in threading.enumerate() if t.name == "celery-leases-renew" and t not in earlier
    ]
    assert 1 <= len(renewers) <= MAX_IN_FLIGHT
    assert hanging_store.calls <= MAX_IN_FLIGHT


def test_leases_of_another_store_renew_while_one_store_hangs(
    heartbeat: Heartbeat, hanging_store: HangingStore
) -> None:
    healthy = RecordingStore()
    stuck = claim(hanging_store, "stuck", [])
    fine = claim(healthy, "fine", [])
    hanging_store.hang.set()
    heartbeat.add(stuck)
    heartbeat.add(fine)
    time.sleep(TIMING.ttl * 3)
    assert stuck.lost
    fine.check()
