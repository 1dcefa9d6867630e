"""Lease: local deadline, check/ensure, lost notification, asynchronous interrupt."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from datetime import timezone

import pytest

from celery_leases import LeaseConfigurationError, LeaseLost, LeaseTiming, StoreUnavailable, owners
from celery_leases.lease import Lease, make_owner
from celery_leases.stores.base import (
    Acquired,
    Completed,
    Refusal,
    RefusalReason,
    Renewed,
    RenewRequest,
    RenewResult,
)
from celery_leases.stores.memory import ManualClock, MemoryStore
from tests.leases import claimed_lease

TIMING = LeaseTiming(ttl=10.0, renew_interval=3.0, drift_margin=1.0)


class LocalClock:
    """The worker's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FlakyStore(MemoryStore):
    """A memory store whose renewals fail with StoreUnavailable while ``down``."""

    down = False

    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        if self.down:
            raise StoreUnavailable("store is down (test)")
        return super()._renew(job_id, owner, generation, ttl_ms)

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        if self.down:
            raise StoreUnavailable("store is down (test)")
        return super()._renew_many(requests)


def claim(
    store: MemoryStore, local: LocalClock, lost: list[Lease] | None = None, job_id: str = "job-1"
) -> Lease:
    return claimed_lease(
        store, job_id, TIMING, on_lost=None if lost is None else lost.append, clock=local
    )


@pytest.fixture
def local() -> LocalClock:
    return LocalClock()


@pytest.fixture
def store_clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(store_clock: ManualClock) -> FlakyStore:
    return FlakyStore(clock=store_clock)


def test_owner_token_is_new_per_call_and_names_the_process() -> None:
    first, second = make_owner(), make_owner()
    assert first != second
    assert f":{os.getpid()}:" in first


def test_owner_tokens_of_a_process_forked_without_hooks_are_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parent = make_owner()
    monkeypatch.setattr(owners.os, "getpid", lambda: 4242424)
    child_first, child_second = make_owner(), make_owner()
    assert ":4242424:" in child_first
    assert child_first.rsplit(":", 1)[1].split("-")[0] != parent.rsplit(":", 1)[1].split("-")[0]
    assert child_first.endswith("-1")
    assert child_second.endswith("-2")


def test_remaining_counts_from_before_the_claim_minus_the_drift_margin(
    store: FlakyStore, local: LocalClock
) -> None:
    lease = claim(store, local)
    assert lease.remaining() == pytest.approx(9.0)
    local.now += 4
    assert lease.remaining() == pytest.approx(5.0)
    local.now += 100
    assert lease.remaining() == 0.0


def test_fencing_fields(store: FlakyStore, local: LocalClock, store_clock: ManualClock) -> None:
    lease = claim(store, local)
    assert lease.generation == store_clock.now_ms  # first claim: the store's clock
    assert lease.idempotency_key == f"job-1:{lease.generation}"
    assert lease.lease_until.tzinfo is timezone.utc
    assert lease.lease_until.timestamp() * 1000 == store_clock.now_ms + 10_000


def test_check_passes_before_the_deadline(store: FlakyStore, local: LocalClock) -> None:
    lease = claim(store, local)
    local.now += 8.9
    lease.check()
    assert not lease.lost


def test_check_raises_past_the_deadline_and_notifies_once(
    store: FlakyStore, local: LocalClock
) -> None:
    lost: list[Lease] = []
    lease = claim(store, local, lost)
    local.now += 9.0
    with pytest.raises(LeaseLost, match="local safe deadline") as info:
        lease.check()
    assert info.value.reason == "deadline"
    assert info.value.job_id == "job-1"
    assert info.value.generation == lease.generation
    with pytest.raises(LeaseLost):
        lease.check()
    assert lease.lost
    assert lease.lost_reason == "deadline"
    assert lost == [lease]


def test_ensure_renews_when_too_little_remains(
    store: FlakyStore, local: LocalClock, store_clock: ManualClock
) -> None:
    lease = claim(store, local)
    local.now += 6
    store_clock.advance(6)
    lease.ensure(5.0)
    record = store.get("job-1")
    assert record is not None
    assert record.renew_count == 1
    assert lease.remaining() == pytest.approx(9.0)
    assert lease.lease_until.timestamp() * 1000 == record.lease_until_ms


