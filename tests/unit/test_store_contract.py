"""The store contract on the memory store with a manual clock: fast, no sleeping.

The same behaviours run against every real store in
``tests/integration/test_conformance.py``; here time is moved by hand, so the
edges of a lease (the exact millisecond it runs out) can be tested exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from celery_leases import (
    Acquired,
    AlreadyCompleted,
    Completed,
    HeldElsewhere,
    LeaseConfigurationError,
    LeaseError,
    LeaseLost,
    LeaseState,
    Refusal,
    RefusalReason,
    Released,
    Renewed,
    RenewRequest,
)
from celery_leases.stores.base import MIN_RETENTION, LeaseStore
from celery_leases.stores.memory import ManualClock, MemoryStore

JOB = "job-1"
A = "worker-a"
B = "worker-b"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> MemoryStore:
    return MemoryStore(clock=clock)


def acquire(store: LeaseStore, owner: str = A, ttl: float = 10, job_id: str = JOB) -> Acquired:
    result = store.claim(job_id, owner, ttl)
    assert isinstance(result, Acquired), result
    return result


# --- claim -----------------------------------------------------------------


def test_first_claim_gets_the_store_clock_as_generation(
    store: MemoryStore, clock: ManualClock
) -> None:
    result = acquire(store, ttl=10)
    assert result.generation == clock.now_ms
    assert result.store_now_ms == clock.now_ms
    assert result.lease_until_ms == clock.now_ms + 10_000
    assert result.ttl == 10
    assert result.owner == A
    assert result.takeovers == 0


def test_claim_while_held_reports_the_holder(store: MemoryStore, clock: ManualClock) -> None:
    first = acquire(store, ttl=10)
    clock.advance(4)
    result = store.claim(JOB, B, 10)
    assert result == HeldElsewhere(JOB, A, first.generation, 6.0)


def test_claim_by_the_holder_itself_is_held_elsewhere(store: MemoryStore) -> None:
    first = acquire(store)
    result = store.claim(JOB, A, 10)
    assert isinstance(result, HeldElsewhere)
    assert result.holder == A
    assert result.generation == first.generation


def test_lease_is_live_until_its_last_millisecond(store: MemoryStore, clock: ManualClock) -> None:
    first = acquire(store, ttl=1)
    clock.advance(0.999)
    assert isinstance(store.claim(JOB, B, 1), HeldElsewhere)
    clock.advance(0.001)
    second = store.claim(JOB, B, 1)
    assert isinstance(second, Acquired)
    # the clock moved on by a whole second: the generation follows it
    assert second.generation == first.generation + 1000


def test_worked_example_stale_holder_is_refused(store: MemoryStore, clock: ManualClock) -> None:
    a = acquire(store, A, ttl=1)
    clock.advance(1.5)
    b = acquire(store, B, ttl=10)
    assert b.generation == a.generation + 1500
    assert b.takeovers == 1

    for refused in (store.renew(JOB, A, a.generation, 1), store.complete(JOB, A, a.generation)):
        assert isinstance(refused, Refusal)
        assert refused.reason is RefusalReason.SUPERSEDED
        assert refused.current_generation == b.generation
        assert refused.current_owner == B

    assert store.complete(JOB, B, b.generation) == Completed(JOB, b.generation)
    assert store.claim(JOB, A, 1) == AlreadyCompleted(JOB, b.generation)


def test_claim_after_release_is_not_a_takeover(store: MemoryStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    second = acquire(store, B)
    assert second.takeovers == 0
    record = store.get(JOB)
    assert record is not None
    assert record.takeovers == 0


# --- renew -----------------------------------------------------------------


def test_renew_extends_from_the_store_clock(store: MemoryStore, clock: ManualClock) -> None:
    first = acquire(store, ttl=10)
    clock.advance(3)
    result = store.renew(JOB, A, first.generation, 20)
    assert result == Renewed(JOB, first.generation, clock.now_ms + 20_000, clock.now_ms)
    record = store.get(JOB)
    assert record is not None
    assert record.lease_until_ms == clock.now_ms + 20_000
    assert record.renew_count == 1
    assert record.renewed_at_ms == clock.now_ms


def test_run_out_lease_that_nobody_claimed_can_be_renewed(
    store: MemoryStore, clock: ManualClock
) -> None:
    first = acquire(store, ttl=1)
    clock.advance(5)
    assert isinstance(store.renew(JOB, A, first.generation, 1), Renewed)
    assert isinstance(store.claim(JOB, B, 1), HeldElsewhere)


def test_renew_after_release_is_refused_as_released(store: MemoryStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    result = store.renew(JOB, A, first.generation, 10)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.RELEASED
    assert result.current_generation == first.generation


def test_renew_of_missing_job_is_refused_as_missing(store: MemoryStore) -> None:
    result = store.renew("nothing-here", A, 5, 10)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.MISSING
    assert result.current_generation is None
    assert result.current_owner is None


def test_renew_with_wrong_owner_or_generation_is_superseded(store: MemoryStore) -> None:
    first = acquire(store)
    for owner, generation in ((B, first.generation), (A, first.generation + 1)):
        result = store.renew(JOB, owner, generation, 10)
        assert isinstance(result, Refusal)
        assert result.reason is RefusalReason.SUPERSEDED


def test_renew_after_complete_is_refused_as_completed(store: MemoryStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation)
    result = store.renew(JOB, A, first.generation, 10)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.COMPLETED


def test_renew_many_answers_in_request_order(store: MemoryStore, clock: ManualClock) -> None:
    one = acquire(store, A, job_id="one")
    two = acquire(store, A, job_id="two")
    results = store.renew_many(
        [
            RenewRequest("two", A, two.generation, 5),
            RenewRequest("missing", A, 7, 5),
            RenewRequest("one", A, one.generation, 6),
            RenewRequest("one", B, one.generation, 6),
        ]
    )
    assert results[0] == Renewed("two", two.generation, clock.now_ms + 5000, clock.now_ms)
    assert isinstance(results[1], Refusal)
    assert results[1].reason is RefusalReason.MISSING
    assert results[2] == Renewed("one", one.generation, clock.now_ms + 6000, clock.now_ms)
    assert isinstance(results[3], Refusal)
    assert results[3].reason is RefusalReason.SUPERSEDED


def test_renew_many_of_nothing_is_an_empty_list(store: MemoryStore) -> None:
    assert store.renew_many([]) == []


# --- complete and release --------------------------------------------------


def test_second_completion_by_the_same_run_is_completed(store: MemoryStore) -> None:
    # protocol rule 6: the record says this owner and generation completed it
    first = acquire(store)
    assert store.complete(JOB, A, first.generation) == Completed(JOB, first.generation)
    assert store.complete(JOB, A, first.generation) == Completed(JOB, first.generation)


def test_second_completion_by_another_run_is_refused(store: MemoryStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation)
    again = store.complete(JOB, B, first.generation)
    assert isinstance(again, Refusal)
    assert again.reason is RefusalReason.COMPLETED
    assert again.current_generation == first.generation


def test_complete_keeps_the_generation_and_stamps_the_time(
    store: MemoryStore, clock: ManualClock
) -> None:
    first = acquire(store)
    clock.advance(2)
    store.complete(JOB, A, first.generation)
    record = store.get(JOB)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert record.generation == first.generation
    assert record.completed_at_ms == clock.now_ms


def test_release_keeps_the_generation_and_the_next_claim_adds_one(store: MemoryStore) -> None:
    first = acquire(store)
    assert store.release(JOB, A, first.generation) == Released(JOB, first.generation)
    record = store.get(JOB)
    assert record is not None
    assert record.state is LeaseState.RELEASED
    assert record.owner == ""
    assert record.generation == first.generation
    assert acquire(store, B).generation == first.generation + 1


def test_release_by_stale_owner_is_refused(store: MemoryStore, clock: ManualClock) -> None:
    a = acquire(store, A, ttl=1)
    clock.advance(2)
    b = acquire(store, B)
    result = store.release(JOB, A, a.generation)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.SUPERSEDED
    record = store.get(JOB)
    assert record is not None
    assert (record.owner, record.generation, record.state) == (B, b.generation, LeaseState.HELD)


def test_refusal_error_is_a_lease_lost_with_the_details(store: MemoryStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation)
    refusal = store.complete(JOB, B, first.generation)
    assert isinstance(refusal, Refusal)
    error = refusal.error("complete")
    assert isinstance(error, LeaseLost)
    assert (error.job_id, error.owner, error.generation) == (JOB, B, first.generation)
    assert error.reason == "completed"
    assert JOB in str(error)


# --- get and records -------------------------------------------------------


def test_get_of_unknown_job_is_none(store: MemoryStore) -> None:
    assert store.get("unknown") is None


def test_records_filter_by_state_and_limit(store: MemoryStore) -> None:
    held = acquire(store, job_id="held")
    done = acquire(store, job_id="done")
    store.complete("done", A, done.generation)
    gone = acquire(store, job_id="gone")
    store.release("gone", A, gone.generation)
    assert held.generation > 0

    assert {r.job_id for r in store.records()} == {"held", "done", "gone"}
    assert [r.job_id for r in store.records(state=LeaseState.HELD)] == ["held"]
    assert [r.job_id for r in store.records(state=LeaseState.COMPLETED)] == ["done"]
    assert [r.job_id for r in store.records(state=LeaseState.RELEASED)] == ["gone"]
    assert len(list(store.records(limit=2))) == 2
    assert list(store.records(limit=0)) == []


def test_records_refuse_a_negative_limit(store: MemoryStore) -> None:
    with pytest.raises(LeaseConfigurationError):
        list(store.records(limit=-1))


def test_claim_records_the_task_name(store: MemoryStore, clock: ManualClock) -> None:
    store.claim(JOB, A, 10, task_name="tasks.add")
    record = store.get(JOB)
    assert record is not None
    assert record.task_name == "tasks.add"
    assert record.claimed_at_ms == clock.now_ms
    assert record.renewed_at_ms is None
    assert record.completed_at_ms is None
    assert record.renew_count == 0


# --- purge -------------------------------------------------------------


def test_purge_deletes_completed_and_released_records_past_the_retention(
    store: MemoryStore, clock: ManualClock
) -> None:
    old = acquire(store, job_id="old")
    store.complete("old", A, old.generation)
    acquire(store, job_id="still-held")
    released = acquire(store, job_id="released")
    store.release("released", A, released.generation)
    clock.advance(100)
    young = acquire(store, job_id="young")
    store.complete("young", A, young.generation)
    young_release = acquire(store, job_id="young-release")
    store.release("young-release", A, young_release.generation)

    assert store.purge(90) == 2
    assert store.get("old") is None
    assert store.get("released") is None
    assert {r.job_id for r in store.records()} == {"still-held", "young", "young-release"}


def test_purge_waits_for_the_retention_only(store: MemoryStore, clock: ManualClock) -> None:
    # A generation ahead of the purge's clock no longer keeps the record: a
    # claim made again takes max(previous + 1, clock), and the record is gone
    # like a record the store lost (docs/guarantees.md, I1).
    clock.now_ms += 3_600_000
    future = acquire(store, ttl=7200)
    clock.now_ms -= 3_600_000
    assert store.complete(JOB, A, future.generation) == Completed(JOB, future.generation)
    clock.advance(59)
    assert store.purge(60) == 0
    clock.advance(1)
    assert store.purge(60) == 1
    assert store.get(JOB) is None


def test_claims_within_one_millisecond_count_up_by_one(store: MemoryStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    second = acquire(store, B)
    store.release(JOB, B, second.generation)
    third = acquire(store)
    assert (second.generation, third.generation) == (first.generation + 1, first.generation + 2)
    assert first.generation == first.store_now_ms


def test_a_claim_takes_the_clock_when_it_passed_the_previous_generation(
    store: MemoryStore, clock: ManualClock
) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    clock.advance(2.5)
    second = acquire(store, B)
    assert second.generation == second.store_now_ms == first.generation + 2500


def test_a_store_that_lost_its_last_claims_hands_out_higher_generations(
    clock: ManualClock,
) -> None:
    # The memory store as a snapshot: what was claimed after it is lost,
    # as after a restart from an older file.
    store = MemoryStore(clock)
    acquire(store)
    snapshot = dict(store._data)
    handed_out = []
    for _ in range(5):
        record = store.get(JOB)
        assert record is not None
        store.release(JOB, A, record.generation)
        # all in one millisecond: these generations lead the clock
        handed_out.append(acquire(store).generation)
    store._data = snapshot
    clock.advance(0.1)  # the restart takes time
    store.release(JOB, A, snapshot[JOB].generation)
    after = acquire(store, B)
    assert after.generation > max(handed_out)


def test_claim_after_purge_gets_a_higher_generation(store: MemoryStore, clock: ManualClock) -> None:
    first = acquire(store)
    for _ in range(3):
        record = store.get(JOB)
        assert record is not None
        store.release(JOB, A, record.generation)
        acquire(store)
    record = store.get(JOB)
    assert record is not None
    store.complete(JOB, A, record.generation)
    clock.advance(61)
    assert store.purge(60) == 1
    again = acquire(store)
    assert again.generation > record.generation > first.generation


@pytest.mark.parametrize("older_than", [0, 59.9, -1, math.nan, math.inf, True, "60"])
def test_purge_refuses_a_retention_under_a_minute(store: MemoryStore, older_than: object) -> None:
    with pytest.raises(LeaseConfigurationError, match="older_than"):
        store.purge(older_than)  # type: ignore[arg-type]


def test_minimum_retention_is_one_minute() -> None:
    assert MIN_RETENTION == 60


# --- argument validation ---------------------------------------------------

BAD_TTLS = [0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "10", None]
BAD_IDS = ["", None, 7, b"job", "x" * 256]
BAD_GENERATIONS = [0, -3, True, False, 1.5, "7", None]


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_claim_refuses_a_bad_ttl(store: MemoryStore, ttl: object) -> None:
    with pytest.raises(LeaseConfigurationError, match="ttl"):
        store.claim(JOB, A, ttl)  # type: ignore[arg-type]


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_renew_refuses_a_bad_ttl(store: MemoryStore, ttl: object) -> None:
    first = acquire(store)
    with pytest.raises(LeaseConfigurationError, match="ttl"):
        store.renew(JOB, A, first.generation, ttl)  # type: ignore[arg-type]


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_renew_many_refuses_a_bad_ttl_before_renewing_anything(
    store: MemoryStore, ttl: object
) -> None:
    first = acquire(store)
    good = RenewRequest(JOB, A, first.generation, 10)
    with pytest.raises(LeaseConfigurationError, match="ttl"):
        store.renew_many([good, RenewRequest(JOB, A, first.generation, ttl)])  # type: ignore[arg-type]
    record = store.get(JOB)
    assert record is not None
    assert record.renew_count == 0


@pytest.mark.parametrize("job_id", BAD_IDS)
def test_every_operation_refuses_a_bad_job_id(store: MemoryStore, job_id: object) -> None:
    bad: str = job_id  # type: ignore[assignment]
    calls: list[Callable[[], object]] = [
        lambda: store.claim(bad, A, 10),
        lambda: store.renew(bad, A, 1, 10),
        lambda: store.renew_many([RenewRequest(bad, A, 1, 10)]),
        lambda: store.complete(bad, A, 1),
        lambda: store.release(bad, A, 1),
        lambda: store.get(bad),
    ]
    for call in calls:
        with pytest.raises(LeaseConfigurationError, match="job_id"):
            call()


def test_job_id_of_255_characters_is_accepted(store: MemoryStore) -> None:
    assert isinstance(store.claim("x" * 255, A, 10), Acquired)


def test_too_long_job_id_message_says_what_to_do(store: MemoryStore) -> None:
    with pytest.raises(LeaseConfigurationError, match="limit is 255"):
        store.claim("x" * 256, A, 10)


@pytest.mark.parametrize("owner", ["", None, 3])
def test_every_operation_refuses_a_bad_owner(store: MemoryStore, owner: object) -> None:
    bad: str = owner  # type: ignore[assignment]
    calls: list[Callable[[], object]] = [
        lambda: store.claim(JOB, bad, 10),
        lambda: store.renew(JOB, bad, 1, 10),
        lambda: store.renew_many([RenewRequest(JOB, bad, 1, 10)]),
        lambda: store.complete(JOB, bad, 1),
        lambda: store.release(JOB, bad, 1),
    ]
    for call in calls:
        with pytest.raises(LeaseConfigurationError, match="owner"):
            call()


@pytest.mark.parametrize("generation", BAD_GENERATIONS)
def test_fenced_operations_refuse_a_bad_generation(store: MemoryStore, generation: object) -> None:
    bad: int = generation  # type: ignore[assignment]
    calls: list[Callable[[], object]] = [
        lambda: store.renew(JOB, A, bad, 10),
        lambda: store.renew_many([RenewRequest(JOB, A, bad, 10)]),
        lambda: store.complete(JOB, A, bad),
        lambda: store.release(JOB, A, bad),
    ]
    for call in calls:
        with pytest.raises(LeaseConfigurationError, match="generation"):
            call()


def test_configuration_errors_are_lease_errors(store: MemoryStore) -> None:
    with pytest.raises(LeaseError):
        store.claim("", A, 10)


def test_validation_happens_before_the_store_is_touched(store: MemoryStore) -> None:
    with pytest.raises(LeaseConfigurationError):
        store.claim(JOB, A, 0)
    assert store.get(JOB) is None


def test_store_without_every_hook_cannot_be_made() -> None:
    class Incomplete(LeaseStore):
        def _now_ms(self) -> int:
            return 0

    with pytest.raises(TypeError):
        Incomplete()  # type: ignore[abstract]


def test_store_is_a_context_manager(clock: ManualClock) -> None:
    with MemoryStore(clock=clock) as store:
        assert isinstance(store.claim(JOB, A, 1), Acquired)


@pytest.mark.parametrize("state", ["bogus", LeaseState.HELD.name, 3])
def test_records_check_the_state_at_the_call(store: MemoryStore, state: object) -> None:
    with pytest.raises(LeaseConfigurationError, match="state must be a LeaseState"):
        store.records(state=state)  # type: ignore[arg-type]


def test_records_check_the_limit_at_the_call(store: MemoryStore) -> None:
    with pytest.raises(LeaseConfigurationError, match="limit"):
        store.records(limit=-1)
