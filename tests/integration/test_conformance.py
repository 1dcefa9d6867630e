"""The store conformance suite: every store behaves like the memory store.

Each test runs on every store kind through the parametrized ``store`` fixture
(memory, redis, postgres, sqlite), against the public :class:`LeaseStore` API.
Time really passes here, so TTLs are short and every wait polls the store's
own clock with a generous margin instead of trusting a fixed sleep.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from celery_leases import (
    Acquired,
    AlreadyCompleted,
    Completed,
    HeldElsewhere,
    LeaseConfigurationError,
    LeaseError,
    LeaseState,
    LeaseStore,
    Refusal,
    RefusalReason,
    Released,
    Renewed,
    RenewRequest,
)
from celery_leases.stores.memory import MemoryStore
from celery_leases.stores.redis import RedisStore
from celery_leases.stores.sql import SqlStore
from tests.conftest import STORE_KINDS, StoreFactory

JOB = "job-1"
A = "worker-a"
B = "worker-b"
#: the shortest lease these tests let run out; never below 50 ms of timing
SHORT_TTL = 0.3
#: how far past ``lease_until`` a wait goes before calling the lease run out
MARGIN_MS = 150


# --- writing records behind the store's back --------------------------------
# purge keeps records for at least a minute; instead of waiting, the
# purge tests age a record by editing it directly in the store's storage.


@pytest.fixture(params=[*STORE_KINDS, "redis-cluster"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every store, and the Redis store on a cluster of 3 masters and 3 replicas."""
    return str(request.param)


def backdate_completion(store: LeaseStore, job_id: str, seconds: float) -> None:
    """Move the record's ``completed_at`` ``seconds`` into the past."""
    record = store.get(job_id)
    assert record is not None
    assert record.completed_at_ms is not None
    _rewrite(store, job_id, completed_at_ms=record.completed_at_ms - round(seconds * 1000))


def force_generation(store: LeaseStore, job_id: str, generation: int) -> None:
    """Overwrite the record's generation."""
    _rewrite(store, job_id, generation=generation)


def _rewrite(store: LeaseStore, job_id: str, **fields: Any) -> None:
    # Redis hash fields and SQL columns are the record's names without "_ms"
    renamed = {name.removesuffix("_ms"): value for name, value in fields.items()}
    if isinstance(store, MemoryStore):
        store._data[job_id] = dataclasses.replace(store._data[job_id], **fields)
        return
    if isinstance(store, RedisStore):
        for name, value in renamed.items():
            store._client.hset(store.key(job_id), name, value)
        return
    if isinstance(store, SqlStore):
        table = store.table
        with store.engine.begin() as conn:
            conn.execute(table.update().where(table.c.job_id == job_id).values(**renamed))
        return
    raise AssertionError(f"no way to edit records of {type(store).__name__} in this test")


def acquire(store: LeaseStore, owner: str = A, ttl: float = 30, job_id: str = JOB) -> Acquired:
    result = store.claim(job_id, owner, ttl)
    assert isinstance(result, Acquired), result
    return result


def wait_until_run_out(store: LeaseStore, lease_until_ms: int) -> None:
    """Sleep until the store's clock is past ``lease_until_ms`` plus a margin."""
    wait_for_store_clock(store, lease_until_ms + MARGIN_MS)


def wait_for_store_clock(store: LeaseStore, ms: int, timeout: float = 15.0) -> None:
    """Sleep until the store's clock is past ``ms``."""
    deadline = time.monotonic() + timeout
    while (left_ms := ms + 1 - store.now_ms()) > 0:
        assert time.monotonic() < deadline, f"the store clock did not pass {ms}"
        time.sleep(min(left_ms / 1000, 0.2))


# --- claim -----------------------------------------------------------------


def test_store_clock_is_in_milliseconds_since_the_epoch(store: LeaseStore) -> None:
    # same machine: the store's clock and ours agree to well within a few seconds
    assert abs(store.now_ms() - time.time() * 1000) < 5_000


def test_first_claim_gets_the_store_clock_as_generation(store: LeaseStore) -> None:
    before = store.now_ms()
    result = acquire(store, ttl=20)
    after = store.now_ms()
    assert before <= result.generation <= after
    assert before <= result.store_now_ms <= after
    assert result.lease_until_ms == result.store_now_ms + 20_000
    assert result.owner == A
    assert result.job_id == JOB
    assert result.takeovers == 0


