"""Heartbeat: batched renewals on a daemon thread, losses, outages, failures.

Most run on a local clock moved by hand (:class:`LocalClock`) and drive the
deadline thread's work with ``tick()``; a renewal still runs on a real
renewal thread, and the tests wait for its effect (``lease.renewals``, the
store's recorded batches, the thread's end). The tests of the deadline
itself run on real time with short leases; every wait is bounded and generous.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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
        self.failures = 0
        self.explode_once = False

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        if self.explode_once:
            self.explode_once = False
            raise RuntimeError("bug in a store (test)")
        if self.down:
            self.failures += 1
            raise StoreUnavailable("store is down (test)")
        self.batches.append(len(requests))
        return super()._renew_many(requests)


def claim(
    store: MemoryStore,
    job_id: str,
    lost: list[Lease],
    timing: LeaseTiming = TIMING,
    clock: Callable[[], float] = time.monotonic,
) -> Lease:
    return claimed_lease(store, job_id, timing, on_lost=lost.append, clock=clock)


class LocalClock:
    """The local monotonic clock of the heartbeat and its leases, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> LocalClock:
    return LocalClock()


@pytest.fixture
def manual_heartbeat(clock: LocalClock) -> Iterator[Heartbeat]:
    """A heartbeat on the hand-moved clock, without jitter: a lease is due
    exactly when the clock reaches its renewal time."""
    beat = Heartbeat(clock=clock, jitter=0.0)
    yield beat
    beat.stop()
    assert not beat.running


def hold(heartbeat: Heartbeat, *leases: Lease) -> None:
    """Add ``leases``, then stop the deadline thread: the test does its work
    by calling ``tick()``, and no tick of the thread's races with the test's."""
    for lease in leases:
        heartbeat.add(lease)
    heartbeat.stop()
    assert not heartbeat.running


def renew_once_more(heartbeat: Heartbeat, clock: LocalClock, lease: Lease) -> None:
    """Move the clock to the lease's next renewal, tick, and wait for the renewal."""
    renewals = lease.renewals
    clock.now = max(clock.now, lease.next_renew_at)
    heartbeat.tick()
    assert wait_for(lambda: lease.renewals > renewals), f"{lease!r} was not renewed"


def renewal_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "celery-leases-renew"}


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


def test_keeps_a_lease_alive_for_several_ttls(
    manual_heartbeat: Heartbeat, clock: LocalClock
) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    lease = claim(store, "job", lost, clock=clock)
    manual_heartbeat.add(lease)
    assert manual_heartbeat.running
    hold(manual_heartbeat)
    started = clock.now
    while clock.now < started + TIMING.ttl * 4:
        renew_once_more(manual_heartbeat, clock, lease)
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


def test_without_jitter_a_lease_is_renewed_only_once_due(
    manual_heartbeat: Heartbeat, clock: LocalClock
) -> None:
    store = RecordingStore()
    lease = claim(store, "job", [], clock=clock)
    lease.next_renew_at = clock.now + 0.05 * TIMING.renew_interval
    due = lease.next_renew_at
    hold(manual_heartbeat, lease)
    assert manual_heartbeat.tick() > 0
    # a renewal, once started, moves the lease's next renewal time at once
    assert lease.next_renew_at == due
    clock.now = due
    manual_heartbeat.tick()
    assert lease.next_renew_at > due
    assert wait_for(lambda: store.batches == [1])
    assert lease.renewals == 1


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
    started: list[int] = []

    class CountingHeartbeat(Heartbeat):
        def _start_renewal(self, store: Any, leases: list[Lease]) -> None:
            started.append(len(leases))
            super()._start_renewal(store, leases)

    heartbeat = CountingHeartbeat(clock=lambda: frozen, jitter=0.1)
    try:
        heartbeat.add(lease)
        assert wait_for(lambda: store.batches == [1], timeout=5)
        for _ in range(3):  # wake-ups while the call hangs
            heartbeat.tick()
        # a renewal call is started by tick() itself: none was, after the first
        assert started == [1]
    finally:
        release.set()
        heartbeat.stop()
    assert store.batches == [1]


