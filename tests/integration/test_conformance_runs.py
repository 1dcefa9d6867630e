"""Conformance, part two: send ids, outcomes, forced releases, bounds, purge.

Like ``test_conformance.py``, every test runs on every store kind (memory,
redis, postgres, sqlite, and Redis on a cluster) through the parametrized
``store`` fixture.
"""

from __future__ import annotations

import pytest

from celery_leases import (
    Acquired,
    AlreadyCompleted,
    Completed,
    HeldElsewhere,
    LeaseConfigurationError,
    LeaseState,
    LeaseStore,
    Refusal,
    RefusalReason,
    Renewed,
    RenewRequest,
)
from celery_leases.stores.base import MAX_OUTCOME_BYTES, MAX_TTL
from tests.integration.test_conformance import (
    SHORT_TTL,
    acquire,
    backdate_completion,
    wait_for_store_clock,
    wait_until_run_out,
)

# the fixture of every store kind, the cluster too
from tests.integration.test_conformance import store_kind as store_kind

JOB = "job-1"
A = "worker-a"
B = "worker-b"
#: bytes no text encoding round-trips by accident
BINARY = bytes(range(256)) * 3


def claim_sent(store: LeaseStore, send_id: str | None, owner: str = A) -> Acquired:
    result = store.claim(JOB, owner, 30, send_id=send_id)
    assert isinstance(result, Acquired), result
    return result


# --- send ids ----------------------------------------------------------------


def test_claim_keeps_the_send_id_in_the_record(store: LeaseStore) -> None:
    claim_sent(store, "send-1")
    record = store.get(JOB)
    assert record is not None
    assert record.send_id == "send-1"


def test_claim_without_a_send_id_keeps_an_empty_one(store: LeaseStore) -> None:
    claim_sent(store, None)
    record = store.get(JOB)
    assert record is not None
    assert record.send_id == ""


@pytest.mark.parametrize("again", [None, "send-1"])
def test_redelivery_of_a_completed_send_is_already_completed(
    store: LeaseStore, again: str | None
) -> None:
    first = claim_sent(store, "send-1")
    store.complete(JOB, A, first.generation, outcome=b"result")
    result = store.claim(JOB, B, 30, send_id=again)
    assert result == AlreadyCompleted(JOB, first.generation, "send-1", b"result")


def test_new_send_of_a_completed_job_is_a_new_run(store: LeaseStore) -> None:
    first = claim_sent(store, "send-1")
    store.complete(JOB, A, first.generation, outcome=b"first result")
    second = store.claim(JOB, B, 30, send_id="send-2")
    assert isinstance(second, Acquired)
    assert second.generation == max(first.generation + 1, second.store_now_ms)
    assert second.takeovers == 0
    record = store.get(JOB)
    assert record is not None
    assert (record.state, record.owner, record.send_id) == (LeaseState.HELD, B, "send-2")
    assert (record.outcome, record.completed_at_ms, record.renew_count) == (None, None, 0)
    assert record.lease_until_ms == second.lease_until_ms
    # the first run is fenced out of the new one
    renewed = store.renew(JOB, A, first.generation, 30)
    assert isinstance(renewed, Refusal)
    assert renewed.reason is RefusalReason.SUPERSEDED
    # and its redelivery now sees the new run holding the job
    held = store.claim(JOB, A, 30, send_id="send-2")
    assert isinstance(held, HeldElsewhere)
    assert held.generation == second.generation


def test_new_run_resets_takeovers_of_the_previous_run(store: LeaseStore) -> None:
    first = store.claim(JOB, A, SHORT_TTL, send_id="send-1")
    assert isinstance(first, Acquired)
    wait_until_run_out(store, first.lease_until_ms)
    taken = claim_sent(store, "send-1", owner=B)
    assert taken.takeovers == 1
    store.complete(JOB, B, taken.generation)
    again = claim_sent(store, "send-2")
    assert again.takeovers == 0


def test_claim_over_a_released_record_stores_the_new_send_id(store: LeaseStore) -> None:
    first = claim_sent(store, "send-1")
    store.release(JOB, A, first.generation)
    second = claim_sent(store, "send-2", owner=B)
    assert second.generation == max(first.generation + 1, second.store_now_ms)
    record = store.get(JOB)
    assert record is not None
    assert record.send_id == "send-2"


# --- a message without a send id: the same run only with the completer's task id


