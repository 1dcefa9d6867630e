"""The chaos checker on small hand-made histories: each check fires on the
history a broken variant leaves, and stays quiet on a correct one."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from celery_leases import LeaseRecord, LeaseState
from chaos.checker import Report, check
from chaos.targets import Write

JOB = "j1"
_ids = itertools.count(1)


class History:
    """Builds records as the workers write them, on a fake monotonic clock."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.mono = 0.0

    def _add(self, kind: str, **fields: Any) -> str:
        self.mono += 0.01
        record_id = f"p-{next(_ids)}"
        self.records.append({"kind": kind, "id": record_id, "pid": 1, "mono": self.mono, **fields})
        return record_id

    def op(
        self, op: str, owner: str, generation: int | None, answer: dict[str, Any], job: str = JOB
    ) -> None:
        call = self._add("call", op=op, job=job, owner=owner, generation=generation)
        self._add(
            "result", call=call, op=op, job=job, owner=owner, generation=generation, answer=answer
        )

    def claim(self, owner: str, generation: int, now: int, ttl: int = 1000) -> None:
        answer = {
            "type": "Acquired",
            "owner": owner,
            "generation": generation,
            "store_now_ms": now,
            "lease_until_ms": now + ttl,
        }
        self.op("claim", owner, None, answer)

    def renew(self, owner: str, generation: int, now: int, ttl: int = 1000) -> None:
        answer = {
            "type": "Renewed",
            "generation": generation,
            "store_now_ms": now,
            "lease_until_ms": now + ttl,
        }
        self.op("renew", owner, generation, answer)

    def complete(self, owner: str, generation: int, accepted: bool = True) -> None:
        answer = {"type": "Completed" if accepted else "Refusal", "generation": generation}
        self.op("complete", owner, generation, answer)

    def release(self, owner: str, generation: int) -> None:
        self.op("release", owner, generation, {"type": "Released", "generation": generation})

    def write(self, owner: str, generation: int, remaining: float, outcome: str) -> None:
        call = self._add(
            "write", target="sql", job=JOB, generation=generation, owner=owner, step=1,
            remaining=remaining,
        )  # fmt: skip
        self._add("write-result", call=call, outcome=outcome)


def completed(owner: str, generation: int) -> LeaseRecord:
    return LeaseRecord(JOB, owner, generation, 0, LeaseState.COMPLETED)


def run_check(
    history: History,
    final: LeaseRecord | None,
    writes: Sequence[Write] = (),
    result: str = "SUCCESS",
) -> Report:
    return check(
        history.records,
        jobs=[JOB],
        targets={"sql": list(writes)},
        final={JOB: final},
        results={JOB: result},
    )


def takeover(history: History) -> None:
    """A claims 10 at t=0 and renews; its lease runs out; B claims 11 at t=3000."""
    history.claim("A", 10, 0)
    history.renew("A", 10, 500)
    history.claim("B", 11, 3000)


def test_a_clean_takeover_passes() -> None:
    history = History()
    takeover(history)
    history.write("A", 10, remaining=0.2, outcome="refused")
    history.complete("A", 10, accepted=False)
    history.write("B", 11, remaining=0.8, outcome="accepted")
    history.complete("B", 11)
    report = run_check(history, completed("B", 11), [(JOB, 11, 1, 2)])
    assert report.ok, report.format()
    assert report.counts["takeovers"] == 1
    assert report.counts["fenced-out completions"] == 1


def test_a_stale_completion_is_caught() -> None:
    # complete-without-generation: A's stale completion completes B's record
    history = History()
    takeover(history)
    history.complete("A", 10)
    history.complete("B", 11)
    report = run_check(history, completed("B", 11))
    assert any(v.startswith("I3") and "stale" in v for v in report.violations), report.format()
    assert any("2 accepted completions" in v for v in report.violations)


def test_a_generation_handed_out_twice_is_caught() -> None:
    # expiring-generation: the counter vanished with the lease and restarted
    history = History()
    history.claim("A", 1, 0)
    history.claim("B", 1, 3000)
    history.complete("B", 1)
    report = run_check(history, completed("B", 1))
    assert any("handed to 2 owners" in v for v in report.violations), report.format()
    assert any("began after generation 1" in v for v in report.violations)


