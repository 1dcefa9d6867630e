"""Property-based fuzzing of the public store API on every store kind (R7).

Arbitrary job ids (any Unicode, control characters, braces, lone
surrogates, NUL, 255+ characters), owners, TTLs (0, negative, NaN, inf,
huge, booleans, strings) and generations (0, negative, beyond 64 bits,
booleans). Each call either works as the protocol says or raises
:class:`LeaseConfigurationError`, exactly when the documented argument
rules say so; nothing else escapes, and no stale or invalid token is ever
accepted.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_leases import (
    Acquired,
    Completed,
    LeaseConfigurationError,
    LeaseState,
    LeaseStore,
    Refusal,
    Released,
    Renewed,
)
from celery_leases.stores.checks import MAX_GENERATION

FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

texts = st.one_of(
    st.text(max_size=300),
    st.text(alphabet=st.characters(codec=None), max_size=20),  # surrogates, NUL, controls
    st.sampled_from(["{job}", "a{b}c", "\x00", "\n\t\r", "\udc80", "x" * 255, "x" * 256, ""]),
)
ttls: st.SearchStrategy[Any] = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 0.0, -1, 0.0001, 86400, 86400.001, True, False, "30", None]),
)
generations: st.SearchStrategy[Any] = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2**53 - 1, 2**53, 2**63 - 1, 2**63, True, 1.0, "7", None]),
)


def text_ok(value: object) -> bool:
    """The documented rule for job ids and owners (celery_leases.stores.checks)."""
    if not isinstance(value, str) or not value or len(value) > 255 or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def ttl_ok(ttl: object) -> bool:
    return (
        not isinstance(ttl, bool)
        and isinstance(ttl, (int, float))
        and math.isfinite(ttl)
        and 0 < ttl <= 86400
    )


def unique_job(prefix: str) -> str:
    return f"{uuid.uuid4().hex[:8]}{prefix}"[:255]


@FUZZ
@given(job_part=texts, owner=texts, ttl=ttls)
def test_a_claim_works_or_names_the_bad_argument(
    store: LeaseStore, job_part: str, owner: str, ttl: Any
) -> None:
    # the job id keeps the fuzzed text (a fresh prefix keeps examples apart)
    job = job_part if not text_ok(job_part) else unique_job(job_part)
    valid = text_ok(job) and text_ok(owner) and ttl_ok(ttl)
    try:
        result = store.claim(job, owner, ttl)
    except LeaseConfigurationError as exc:
        refused: LeaseConfigurationError | None = exc
    else:
        refused = None
    if refused is not None:
        assert not valid, f"a valid claim was refused: {refused}"
        return
    assert valid, f"an invalid claim was accepted: {job!r} {owner!r} {ttl!r}"
    assert isinstance(result, Acquired)
    record = store.get(job)
    assert record is not None
    assert (record.job_id, record.owner, record.generation) == (job, owner, result.generation)
    assert isinstance(store.renew(job, owner, result.generation, 5), Renewed)
    assert isinstance(store.complete(job, owner, result.generation), Completed)
    done = store.get(job)
    assert done is not None
    assert done.state is LeaseState.COMPLETED


@FUZZ
@given(generation=generations, ttl=ttls)
def test_no_other_generation_is_ever_accepted(store: LeaseStore, generation: Any, ttl: Any) -> None:
    job = unique_job("gen")
    claim = store.claim(job, "owner-a", 30)
    assert isinstance(claim, Acquired)
    # the documented rule: a whole number a store can hand out, 1 to 2**53 - 1
    generation_ok = (
        isinstance(generation, int)
        and not isinstance(generation, bool)
        and 1 <= generation <= MAX_GENERATION
    )
    calls = [
        ("renew", ttl_ok(ttl), lambda: store.renew(job, "owner-a", generation, ttl)),
        ("release", True, lambda: store.release(job, "owner-a", generation)),
        ("complete", True, lambda: store.complete(job, "owner-a", generation)),
    ]
    for name, other_args_ok, call in calls:
        valid = generation_ok and other_args_ok
        try:
            result = call()
        except LeaseConfigurationError as exc:
            error: LeaseConfigurationError | None = exc
        else:
            error = None
        if error is not None:
            assert not valid, f"{name}: {error}"
            continue
        assert valid, f"{name} accepted bad arguments {generation!r} {ttl!r}: {result}"
        if generation == claim.generation:
            assert isinstance(result, (Renewed, Released, Completed, Refusal))
        else:
            assert isinstance(result, Refusal), f"{name} accepted generation {generation}"
    record = store.get(job)
    assert record is not None
    assert record.generation == claim.generation


@pytest.mark.parametrize("generation", [2**53, 2**63, 2**70])
def test_a_generation_beyond_what_a_store_hands_out_is_a_configuration_error(
    store: LeaseStore, generation: int
) -> None:
    """Also on SQLite, whose driver raised OverflowError at 2**63 before the
    argument check capped generations at 2**53 - 1."""
    job = unique_job("big")
    claim = store.claim(job, "owner-a", 30)
    assert isinstance(claim, Acquired)
    for call in (
        lambda: store.renew(job, "owner-a", generation, 5),
        lambda: store.release(job, "owner-a", generation),
        lambda: store.complete(job, "owner-a", generation),
    ):
        with pytest.raises(LeaseConfigurationError, match="generation"):
            call()
    record = store.get(job)
    assert record is not None
    assert record.state is LeaseState.HELD


FIELDS = ["owner", "generation", "lease_until", "state", "renew_count", "takeovers", "claimed_at"]


@FUZZ
@given(
    field=st.sampled_from(FIELDS),
    value=st.one_of(
        st.binary(max_size=12),
        st.text(max_size=12),
        st.sampled_from(["", "12abc", " 7", "1e3", "-1", "nan", "held", "completed", "9" * 30]),
    ),
)
def test_a_corrupted_redis_record_is_unreadable_or_read_as_written(
    redis_server: Any, unique: str, field: str, value: str | bytes
) -> None:
    """A record field overwritten with anything: every operation on the job
    answers normally or raises a LeaseError; nothing else escapes, and a
    corrupted generation never lets the old token through."""
    from celery_leases import LeaseError, RenewRequest, open_store

    store = open_store(redis_server.url, prefix=f"fz{unique}:")
    try:
        job = unique_job("corrupt")
        claim = store.claim(job, "owner-a", 30)
        assert isinstance(claim, Acquired)
        store._client.hset(store.key(job), field, value)  # type: ignore[attr-defined]
        answers: list[object] = []
        for call in (
            lambda: store.get(job),
            lambda: store.renew(job, "owner-a", claim.generation, 5),
            lambda: store.renew_many([RenewRequest(job, "owner-a", claim.generation, 5)]),
            lambda: list(store.records()),
            lambda: store.claim(job, "owner-b", 30),
            lambda: store.release(job, "owner-a", claim.generation),
            lambda: store.complete(job, "owner-a", claim.generation),
        ):
            try:
                answers.append(call())
            except LeaseError as exc:
                answers.append(exc)
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if field == "generation" and text != str(claim.generation):
            assert not isinstance(answers[1], Renewed), answers
            assert not isinstance(answers[6], Completed), answers
    finally:
        store.close()