def test_claim_keeps_the_task_id_in_the_record(store: LeaseStore) -> None:
    store.claim(JOB, A, 30, send_id="send-1", task_id="task-1")
    store.claim("other", A, 30, send_id="send-2")
    assert {r.job_id: r.task_id for r in store.records()} == {JOB: "task-1", "other": ""}


@pytest.mark.parametrize("completer_send_id", ["send-1", "task:task-1"])
def test_a_message_without_a_send_id_with_the_completers_task_id_is_the_same_run(
    store: LeaseStore, completer_send_id: str
) -> None:
    # the completer's message had a send id, or had none either
    first = store.claim(JOB, A, 30, send_id=completer_send_id, task_id="task-1")
    assert isinstance(first, Acquired)
    store.complete(JOB, A, first.generation, outcome=b"result")
    again = store.claim(JOB, B, 30, send_id="task:task-1", task_id="task-1")
    assert again == AlreadyCompleted(JOB, first.generation, completer_send_id, b"result")


def test_a_message_without_a_send_id_with_another_task_id_is_a_new_run(
    store: LeaseStore,
) -> None:
    first = store.claim(JOB, A, 30, send_id="send-1", task_id="task-1")
    assert isinstance(first, Acquired)
    store.complete(JOB, A, first.generation, outcome=b"first")
    second = store.claim(JOB, B, 30, send_id="task:task-2", task_id="task-2")
    assert isinstance(second, Acquired), second
    assert second.generation > first.generation
    record = store.get(JOB)
    assert record is not None
    assert (record.send_id, record.task_id) == ("task:task-2", "task-2")
    # serialized by the lease: the first task id, sent again, waits for it
    held = store.claim(JOB, A, 30, send_id="task:task-1", task_id="task-1")
    assert isinstance(held, HeldElsewhere)
    store.complete(JOB, B, second.generation, outcome=b"second")
    # now the second task id completed the job, and the first is a new run again
    done = store.claim(JOB, A, 30, send_id="task:task-2", task_id="task-2")
    assert done == AlreadyCompleted(JOB, second.generation, "task:task-2", b"second")
    third = store.claim(JOB, A, 30, send_id="task:task-1", task_id="task-1")
    assert isinstance(third, Acquired), third


def test_a_new_send_with_the_completers_task_id_is_a_new_run(store: LeaseStore) -> None:
    # a send id, when there is one, decides alone (retry, replace, sent again)
    first = store.claim(JOB, A, 30, send_id="send-1", task_id="task-1")
    assert isinstance(first, Acquired)
    store.complete(JOB, A, first.generation)
    second = store.claim(JOB, B, 30, send_id="send-2", task_id="task-1")
    assert isinstance(second, Acquired), second


def test_a_record_without_a_task_id_is_matched_by_its_send_id_alone(
    store: LeaseStore,
) -> None:
    # records written before task ids were kept have none
    first = claim_sent(store, "send-1")
    store.complete(JOB, A, first.generation)
    taken = store.claim(JOB, B, 30, send_id="task:", task_id="")
    assert isinstance(taken, Acquired), taken


# --- outcomes ----------------------------------------------------------------


def test_outcome_is_stored_with_the_completion(store: LeaseStore) -> None:
    first = acquire(store)
    assert store.complete(JOB, A, first.generation, outcome=BINARY) == Completed(
        JOB, first.generation
    )
    record = store.get(JOB)
    assert record is not None
    assert (record.state, record.outcome) == (LeaseState.COMPLETED, BINARY)
    result = store.claim(JOB, B, 30)
    assert isinstance(result, AlreadyCompleted)
    assert result.outcome == BINARY


def test_completion_without_outcome_stores_none(store: LeaseStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation)
    record = store.get(JOB)
    assert record is not None
    assert record.outcome is None
    assert store.claim(JOB, B, 30) == AlreadyCompleted(JOB, first.generation, "", None)


def test_empty_outcome_is_kept_apart_from_none(store: LeaseStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation, outcome=b"")
    record = store.get(JOB)
    assert record is not None
    assert record.outcome == b""