def test_a_target_that_accepts_an_older_generation_is_caught() -> None:
    # unfenced-target: the stale writer lands after the new holder
    history = History()
    takeover(history)
    history.complete("B", 11)
    report = run_check(history, completed("B", 11), [(JOB, 11, 1, 2), (JOB, 10, 1, 1)])
    assert any(v.startswith("I5") for v in report.violations), report.format()


def test_a_stale_renewal_is_caught() -> None:
    # renew-without-owner: A renews after B's claim
    history = History()
    takeover(history)
    history.renew("A", 10, 3100)
    history.complete("B", 11)
    report = run_check(history, completed("B", 11))
    assert any(v.startswith("I4") for v in report.violations), report.format()


def test_a_claim_while_another_lease_is_live_is_caught() -> None:
    # worker-clock-claim: B takes the job at t=800, A's lease runs to 1500
    history = History()
    history.claim("A", 10, 0)
    history.renew("A", 10, 500)
    history.claim("B", 11, 800)
    history.complete("B", 11)
    report = run_check(history, completed("B", 11))
    assert any(v.startswith("I2") for v in report.violations), report.format()


def test_a_claim_after_a_release_is_not_a_second_holder() -> None:
    history = History()
    history.claim("A", 10, 0)
    history.release("A", 10)
    history.claim("B", 11, 100)
    history.complete("B", 11)
    report = run_check(history, completed("B", 11))
    assert report.ok, report.format()


def test_a_write_after_the_local_deadline_is_caught() -> None:
    # ignore-deadline: A wrote 0.7 s past its deadline and the target took it
    history = History()
    history.claim("A", 10, 0)
    history.write("A", 10, remaining=-0.7, outcome="accepted")
    history.complete("A", 10)
    report = run_check(history, completed("A", 10), [(JOB, 10, 1, 1)])
    assert any(v.startswith("D") for v in report.violations), report.format()


def test_a_lost_job_is_caught() -> None:
    history = History()
    history.claim("A", 10, 0)
    report = run_check(history, LeaseRecord(JOB, "A", 10, 1000, LeaseState.HELD), result="PENDING")
    assert [v[:2] for v in report.violations] == ["I6", "I6"], report.format()


def test_a_poison_verdict_is_an_answer_not_a_lost_job() -> None:
    history = History()
    history.claim("A", 10, 0)
    history.complete("A", 10)
    report = run_check(history, completed("A", 10), result="FAILURE:TakeoverLimitExceeded")
    assert report.ok, report.format()
    assert report.counts["terminal errors (TakeoverLimitExceeded)"] == 1
    failed = run_check(History(), completed("A", 10), result="FAILURE:ValueError")
    assert any("FAILURE:ValueError" in v for v in failed.violations)


def test_an_effect_applied_twice_is_caught_and_once_passes() -> None:
    history = History()
    takeover(history)
    history.complete("B", 11)

    def with_effects(rows: int) -> Report:
        return check(
            history.records,
            jobs=[JOB],
            targets={},
            final={JOB: completed("B", 11)},
            results={JOB: "SUCCESS"},
            effects={JOB: rows},
        )

    assert with_effects(1).ok, with_effects(1).format()
    for rows in (0, 2):
        report = with_effects(rows)
        assert [v for v in report.violations if v.startswith("I7 ")], report.format()


def test_holds_of_the_hub_without_any_renewal_are_caught() -> None:
    """A heartbeat that waits in the hub: every hold ends with the time left
    run down (to 0 past the deadline); one renewal meanwhile is enough."""

    def holds(*spans: tuple[float, float, float]) -> Report:
        history = History()
        history.claim("A", 10, 0)
        history.complete("A", 10)
        for before, held, after in spans:
            history._add("hold", job=JOB, generation=10, owner="A", held=held, before=before,
                         after=after)  # fmt: skip
        return run_check(history, completed("A", 10))

    waited = holds((1.1, 1.8, 0.0), (0.9, 0.5, 0.4), (1.0, 1.2, 0.0))
    assert [v[:2] for v in waited.violations] == ["H "], waited.format()
    assert waited.counts["hub holds renewed meanwhile"] == 0
    renewed = holds((1.1, 1.8, 0.0), (0.9, 0.5, 0.9), (1.0, 1.8, 0.7))
    assert renewed.ok, renewed.format()
    assert renewed.counts["hub holds"] == 3
    assert renewed.counts["hub holds renewed meanwhile"] == 2
    assert holds().ok  # no green pool: nothing to check
