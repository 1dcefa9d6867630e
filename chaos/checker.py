"""The checker: reads a run's history and the targets' logs, reports violations.

Each check uses only orderings that cannot be wrong: the host's monotonic
clock between the *answer* of one operation and the *sending* of another
(``result.mono < call.mono`` means the first finished before the second
began), the store's own clock in its answers (``store_now_ms``,
``lease_until_ms``), and each target's own order of accepted writes.

- I1 per job, a generation is handed out once, and a claim that began after
  another one finished got a higher generation;
- I2 no claim succeeds while another generation's lease, as the store last
  confirmed it, is still live on the store's clock;
- I3 at most one accepted completion per job, none stale (a newer claim had
  already succeeded), and it is the one the store's final record names;
- I4 no renewal accepted for a generation older than a claim the store had
  already made;
- I5 each target accepted non-decreasing generations per job;
- I6 every job completed in the store and its client got a result or a
  clear terminal error (the poison verdict, :data:`TERMINAL`);
- I7 (the ``once`` profile) each job's exactly-once effect is in the
  store's database exactly once;
- D  no target accepted a write sent after its run's local deadline;
- H  (gevent and eventlet pools) renewals land while a task holds the hub:
  of the runs that held it longer than their lease's safe duration (a
  ``hold`` record, see :mod:`chaos.app`), at least one saw its lease's
  deadline move on meanwhile. A heartbeat that waits in the hub never can.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery_leases import LeaseRecord, LeaseState
from chaos.targets import Write

__all__ = ["TERMINAL", "Report", "check"]

#: the clear terminal errors a client may get instead of a result (I6):
#: the poison verdict after ``leases_max_takeovers`` takeovers
TERMINAL = frozenset({"FAILURE:TakeoverLimitExceeded"})


@dataclasses.dataclass
class Report:
    counts: Counter[str]
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations

    def format(self) -> str:
        lines = [f"{name:>24}: {value}" for name, value in sorted(self.counts.items())]
        lines.append(f"{'violations':>24}: {len(self.violations)}")
        lines.extend(f"  VIOLATION {v}" for v in self.violations[:50])
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Op:
    op: str
    job: str
    owner: str
    generation: int | None
    sent: float
    answered: float
    result: Mapping[str, Any]

    @property
    def type(self) -> str:
        return str(self.result.get("type", ""))


def _operations(records: Sequence[Mapping[str, Any]]) -> list[_Op]:
    calls = {r["id"]: r for r in records if r["kind"] == "call"}
    ops = []
    for r in records:
        if r["kind"] != "result" or r["call"] not in calls:
            continue
        call = calls[r["call"]]
        answer = r["answer"]
        generation = r.get("generation")
        if r["op"] == "claim":
            generation = answer.get("generation") if answer.get("type") == "Acquired" else None
        ops.append(_Op(r["op"], r["job"], r["owner"], generation, call["mono"], r["mono"], answer))
    return ops


def check(
    records: Sequence[Mapping[str, Any]],
    *,
    jobs: Iterable[str],
    targets: Mapping[str, Sequence[Write]],
    final: Mapping[str, LeaseRecord | None],
    results: Mapping[str, str],
    nemesis: Mapping[str, int] | None = None,
    effects: Mapping[str, int] | None = None,
) -> Report:
    """Check a run.

    ``results`` maps a job to its client's answer: ``SUCCESS``, or
    ``FAILURE:<error class>`` (see :data:`TERMINAL`), or another state.
    ``effects`` maps a job to the rows its exactly-once effect left (``once``
    profile only).
    """
    jobs = list(jobs)
    counts: Counter[str] = Counter(nemesis or {})
    violations: list[str] = []
    ops = _operations(records)
    by_job: dict[str, list[_Op]] = defaultdict(list)
    for op in ops:
        by_job[op.job].append(op)

    counts["jobs"] = len(jobs)
    for job in jobs:
        job_ops = by_job.get(job, [])
        claims = [o for o in job_ops if o.op == "claim" and o.type == "Acquired"]
        counts["attempts"] += len(claims)
        counts["takeovers"] += max(len(claims) - 1, 0)
        for o in job_ops:
            if o.op == "claim" and o.type != "Acquired":
                counts[f"deliveries found {o.type}"] += 1
        violations += _check_claims(job, claims, job_ops)
        violations += _check_completions(job, claims, job_ops, final.get(job))
        counts["fenced-out completions"] += sum(
            1 for o in job_ops if o.op == "complete" and o.type == "Refusal"
        )
        record = final.get(job)
        if record is None or record.state is not LeaseState.COMPLETED:
            violations.append(f"I6 job {job}: not completed in the store ({record})")
        answer = results.get(job)
        if answer in TERMINAL:
            counts[f"terminal errors ({answer.split(':')[1]})"] += 1
        elif answer != "SUCCESS":
            violations.append(f"I6 job {job}: its client got {answer!r}, not a result")

    for name, writes in targets.items():
        last: dict[str, int] = {}
        for job, generation, step, pid in writes:
            counts[f"accepted writes ({name})"] += 1
            if generation < last.get(job, 0):
                violations.append(
                    f"I5 target {name} job {job}: accepted generation {generation} (step {step}, "
                    f"pid {pid}) after {last[job]}"
                )
            last[job] = max(last.get(job, 0), generation)

    for job, applied in (effects or {}).items():
        counts[f"jobs with {applied} effect rows"] += 1
        if applied != 1:
            violations.append(f"I7 job {job}: its effect was applied {applied} times, not once")
    violations += _check_writes(records, counts)
    violations += _check_holds(records, counts)
    for r in records:
        if r["kind"] in ("lease_lost", "lease_fenced_out", "lease_skipped", "late"):
            counts[r["kind"].replace("_", " ")] += 1
        elif r["kind"] == "duplicate_deferred":
            counts[f"deferred ({r.get('reason')})"] += 1
    return Report(counts, violations)


def _check_claims(job: str, claims: list[_Op], job_ops: list[_Op]) -> list[str]:
    found = []
    owners: dict[int, set[str]] = defaultdict(set)
    for c in claims:
        owners[int(c.generation or 0)].add(c.owner)
    for generation, names in owners.items():
        if len(names) > 1:
            found.append(f"I1 job {job}: generation {generation} handed to {len(names)} owners")
    for a in claims:
        for b in claims:
            if a.answered < b.sent and int(a.generation or 0) >= int(b.generation or 0):
                found.append(
                    f"I1 job {job}: claim of generation {b.generation} began after generation "
                    f"{a.generation} was handed out"
                )
    # every lease the store confirmed: (generation, store time, lease_until)
    confirmed = [
        (int(o.generation or 0), int(o.result["store_now_ms"]), int(o.result["lease_until_ms"]))
        for o in job_ops
        if (o.op == "claim" and o.type == "Acquired") or (o.op == "renew" and o.type == "Renewed")
    ]
    # a release may have ended a lease early: one sent before the claim's answer
    released = {
        int(o.generation or 0): o.sent
        for o in job_ops
        if o.op == "release" and o.type == "Released"
    }
    for b in claims:
        b_gen, b_now = int(b.generation or 0), int(b.result["store_now_ms"])
        for gen, now, until in confirmed:
            if gen in released and released[gen] < b.answered:
                continue
            if gen != b_gen and now < b_now < until:
                found.append(
                    f"I2 job {job}: generation {b_gen} claimed at store time {b_now} while "
                    f"generation {gen}'s lease ran until {until}"
                )
        for o in job_ops:
            stale = o.op == "renew" and o.type == "Renewed" and int(o.generation or 0) < b_gen
            if stale and int(o.result["store_now_ms"]) > b_now:
                found.append(
                    f"I4 job {job}: renewal of generation {o.generation} accepted after "
                    f"generation {b_gen} was claimed"
                )
    return found


def _check_completions(
    job: str, claims: list[_Op], job_ops: list[_Op], record: LeaseRecord | None
) -> list[str]:
    found = []
    accepted = [o for o in job_ops if o.op == "complete" and o.type == "Completed"]
    runs = {(o.owner, o.generation) for o in accepted}
    if len(runs) > 1:
        found.append(f"I3 job {job}: {len(runs)} accepted completions {sorted(runs, key=str)}")
    for o in accepted:
        newer = [
            c
            for c in claims
            if c.answered < o.sent and int(c.generation or 0) > int(o.generation or 0)
        ]
        if newer:
            found.append(
                f"I3 job {job}: stale completion of generation {o.generation} accepted after "
                f"generation {newer[0].generation} was claimed"
            )
        if record is not None and (record.owner, record.generation) != (o.owner, o.generation):
            found.append(
                f"I3 job {job}: completion by generation {o.generation} accepted, but the store "
                f"records generation {record.generation}"
            )
    return found


#: seconds a lease's time left must exceed "no renewal" by to count as renewed
_RENEWED_BY = 0.05


def _check_holds(records: Sequence[Mapping[str, Any]], counts: Counter[str]) -> list[str]:
    holds = [r for r in records if r["kind"] == "hold"]
    if not holds:
        return []
    # without a renewal the time left only goes down, to 0 at the deadline
    renewed = sum(
        1
        for r in holds
        if float(r["after"]) > max(0.0, float(r["before"]) - float(r["held"])) + _RENEWED_BY
    )
    counts["hub holds"] = len(holds)
    counts["hub holds renewed meanwhile"] = renewed
    if renewed:
        return []
    return [
        f"H no renewal landed during any of {len(holds)} holds of the hub: the "
        "heartbeat waits in the hub"
    ]


def _check_writes(records: Sequence[Mapping[str, Any]], counts: Counter[str]) -> list[str]:
    found = []
    writes = {r["id"]: r for r in records if r["kind"] == "write"}
    for r in records:
        if r["kind"] != "write-result":
            continue
        write = writes.get(r["call"])
        late = " (late)" if write is not None and write.get("late") else ""
        counts[f"target writes {r['outcome']}{late}"] += 1
        if write is None or write.get("late"):
            continue  # a late write left before the deadline: the fence's business
        if r["outcome"] == "accepted" and float(write["remaining"]) <= 0:
            found.append(
                f"D job {write['job']}: a write of generation {write['generation']} was sent "
                f"{-float(write['remaining']):.2f} s after the local deadline and accepted"
            )
    return found