def test_outcome_of_one_mebibyte_is_stored_and_more_is_refused(store: LeaseStore) -> None:
    first = acquire(store)
    with pytest.raises(LeaseConfigurationError, match="outcome"):
        store.complete(JOB, A, first.generation, outcome=b"x" * (MAX_OUTCOME_BYTES + 1))
    record = store.get(JOB)
    assert record is not None
    assert record.state is LeaseState.HELD
    largest = b"\xff" * MAX_OUTCOME_BYTES
    assert store.complete(JOB, A, first.generation, outcome=largest) == Completed(
        JOB, first.generation
    )
    record = store.get(JOB)
    assert record is not None
    assert record.outcome == largest


def test_refused_completion_does_not_store_its_outcome(store: LeaseStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation, outcome=b"first")
    refused = store.complete(JOB, B, first.generation, outcome=b"stale")
    assert isinstance(refused, Refusal)
    record = store.get(JOB)
    assert record is not None
    assert record.outcome == b"first"


# --- bounds ------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [MAX_TTL + 1, 1e16, 1e300])
def test_ttl_above_one_day_is_refused_everywhere(store: LeaseStore, ttl: float) -> None:
    with pytest.raises(LeaseConfigurationError, match="ttl"):
        store.claim(JOB, A, ttl)
    first = acquire(store)
    with pytest.raises(LeaseConfigurationError, match="ttl"):
        store.renew(JOB, A, first.generation, ttl)
    with pytest.raises(LeaseConfigurationError, match="ttl"):
        store.renew_many([RenewRequest(JOB, A, first.generation, ttl)])
    record = store.get(JOB)
    assert record is not None
    assert record.lease_until_ms == first.lease_until_ms


def test_ttl_of_exactly_one_day_is_granted(store: LeaseStore) -> None:
    first = acquire(store, ttl=MAX_TTL)
    assert first.lease_until_ms == first.store_now_ms + 86_400_000
    renewed = store.renew(JOB, A, first.generation, MAX_TTL)
    assert isinstance(renewed, Renewed)


@pytest.mark.parametrize(
    ("call", "word"),
    [
        (lambda s: s.claim("bad\x00job", A, 30), "NUL"),
        (lambda s: s.claim("bad\ud800job", A, 30), "Unicode"),
        (lambda s: s.claim(JOB, "owner\x00", 30), "NUL"),
        (lambda s: s.claim(JOB, "o" * 256, 30), "255"),
        (lambda s: s.claim(JOB, "owner\udfff", 30), "Unicode"),
        (lambda s: s.claim(JOB, A, 30, task_name="t" * 256), "255"),
        (lambda s: s.claim(JOB, A, 30, task_name="task\x00"), "NUL"),
        (lambda s: s.claim(JOB, A, 30, send_id="s" * 256), "255"),
        (lambda s: s.claim(JOB, A, 30, send_id="s\x00"), "NUL"),
        (lambda s: s.claim(JOB, A, 30, task_id="t" * 256), "255"),
        (lambda s: s.claim(JOB, A, 30, task_id="t\x00"), "NUL"),
        (lambda s: s.get("bad\ud800job"), "Unicode"),
        (lambda s: s.complete(JOB, A, 1, outcome="text"), "bytes"),
    ],
)
def test_values_no_store_can_keep_are_configuration_errors(
    store: LeaseStore, call: object, word: str
) -> None:
    with pytest.raises(LeaseConfigurationError, match=word):
        call(store)  # type: ignore[operator]
    assert list(store.records()) == []


# --- records(state=...) -------------------------------------------------------


def test_records_take_a_state_or_its_value(store: LeaseStore) -> None:
    acquire(store, job_id="held")
    done = acquire(store, job_id="done")
    store.complete("done", A, done.generation)
    assert [r.job_id for r in store.records(state="held")] == ["held"]
    assert [r.job_id for r in store.records(state="completed")] == ["done"]
    assert [r.job_id for r in store.records(state=LeaseState.COMPLETED)] == ["done"]
    assert list(store.records(state="released")) == []


@pytest.mark.parametrize("state", ["HELD", "garbage", 1, b"held"])
def test_records_refuse_an_unknown_state(store: LeaseStore, state: object) -> None:
    with pytest.raises(LeaseConfigurationError, match="state"):
        list(store.records(state=state))  # type: ignore[arg-type]


# --- purge -------------------------------------------------------------------