def test_claim_while_held_reports_the_holder(store: LeaseStore) -> None:
    first = acquire(store, ttl=20)
    result = store.claim(JOB, B, 20)
    assert isinstance(result, HeldElsewhere)
    assert (result.job_id, result.holder, result.generation) == (JOB, A, first.generation)
    assert 0 < result.remaining <= 20


def test_worked_example_stale_holder_is_refused(store: LeaseStore) -> None:
    a = acquire(store, A, ttl=SHORT_TTL)
    wait_until_run_out(store, a.lease_until_ms)
    b = acquire(store, B, ttl=30)
    assert b.generation == max(a.generation + 1, b.store_now_ms)
    assert b.takeovers == 1

    renew = store.renew(JOB, A, a.generation, 30)
    complete = store.complete(JOB, A, a.generation)
    for refused in (renew, complete):
        assert isinstance(refused, Refusal)
        assert refused.reason is RefusalReason.SUPERSEDED
        assert refused.current_generation == b.generation
        assert refused.current_owner == B
        assert (refused.owner, refused.generation) == (A, a.generation)

    assert store.complete(JOB, B, b.generation) == Completed(JOB, b.generation)
    assert store.claim(JOB, A, 30) == AlreadyCompleted(JOB, b.generation)


def test_claim_after_release_is_not_a_takeover(store: LeaseStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    second = acquire(store, B)
    assert second.takeovers == 0


def test_job_ids_are_independent(store: LeaseStore) -> None:
    one = acquire(store, A, job_id="one")
    two = acquire(store, B, job_id="two")
    assert store.complete("one", A, one.generation) == Completed("one", one.generation)
    record = store.get("two")
    assert record is not None
    assert (record.owner, record.generation, record.state) == (B, two.generation, LeaseState.HELD)


@pytest.mark.parametrize(
    "job_id",
    ["x" * 255, "café/☃ 100%_*?[]{}", "a:b:c", "'; DROP TABLE leases; --", "job\nwith\ttabs"],
)
def test_unusual_job_ids_round_trip(store: LeaseStore, job_id: str) -> None:
    first = acquire(store, "owner 'ü'", job_id=job_id)
    record = store.get(job_id)
    assert record is not None
    assert (record.job_id, record.owner, record.generation) == (
        job_id,
        "owner 'ü'",
        first.generation,
    )
    assert store.complete(job_id, "owner 'ü'", first.generation) == Completed(
        job_id, first.generation
    )


def test_handles_on_the_same_store_see_one_record(open_test_store: StoreFactory) -> None:
    one, two = open_test_store(), open_test_store()
    first = acquire(one, A)
    held = two.claim(JOB, B, 30)
    assert isinstance(held, HeldElsewhere)
    assert held.generation == first.generation
    assert two.release(JOB, A, first.generation) == Released(JOB, first.generation)
    second = acquire(one, B)
    assert second.generation == max(first.generation + 1, second.store_now_ms)


# --- renew -----------------------------------------------------------------


def test_renew_extends_the_lease(store: LeaseStore) -> None:
    first = acquire(store, ttl=5)
    result = store.renew(JOB, A, first.generation, 40)
    assert isinstance(result, Renewed)
    assert result.generation == first.generation
    assert result.lease_until_ms == result.store_now_ms + 40_000
    assert result.lease_until_ms > first.lease_until_ms
    record = store.get(JOB)
    assert record is not None
    assert record.lease_until_ms == result.lease_until_ms
    assert record.renew_count == 1
    assert record.renewed_at_ms == result.store_now_ms


def test_run_out_lease_that_nobody_claimed_can_be_renewed(store: LeaseStore) -> None:
    first = acquire(store, ttl=SHORT_TTL)
    wait_until_run_out(store, first.lease_until_ms)
    renewed = store.renew(JOB, A, first.generation, 30)
    assert isinstance(renewed, Renewed)
    held = store.claim(JOB, B, 30)
    assert isinstance(held, HeldElsewhere)
    assert held.generation == first.generation


def test_renew_after_release_is_refused_as_released(store: LeaseStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    result = store.renew(JOB, A, first.generation, 30)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.RELEASED
    assert result.current_generation == first.generation


def test_renew_of_missing_job_is_refused_as_missing(store: LeaseStore) -> None:
    result = store.renew("nothing-here", A, 12345, 30)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.MISSING
    assert result.current_generation is None
    assert store.get("nothing-here") is None


def test_renew_with_another_owner_or_generation_is_superseded(store: LeaseStore) -> None:
    first = acquire(store)
    for owner, generation in ((B, first.generation), (A, first.generation + 1)):
        result = store.renew(JOB, owner, generation, 30)
        assert isinstance(result, Refusal)
        assert result.reason is RefusalReason.SUPERSEDED
        assert result.current_owner == A
        assert result.current_generation == first.generation
    record = store.get(JOB)
    assert record is not None
    assert record.renew_count == 0


def test_renew_after_complete_is_refused_as_completed(store: LeaseStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation)
    result = store.renew(JOB, A, first.generation, 30)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.COMPLETED


def test_renew_many_answers_in_request_order(store: LeaseStore) -> None:
    one = acquire(store, A, job_id="one")
    two = acquire(store, A, job_id="two")
    done = acquire(store, A, job_id="done")
    store.complete("done", A, done.generation)
    results = store.renew_many(
        [
            RenewRequest("two", A, two.generation, 25),
            RenewRequest("missing", A, 7, 25),
            RenewRequest("one", A, one.generation, 35),
            RenewRequest("one", B, one.generation, 35),
            RenewRequest("done", A, done.generation, 35),
        ]
    )
    assert len(results) == 5
    first, missing, third, stranger, completed = results
    assert isinstance(first, Renewed)
    assert (first.job_id, first.generation) == ("two", two.generation)
    assert first.lease_until_ms == first.store_now_ms + 25_000
    assert isinstance(missing, Refusal)
    assert (missing.job_id, missing.reason) == ("missing", RefusalReason.MISSING)
    assert isinstance(third, Renewed)
    assert (third.job_id, third.generation) == ("one", one.generation)
    assert third.lease_until_ms == third.store_now_ms + 35_000
    assert isinstance(stranger, Refusal)
    assert (stranger.job_id, stranger.reason) == ("one", RefusalReason.SUPERSEDED)
    assert isinstance(completed, Refusal)
    assert (completed.job_id, completed.reason) == ("done", RefusalReason.COMPLETED)

    record = store.get("one")
    assert record is not None
    assert record.lease_until_ms == third.lease_until_ms
    assert record.renew_count == 1


def test_renew_many_of_nothing_is_an_empty_list(store: LeaseStore) -> None:
    assert store.renew_many([]) == []


def test_renew_many_of_many_leases(store: LeaseStore) -> None:
    held = [acquire(store, A, job_id=f"job-{n}") for n in range(50)]
    results = store.renew_many([RenewRequest(h.job_id, A, h.generation, 30) for h in held])
    assert [r.job_id for r in results] == [h.job_id for h in held]
    assert all(isinstance(r, Renewed) for r in results)


# --- complete and release --------------------------------------------------


def test_completing_again_with_the_same_owner_and_generation_is_completed(
    store: LeaseStore,
) -> None:
    # the first reply may have been lost: the record says the run completed
    first = acquire(store)
    assert store.complete(JOB, A, first.generation) == Completed(JOB, first.generation)
    assert store.complete(JOB, A, first.generation) == Completed(JOB, first.generation)


def test_completion_by_another_owner_after_completion_is_refused(store: LeaseStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation)
    for owner, generation in ((B, first.generation), (A, first.generation - 1)):
        again = store.complete(JOB, owner, generation)
        assert isinstance(again, Refusal)
        assert again.reason is RefusalReason.COMPLETED
        assert again.current_generation == first.generation


def test_completed_job_is_not_claimed_again(store: LeaseStore) -> None:
    first = acquire(store, ttl=SHORT_TTL)
    store.complete(JOB, A, first.generation)
    wait_until_run_out(store, first.lease_until_ms)
    assert store.claim(JOB, B, 30) == AlreadyCompleted(JOB, first.generation)


def test_complete_of_a_run_out_lease_nobody_claimed_is_accepted(store: LeaseStore) -> None:
    first = acquire(store, ttl=SHORT_TTL)
    wait_until_run_out(store, first.lease_until_ms)
    assert store.complete(JOB, A, first.generation) == Completed(JOB, first.generation)


def test_release_keeps_the_generation_and_the_next_claim_goes_above(store: LeaseStore) -> None:
    first = acquire(store)
    assert store.release(JOB, A, first.generation) == Released(JOB, first.generation)
    record = store.get(JOB)
    assert record is not None
    assert record.state is LeaseState.RELEASED
    assert record.owner == ""
    assert record.generation == first.generation
    second = acquire(store, B)
    assert second.generation == max(first.generation + 1, second.store_now_ms)


def test_release_by_stale_owner_is_refused(store: LeaseStore) -> None:
    a = acquire(store, A, ttl=SHORT_TTL)
    wait_until_run_out(store, a.lease_until_ms)
    b = acquire(store, B)
    result = store.release(JOB, A, a.generation)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.SUPERSEDED
    assert result.current_generation == b.generation
    record = store.get(JOB)
    assert record is not None
    assert (record.owner, record.generation, record.state) == (B, b.generation, LeaseState.HELD)


def test_release_twice_is_refused_as_released(store: LeaseStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    again = store.release(JOB, A, first.generation)
    assert isinstance(again, Refusal)
    assert again.reason is RefusalReason.RELEASED


def test_complete_after_release_is_refused(store: LeaseStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    result = store.complete(JOB, A, first.generation)
    assert isinstance(result, Refusal)
    assert result.reason is RefusalReason.RELEASED
    record = store.get(JOB)
    assert record is not None
    assert record.state is LeaseState.RELEASED


# --- get, records and bookkeeping ------------------------------------------


def test_get_of_unknown_job_is_none(store: LeaseStore) -> None:
    assert store.get("unknown") is None


def test_records_filter_by_state_and_limit(store: LeaseStore) -> None:
    acquire(store, job_id="held")
    done = acquire(store, job_id="done")
    store.complete("done", A, done.generation)
    gone = acquire(store, job_id="gone")
    store.release("gone", A, gone.generation)

    assert sorted(r.job_id for r in store.records()) == ["done", "gone", "held"]
    assert [r.job_id for r in store.records(state=LeaseState.HELD)] == ["held"]
    assert [r.job_id for r in store.records(state=LeaseState.COMPLETED)] == ["done"]
    assert [r.job_id for r in store.records(state=LeaseState.RELEASED)] == ["gone"]
    assert len(list(store.records(limit=2))) == 2
    assert list(store.records(limit=0)) == []


def test_records_of_an_empty_store_are_empty(store: LeaseStore) -> None:
    assert list(store.records()) == []


def test_records_iterate_over_many_records(store: LeaseStore) -> None:
    for n in range(120):
        acquire(store, job_id=f"job-{n:03}")
    assert sorted(r.job_id for r in store.records()) == [f"job-{n:03}" for n in range(120)]


def test_bookkeeping_fields_follow_the_record(store: LeaseStore) -> None:
    claimed = store.claim(JOB, A, 30, task_name="tasks.send_invoice")
    assert isinstance(claimed, Acquired)
    record = store.get(JOB)
    assert record is not None
    assert record.task_name == "tasks.send_invoice"
    assert record.claimed_at_ms == claimed.store_now_ms
    assert record.renewed_at_ms is None
    assert record.completed_at_ms is None
    assert record.renew_count == 0
    assert record.takeovers == 0
    assert record.lease_until_ms == claimed.lease_until_ms

    renewals = [store.renew(JOB, A, claimed.generation, 30) for _ in range(2)]
    last = renewals[-1]
    assert isinstance(last, Renewed)
    record = store.get(JOB)
    assert record is not None
    assert record.renew_count == 2
    assert record.renewed_at_ms == last.store_now_ms

    before = store.now_ms()
    store.complete(JOB, A, claimed.generation)
    after = store.now_ms()
    record = store.get(JOB)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert record.completed_at_ms is not None
    assert before <= record.completed_at_ms <= after
    assert record.task_name == "tasks.send_invoice"
    assert record.claimed_at_ms == claimed.store_now_ms
    assert record.generation == claimed.generation


def test_takeovers_are_counted_in_the_record(store: LeaseStore) -> None:
    first = acquire(store, A, ttl=SHORT_TTL)
    wait_until_run_out(store, first.lease_until_ms)
    second = acquire(store, B, ttl=SHORT_TTL)
    wait_until_run_out(store, second.lease_until_ms)
    third = acquire(store, A, ttl=30)
    assert (second.takeovers, third.takeovers) == (1, 2)
    record = store.get(JOB)
    assert record is not None
    assert record.takeovers == 2
    assert record.renew_count == 0


# --- purge -------------------------------------------------------------


@pytest.mark.parametrize("older_than", [0, 1, 59.9])
def test_purge_refuses_a_retention_under_a_minute(store: LeaseStore, older_than: float) -> None:
    done = acquire(store)
    store.complete(JOB, A, done.generation)
    with pytest.raises(LeaseConfigurationError, match="older_than"):
        store.purge(older_than)
    assert store.get(JOB) is not None


def test_purge_deletes_only_completed_records_past_the_retention(store: LeaseStore) -> None:
    old = acquire(store, job_id="old")
    store.complete("old", A, old.generation)
    young = acquire(store, job_id="young")
    store.complete("young", A, young.generation)
    acquire(store, job_id="held")
    released = acquire(store, job_id="released")
    store.release("released", A, released.generation)
    backdate_completion(store, "old", seconds=120)
    # a generation is purged only once the store clock is past it
    wait_for_store_clock(store, max(old.generation, young.generation))

    assert store.purge(90) == 1
    assert store.get("old") is None
    assert sorted(r.job_id for r in store.records()) == ["held", "released", "young"]
    assert store.purge(90) == 0


def test_purge_deletes_an_old_record_whatever_its_generation(store: LeaseStore) -> None:
    # A claim made again takes max(previous + 1, clock): the purge no longer
    # waits for the clock to pass the generation (I1 rests on the clock).
    done = acquire(store)
    store.complete(JOB, A, done.generation)
    force_generation(store, JOB, store.now_ms() + 3_600_000)
    backdate_completion(store, JOB, seconds=120)
    assert store.purge(60) == 1
    assert store.get(JOB) is None


def test_a_claim_takes_the_store_clock_once_it_passed_the_generation(store: LeaseStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    wait_for_store_clock(store, first.generation + 20)
    second = acquire(store, B)
    assert second.generation == second.store_now_ms > first.generation + 20


def test_a_claim_over_a_generation_ahead_of_the_clock_adds_one(store: LeaseStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    ahead = store.now_ms() + 3_600_000
    force_generation(store, JOB, ahead)
    assert acquire(store, B).generation == ahead + 1


def test_claim_after_purge_gets_a_higher_generation(store: LeaseStore) -> None:
    first = acquire(store)
    store.release(JOB, A, first.generation)
    last = acquire(store)
    store.complete(JOB, A, last.generation)
    backdate_completion(store, JOB, seconds=120)
    wait_for_store_clock(store, last.generation)
    assert store.purge(60) == 1
    assert store.get(JOB) is None
    again = acquire(store, B)
    assert again.generation > last.generation > first.generation


# --- argument validation ---------------------------------------------------


@pytest.mark.parametrize(
    ("call", "word"),
    [
        (lambda s: s.claim("", A, 30), "job_id"),
        (lambda s: s.claim("x" * 256, A, 30), "255"),
        (lambda s: s.claim(JOB, "", 30), "owner"),
        (lambda s: s.claim(JOB, A, 0), "ttl"),
        (lambda s: s.renew(JOB, A, 0, 30), "generation"),
        (lambda s: s.complete(JOB, "", 1), "owner"),
        (lambda s: s.release(JOB, A, True), "generation"),
        (lambda s: s.complete(JOB, A, 2**53), "2\\*\\*53"),
        (lambda s: s.renew_many([RenewRequest(JOB, A, 1, -1)]), "ttl"),
    ],
)
def test_bad_arguments_are_configuration_errors(store: LeaseStore, call: object, word: str) -> None:
    with pytest.raises(LeaseConfigurationError, match=word) as info:
        call(store)  # type: ignore[operator]
    assert isinstance(info.value, LeaseError)
    assert list(store.records()) == []