def test_short_runs_one_after_another_do_not_wake_the_idle_thread(heartbeat: Heartbeat) -> None:
    store = RecordingStore()
    timing = LeaseTiming(ttl=30, renew_interval=10, drift_margin=1)
    wakes: list[float] = []
    wake = heartbeat._wake
    real_set = wake.set

    def counted_set() -> None:
        wakes.append(time.monotonic())
        real_set()

    wake.set = counted_set  # type: ignore[method-assign]
    first = claim(store, "first", [], timing)
    heartbeat.add(first)
    heartbeat.remove(first)
    wake.set()  # a wake-up that finds no lease: the thread goes idle
    # asleep, with no wake-up pending
    assert wait_for(lambda: heartbeat._sleeping_until != float("inf") and not wake.is_set())
    # idle, the thread sleeps one renew interval, not an hour: a lease added
    # meanwhile is due after it wakes anyway, so adding one does not wake it
    assert heartbeat._sleeping_until <= time.monotonic() + timing.renew_interval
    before = len(wakes)
    for n in range(10):  # each lease is gone before the next one comes
        lease = claim(store, f"job-{n}", [], timing)
        heartbeat.add(lease)
        heartbeat.remove(lease)
    assert len(wakes) == before
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


def test_a_short_outage_does_not_lose_the_lease(
    manual_heartbeat: Heartbeat, clock: LocalClock
) -> None:
    store = RecordingStore()
    lost: list[Lease] = []
    lease = claim(store, "job", lost, clock=clock)
    hold(manual_heartbeat, lease)
    renew_once_more(manual_heartbeat, clock, lease)
    store.down = True
    clock.now = lease.next_renew_at
    manual_heartbeat.tick()  # this renewal fails: the store is down
    assert wait_for(lambda: store.failures == 1)
    assert lease.renewals == 1
    store.down = False
    started = clock.now
    while clock.now < started + TIMING.ttl * 2:
        renew_once_more(manual_heartbeat, clock, lease)
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
    # the same thread renews the next lease, for two lease times
    assert wait_for(lambda: second.renewals >= round(TIMING.ttl * 2 / TIMING.renew_interval))
    second.check()
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
    hanging = renewal_threads()
    hanging_store.release.set()  # the store answers "renewed", too late
    for thread in hanging:  # each renewal thread applies its reply, then ends
        thread.join(10)
        assert not thread.is_alive()
    assert lease.renewals == 0
    assert lease.lost
    with pytest.raises(LeaseLost):
        lease.check()


def test_hanging_renewals_of_one_store_do_not_pile_up_threads(
    manual_heartbeat: Heartbeat, clock: LocalClock, hanging_store: HangingStore
) -> None:
    # a renewal thread of an earlier test may still be ending: count only this test's
    earlier = renewal_threads()
    leases = [claim(hanging_store, f"job-{n}", [], clock=clock) for n in range(3)]
    hanging_store.hang.set()
    hold(manual_heartbeat, *leases)
    started = clock.now
    most = 0
    # a tick every tenth of a renew interval, up to past every deadline
    while clock.now < started + TIMING.ttl * 2:
        clock.advance(TIMING.renew_interval / 10)
        manual_heartbeat.tick()
        most = max(most, len(renewal_threads() - earlier))
    assert 1 <= most <= MAX_IN_FLIGHT
    assert hanging_store.calls <= MAX_IN_FLIGHT
    assert all(lease.lost for lease in leases)


def test_leases_of_another_store_renew_while_one_store_hangs(
    manual_heartbeat: Heartbeat, clock: LocalClock, hanging_store: HangingStore
) -> None:
    healthy = RecordingStore()
    stuck = claim(hanging_store, "stuck", [], clock=clock)
    fine = claim(healthy, "fine", [], clock=clock)
    hanging_store.hang.set()
    hold(manual_heartbeat, stuck, fine)
    started = clock.now
    while clock.now < started + TIMING.ttl * 3:
        renew_once_more(manual_heartbeat, clock, fine)
    assert stuck.lost
    fine.check()