def test_ensure_does_not_renew_when_enough_remains(store: FlakyStore, local: LocalClock) -> None:
    lease = claim(store, local)
    lease.ensure(5.0)
    record = store.get("job-1")
    assert record is not None
    assert record.renew_count == 0


def test_ensure_refused_makes_the_lease_lost(
    store: FlakyStore, local: LocalClock, store_clock: ManualClock
) -> None:
    lost: list[Lease] = []
    lease = claim(store, local, lost)
    store_clock.advance(11)  # the store lets someone else claim
    assert isinstance(store.claim("job-1", "other", 10), Acquired)
    local.now += 7
    with pytest.raises(LeaseLost, match="refused") as info:
        lease.ensure(5.0)
    assert info.value.reason == "superseded"
    assert lease.lost
    assert lost == [lease]


def test_ensure_with_the_store_down_raises_but_keeps_the_lease(
    store: FlakyStore, local: LocalClock
) -> None:
    lease = claim(store, local)
    local.now += 6
    store.down = True
    with pytest.raises(LeaseLost, match="unavailable") as info:
        lease.ensure(5.0)
    assert info.value.reason == "unavailable"
    assert isinstance(info.value.__cause__, StoreUnavailable)
    assert not lease.lost


def test_ensure_refuses_more_than_a_renewal_can_give(store: FlakyStore, local: LocalClock) -> None:
    lease = claim(store, local)
    with pytest.raises(LeaseConfigurationError, match="raise the task's lease_ttl"):
        lease.ensure(9.0)


def test_a_renewal_never_moves_the_deadline_back(
    store: FlakyStore, local: LocalClock, store_clock: ManualClock
) -> None:
    lease = claim(store, local)
    local.now += 5
    lease.ensure(8.0)  # renewed: deadline now 1014
    deadline = lease.deadline
    old = store.renew("job-1", lease.owner, lease.generation, 10)
    assert isinstance(old, Renewed)
    lease.apply_renewal(started_at=1000.0, result=old)  # a late reply of an older request
    assert lease.deadline == deadline


def test_no_renewal_counts_after_the_lease_is_lost(store: FlakyStore, local: LocalClock) -> None:
    lease = claim(store, local)
    local.now += 9
    assert lease.expire_if_due()
    result = store.renew("job-1", lease.owner, lease.generation, 10)
    lease.apply_renewal(local(), result)
    assert lease.lost
    assert lease.remaining() == 0.0


def test_a_failing_lost_handler_does_not_break_mark_lost(
    store: FlakyStore, local: LocalClock, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(lease: Lease) -> None:
        raise RuntimeError("handler bug")

    lease = claim(store, local)
    lease._on_lost = explode
    local.now += 9
    assert lease.expire_if_due()
    assert "lost-lease handler" in caplog.text


def run_in_body(lease: Lease, started: threading.Event, outcome: list[BaseException]) -> None:
    lease.enter_body()
    started.set()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.001)
    except LeaseLost as exc:
        outcome.append(exc)
    finally:
        lease.leave_body()


def test_interrupt_raises_lease_lost_in_the_body_thread(
    store: FlakyStore, local: LocalClock
) -> None:
    lease = claim(store, local)
    started = threading.Event()
    outcome: list[BaseException] = []
    thread = threading.Thread(target=run_in_body, args=(lease, started, outcome))
    thread.start()
    started.wait(5)
    local.now += 9
    lease.expire_if_due()
    assert lease.interrupt()
    thread.join(5)
    assert not thread.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], LeaseLost)
    assert outcome[0].reason == "deadline"
    assert outcome[0].job_id == "job-1"
    assert not lease.interrupt()  # never twice


def test_interrupt_is_not_sent_outside_the_body(store: FlakyStore, local: LocalClock) -> None:
    lease = claim(store, local)
    lease.enter_body()
    try:
        local.now += 9
        lease.expire_if_due()
        assert not lease.interrupt()  # the calling thread is the body's own
    finally:
        lease.leave_body()
    assert not lease.interrupt()  # body not running