def backdate_release(store: LeaseStore, job_id: str, seconds: float) -> None:
    """Move the record's release (``released_at`` and ``lease_until``) back."""
    from tests.integration.test_conformance import _rewrite

    record = store.get(job_id)
    assert record is not None
    assert record.released_at_ms is not None
    shift = round(seconds * 1000)
    _rewrite(
        store,
        job_id,
        released_at_ms=record.released_at_ms - shift,
        lease_until_ms=record.lease_until_ms - shift,
    )


def test_release_stamps_released_at_on_the_store_clock(store: LeaseStore) -> None:
    first = acquire(store)
    before = store.now_ms()
    store.release(JOB, A, first.generation)
    after = store.now_ms()
    record = store.get(JOB)
    assert record is not None
    assert record.released_at_ms is not None
    assert before <= record.released_at_ms <= after
    assert (record.released_by, record.release_reason) == ("", "")


def test_purge_deletes_old_completed_and_released_records(store: LeaseStore) -> None:
    done = acquire(store, job_id="done")
    store.complete("done", A, done.generation)
    gone = acquire(store, job_id="gone")
    store.release("gone", A, gone.generation)
    young = acquire(store, job_id="young")
    store.release("young", A, young.generation)
    acquire(store, job_id="held")
    backdate_completion(store, "done", seconds=120)
    backdate_release(store, "gone", seconds=120)
    wait_for_store_clock(store, max(done.generation, gone.generation, young.generation))

    assert store.purge(90) == 2
    assert sorted(r.job_id for r in store.records()) == ["held", "young"]
    again = acquire(store, B, job_id="gone")
    assert again.generation > gone.generation


# --- force_release -----------------------------------------------------------


def test_force_release_fences_out_the_holder(store: LeaseStore) -> None:
    held = acquire(store, ttl=60)
    before = store.now_ms()
    record = store.force_release(JOB, by="ops@host", reason="stuck since Monday")
    after = store.now_ms()
    assert record.state is LeaseState.RELEASED
    assert record.owner == ""
    assert record.generation == held.generation + 1
    assert (record.released_by, record.release_reason) == ("ops@host", "stuck since Monday")
    assert record.released_at_ms is not None
    assert before <= record.released_at_ms <= after
    assert record.lease_until_ms == record.released_at_ms
    assert store.get(JOB) == record

    for refused in (
        store.renew(JOB, A, held.generation, 30),
        store.complete(JOB, A, held.generation),
        store.release(JOB, A, held.generation),
        store.renew_many([RenewRequest(JOB, A, held.generation, 30)])[0],
    ):
        assert isinstance(refused, Refusal)
        assert refused.reason is RefusalReason.SUPERSEDED
        assert refused.current_generation == held.generation + 1
    following = acquire(store, B)
    assert following.generation == max(held.generation + 2, following.store_now_ms)
    assert following.takeovers == 0
    record_after = store.get(JOB)
    assert record_after is not None
    assert (record_after.released_by, record_after.release_reason) == ("", "")


def test_force_release_of_a_released_or_run_out_lease_moves_the_generation(
    store: LeaseStore,
) -> None:
    first = acquire(store, ttl=SHORT_TTL)
    wait_until_run_out(store, first.lease_until_ms)
    assert store.force_release(JOB, by="ops", reason="").generation == first.generation + 1
    assert store.force_release(JOB, by="ops", reason="again").generation == first.generation + 2


def test_force_release_of_a_missing_job_is_refused(store: LeaseStore) -> None:
    with pytest.raises(LeaseConfigurationError, match="no lease record for job 'nothing'"):
        store.force_release("nothing", by="ops", reason="typo")
    assert store.get("nothing") is None


def test_force_release_of_a_completed_job_is_refused_and_keeps_it(store: LeaseStore) -> None:
    first = acquire(store)
    store.complete(JOB, A, first.generation, outcome=b"done")
    before = store.get(JOB)
    with pytest.raises(LeaseConfigurationError, match="completed"):
        store.force_release(JOB, by="ops", reason="oops")
    assert store.get(JOB) == before


@pytest.mark.parametrize(
    ("by", "reason"), [("", "why"), ("b" * 256, "why"), ("ops", "r" * 1001), ("ops\x00", "")]
)
def test_force_release_checks_who_and_why(store: LeaseStore, by: str, reason: str) -> None:
    held = acquire(store)
    with pytest.raises(LeaseConfigurationError):
        store.force_release(JOB, by=by, reason=reason)
    record = store.get(JOB)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.HELD, held.generation)
