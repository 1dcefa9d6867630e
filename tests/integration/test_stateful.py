"""A stateful model test of every store against a plain model of the protocol.

Hypothesis drives random sequences of claim (with or without a send id),
renew, renew_many, complete (with an outcome), release and an operator's
forced release by a few owners on a few jobs, with time passing between them, and
checks every answer against a model of the record. The memory store runs on a
manual clock, so its edges are exact and it can run many examples. Real
stores run on real time with short TTLs; the model then never guesses whether
a lease had run out: a claim's answer is checked against the bounds the
store's clock gives (``now_ms()`` before and after the call, and the
``store_now_ms`` of an :class:`Acquired`).

Checked invariants: I1 (generations strictly increase and are never reused),
I2 (a live lease is never claimed by anyone), I3 (at most one accepted
completion per run of a job), I4 (a stale owner or generation is always refused).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

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
    Released,
    Renewed,
    RenewRequest,
)
from celery_leases.stores.memory import ManualClock, MemoryStore

OWNERS = ("w1", "w2", "w3")
JOBS = (0, 1, 2)
SENDS = (None, "send-1", "send-2")


@dataclass
class ModelRecord:
    """What the store should hold for one job."""

    owner: str
    generation: int
    state: LeaseState
    lease_until_ms: int
    send_id: str = ""
    outcome: bytes | None = None


@dataclass(frozen=True)
class Token:
    """A lease some owner was granted once (it may have gone stale since)."""

    job_id: str
    owner: str
    generation: int


@dataclass
class Timing:
    """How one store kind lets time pass, and how many examples it can afford."""

    advance: Callable[[float], None]
    ttls: tuple[float, ...]
    pauses: tuple[float, ...]
    settings: settings


@dataclass
class Ledger:
    """Per-job history across one example, for the invariants."""

    generations: dict[str, list[int]] = field(default_factory=dict)
    completions: dict[str, int] = field(default_factory=dict)


def expected_refusal(record: ModelRecord | None, generation: int) -> RefusalReason:
    """The reason the protocol gives for refusing (owner, ``generation``)."""
    if record is None:
        return RefusalReason.MISSING
    if record.state is LeaseState.COMPLETED:
        return RefusalReason.COMPLETED
    if record.state is LeaseState.RELEASED and record.generation == generation:
        return RefusalReason.RELEASED
    return RefusalReason.SUPERSEDED


def build_machine(store: LeaseStore, timing: Timing) -> type[RuleBasedStateMachine]:
    """A state machine class bound to ``store``; each example uses fresh job ids."""

    class LeaseMachine(RuleBasedStateMachine):
        tokens = Bundle("tokens")

        def __init__(self) -> None:
            super().__init__()
            self.namespace = uuid.uuid4().hex[:12]
            self.model: dict[str, ModelRecord] = {}
            self.ledger = Ledger()

        def job_id(self, job: int) -> str:
            return f"{self.namespace}-job-{job}"

        # -- checks shared by the rules -------------------------------------

        def matches(self, token: Token) -> bool:
            record = self.model.get(token.job_id)
            return (
                record is not None
                and record.state is LeaseState.HELD
                and record.owner == token.owner
                and record.generation == token.generation
            )

        def check_refusal(self, result: object, token: Token) -> None:
            record = self.model.get(token.job_id)
            assert isinstance(result, Refusal), f"stale {token} was not refused: {result}"
            assert result.reason is expected_refusal(record, token.generation), result
            assert (result.job_id, result.owner, result.generation) == (
                token.job_id,
                token.owner,
                token.generation,
            )
            if record is None:
                assert result.current_generation is None
            else:
                assert result.current_generation == record.generation
                assert result.current_owner == record.owner

        def check_renewal(
            self, result: object, token: Token, ttl: float, before: int, after: int
        ) -> None:
            if not self.matches(token):
                self.check_refusal(result, token)
                return
            assert isinstance(result, Renewed), f"{token} should have been renewed: {result}"
            assert result.generation == token.generation
            assert before <= result.store_now_ms <= after
            assert result.lease_until_ms == result.store_now_ms + round(ttl * 1000)
            self.model[token.job_id].lease_until_ms = result.lease_until_ms

        # -- rules ----------------------------------------------------------

        @rule(
            target=tokens,
            job=st.sampled_from(JOBS),
            owner=st.sampled_from(OWNERS),
            ttl=st.sampled_from(timing.ttls),
            send_id=st.sampled_from(SENDS),
        )
        def claim(self, job: int, owner: str, ttl: float, send_id: str | None) -> object:
            job_id = self.job_id(job)
            record = self.model.get(job_id)
            before = store.now_ms()
            result = store.claim(job_id, owner, ttl, send_id=send_id)
            after = store.now_ms()

            new_run = False
            if record is not None and record.state is LeaseState.COMPLETED:
                if send_id is None or send_id == record.send_id:
                    assert result == AlreadyCompleted(
                        job_id, record.generation, record.send_id, record.outcome
                    )
                    return multiple()
                new_run = True  # another send of a completed job runs again
                self.ledger.completions[job_id] = 0
            if isinstance(result, HeldElsewhere):
                assert record is not None, "a job without a record was reported held"
                assert record.state is LeaseState.HELD, f"{record.state} job reported held"
                # live at the store's instant, which is not before `before`
                assert record.lease_until_ms > before, "a run-out lease was reported held"
                assert (result.holder, result.generation) == (record.owner, record.generation)
                assert 0 < result.remaining * 1000 <= record.lease_until_ms - before + 0.5
                return multiple()

            assert isinstance(result, Acquired), result
            assert before <= result.store_now_ms <= after
            assert result.lease_until_ms == result.store_now_ms + round(ttl * 1000)
            if record is None:
                assert before <= result.generation <= after
            else:
                assert result.generation == max(record.generation + 1, result.store_now_ms)
                if record.state is LeaseState.HELD:
                    assert record.lease_until_ms <= result.store_now_ms, (
                        f"I2: a lease live until {record.lease_until_ms} was claimed "
                        f"at {result.store_now_ms}"
                    )
            history = self.ledger.generations.setdefault(job_id, [])
            assert all(g < result.generation for g in history), f"I1: {history} then {result}"
            history.append(result.generation)
            if new_run:
                assert result.takeovers == 0
            self.model[job_id] = ModelRecord(
                owner, result.generation, LeaseState.HELD, result.lease_until_ms, send_id or ""
            )
            return Token(job_id, owner, result.generation)

        @rule(
            token=tokens,
            impostor=st.none() | st.sampled_from(OWNERS),
            shift=st.sampled_from((0, 0, 0, 1, -1)),
            ttl=st.sampled_from(timing.ttls),
        )
        def renew(self, token: Token, impostor: str | None, shift: int, ttl: float) -> None:
            token = Token(token.job_id, impostor or token.owner, token.generation + shift)
            before = store.now_ms()
            result = store.renew(token.job_id, token.owner, token.generation, ttl)
            after = store.now_ms()
            self.check_renewal(result, token, ttl, before, after)

        @rule(batch=st.lists(tokens, max_size=4), ttl=st.sampled_from(timing.ttls))
        def renew_many(self, batch: list[Token], ttl: float) -> None:
            before = store.now_ms()
            results = store.renew_many(
                [RenewRequest(t.job_id, t.owner, t.generation, ttl) for t in batch]
            )
            after = store.now_ms()
            assert len(results) == len(batch)
            for token, result in zip(batch, results, strict=True):
                assert result.job_id == token.job_id, "renew_many answered out of order"
                self.check_renewal(result, token, ttl, before, after)

        @rule(
            token=tokens,
            impostor=st.none() | st.sampled_from(OWNERS),
            outcome=st.none() | st.binary(max_size=8),
        )
        def complete(self, token: Token, impostor: str | None, outcome: bytes | None) -> None:
            token = Token(token.job_id, impostor or token.owner, token.generation)
            fresh = self.matches(token)
            record = self.model.get(token.job_id)
            result = store.complete(token.job_id, token.owner, token.generation, outcome=outcome)
            if (
                record is not None
                and record.state is LeaseState.COMPLETED
                and (record.owner, record.generation) == (token.owner, token.generation)
            ):
                # rule 6: this run's completion is already recorded; nothing changes
                assert result == Completed(token.job_id, token.generation)
                return
            if not fresh:
                self.check_refusal(result, token)
                return
            assert result == Completed(token.job_id, token.generation)
            count = self.ledger.completions.get(token.job_id, 0) + 1
            assert count == 1, f"I3: job {token.job_id} completed {count} times"
            self.ledger.completions[token.job_id] = count
            self.model[token.job_id].state = LeaseState.COMPLETED
            self.model[token.job_id].outcome = outcome

        @rule(token=tokens)
        def release(self, token: Token) -> None:
            fresh = self.matches(token)
            result = store.release(token.job_id, token.owner, token.generation)
            if not fresh:
                self.check_refusal(result, token)
                return
            assert result == Released(token.job_id, token.generation)
            record = self.model[token.job_id]
            record.state = LeaseState.RELEASED
            record.owner = ""

        @rule(job=st.sampled_from(JOBS))
        def force_release(self, job: int) -> None:
            job_id = self.job_id(job)
            record = self.model.get(job_id)
            if record is None or record.state is LeaseState.COMPLETED:
                with pytest.raises(LeaseConfigurationError):
                    store.force_release(job_id, by="ops", reason="test")
                return
            released = store.force_release(job_id, by="ops", reason="test")
            assert released.generation == record.generation + 1
            assert (released.state, released.owner) == (LeaseState.RELEASED, "")
            record.generation += 1
            record.state = LeaseState.RELEASED
            record.owner = ""

        @rule(seconds=st.sampled_from(timing.pauses))
        def let_time_pass(self, seconds: float) -> None:
            timing.advance(seconds)

        # -- invariants -----------------------------------------------------

        @invariant()
        def store_holds_the_model(self) -> None:
            for job_id, expected in self.model.items():
                record = store.get(job_id)
                assert record is not None, f"the record of {job_id} vanished"
                assert (record.owner, record.generation, record.state) == (
                    expected.owner,
                    expected.generation,
                    expected.state,
                )
                assert record.send_id == expected.send_id
                if expected.state is LeaseState.COMPLETED:
                    assert record.outcome == expected.outcome
                if expected.state is LeaseState.HELD:
                    assert record.lease_until_ms == expected.lease_until_ms

    return LeaseMachine


MEMORY_SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None, database=None)
REAL_SETTINGS = settings(
    max_examples=12,
    stateful_step_count=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_store_follows_the_protocol_model(store_kind: str, request: pytest.FixtureRequest) -> None:
    if store_kind == "memory":
        clock = ManualClock()
        store: LeaseStore = MemoryStore(clock=clock)
        timing = Timing(clock.advance, (1.0, 2.0, 5.0), (0.5, 1.0, 3.0, 6.0), MEMORY_SETTINGS)
    else:
        store = request.getfixturevalue("store")
        timing = Timing(time.sleep, (0.2, 0.3, 0.5), (0.05, 0.2, 0.4), REAL_SETTINGS)
    run_state_machine_as_test(build_machine(store, timing), settings=timing.settings)