def test_a_lease_past_its_deadline_never_enters_its_body(
    store: FlakyStore, local: LocalClock
) -> None:
    lost: list[Lease] = []
    lease = claim(store, local, lost)
    local.now = lease.deadline  # nobody noticed yet: the body's start does
    with pytest.raises(LeaseLost) as raised:
        lease.enter_body()
    assert raised.value.reason == "deadline"
    assert not lease.in_body
    assert lost == [lease]  # noticed once, outside the body: nothing to interrupt


def test_a_lost_lease_never_enters_its_body(store: FlakyStore, local: LocalClock) -> None:
    lease = claim(store, local)
    lease.hand_over("retry")
    with pytest.raises(LeaseLost) as raised:
        lease.enter_body()
    assert raised.value.reason == "handed-over"
    assert not lease.in_body


def test_interrupt_of_a_live_lease_does_nothing(store: FlakyStore, local: LocalClock) -> None:
    lease = claim(store, local)
    assert not lease.interrupt()


def test_lost_reads_the_clock_itself(store: FlakyStore, local: LocalClock) -> None:
    lost: list[Lease] = []
    lease = claim(store, local, lost)
    assert not lease.lost
    local.now = lease.deadline  # no heartbeat, no other thread: only the clock moved
    assert lease.lost
    assert lease.lost_reason == "deadline"
    assert lost == [lease]


def test_a_renewal_sent_in_time_but_answered_past_the_deadline_does_not_revive(
    store: FlakyStore, local: LocalClock
) -> None:
    lost: list[Lease] = []
    lease = claim(store, local, lost)
    sent = local() + 5
    result = store.renew("job-1", lease.owner, lease.generation, 10)
    local.now = lease.deadline + 0.5  # the reply arrives after the deadline
    lease.apply_renewal(sent, result)
    assert lease.lost
    assert lost == [lease]


def test_a_refusal_naming_this_run_as_completer_is_not_a_loss(
    store: FlakyStore, local: LocalClock
) -> None:
    lost: list[Lease] = []
    lease = claim(store, local, lost)
    # a renewal was on the wire while the completion went through
    assert isinstance(store.complete("job-1", lease.owner, lease.generation), Completed)
    refused = store.renew("job-1", lease.owner, lease.generation, 10)
    assert isinstance(refused, Refusal)
    lease.apply_renewal(local(), refused)
    assert not lease.lost
    assert lost == []


def test_nothing_counts_as_lost_once_the_run_finished(store: FlakyStore, local: LocalClock) -> None:
    lost: list[Lease] = []
    lease = claim(store, local, lost)
    lease.finish()
    refused = Refusal("job-1", lease.owner, lease.generation, RefusalReason.SUPERSEDED)
    lease.apply_renewal(local(), refused)
    local.now = lease.deadline + 1
    assert not lease.expire_if_due()
    assert lost == []


def test_voided_renewals_leave_the_committed_time_and_a_late_reply_is_not_applied(
    store: FlakyStore, local: LocalClock
) -> None:
    """Renewals made in a transaction that rolled back never happened."""
    lease = claim(store, local)
    committed = lease.deadline  # what the committed record gives: 1009
    local.now += 3
    lease.apply_renewal(local.now, Renewed(lease.job_id, lease.generation, 10**13, 0))
    assert lease.deadline == pytest.approx(1012.0)
    local.now += 1
    sent = local.now  # a renewal on the wire when the transaction rolls back
    lease.void_renewals(committed, lease.lease_until_ms)
    assert lease.deadline == committed
    assert lease.next_renew_at <= local.now  # renewed again from the store at once
    local.now += 0.5
    lease.apply_renewal(sent, Renewed(lease.job_id, lease.generation, 10**13, 0))
    assert lease.deadline == committed
    lease.apply_renewal(local.now, Renewed(lease.job_id, lease.generation, 10**13, 0))
    assert lease.deadline == pytest.approx(local.now + 9.0)
