"""The throughput targets a peers run judges, and its verdict on each.

A target says that one kind's throughput, as a ratio to plain Celery's, is
at least another kind's less a margin, on every pool. Each verdict compares
the medians over the repetitions (the figures of the table), and shows the
two kinds' ratio within each repetition beside them: on shared cores the
kinds of one repetition share its noise.

The 50 ms tasks are judged against the floor and plain Celery with
``acks_late``, not against celery-once: a worker that acknowledges late
(which a leased task must, so that a killed worker's job comes back) waits
for its next message when a task ends, and celery-once's acknowledges on
receipt (docs/performance.md, "The 50 ms target").
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["TARGETS", "Target", "ratios_to", "run_order", "target_lines"]


class Run(Protocol):
    """What a verdict reads of one worker run (``peers.Result``)."""

    kind: str
    workload: str
    pool: str
    repetition: int
    rate: float | None


@dataclass(frozen=True)
class Target:
    """``kind`` >= ``against`` - ``margin`` on ``workload``, on every pool."""

    workload: str
    kind: str
    against: str
    margin: float

    def __str__(self) -> str:
        return f"{self.workload}, {self.kind} >= {self.against} - {self.margin:.2f}"


TARGETS = (
    Target("trivial", "leases-redis", "floor", 0.02),
    Target("50ms", "leases-redis", "floor", 0.02),
    Target("50ms", "leases-redis", "plain-acks-late", 0.02),
    Target("trivial", "leases-postgres", "floor-postgres", 0.03),
)


def run_order(kinds: Sequence[str], repetition: int) -> list[str]:
    """The order one repetition runs ``kinds`` in.

    Plain Celery first, then the kinds of each target, the two compared
    kinds side by side, then the rest in the order given; every other
    repetition runs it backwards. The shared machine's speed drifts by a
    third within a minute (plain Celery alone, run ten times in a row), so
    the kinds a verdict compares, and plain Celery they are divided by, run
    next to each other, and each of two neighbours goes first as often.
    """
    order = ["plain"]
    for target in TARGETS:
        order += [target.kind, target.against]
    ordered = [k for k in dict.fromkeys([*order, *kinds]) if k in kinds]
    return ordered[::-1] if repetition % 2 else ordered


def ratios_to(runs: Sequence[Run], kind: str, base: str, workload: str, pool: str) -> list[float]:
    """``kind``'s throughput over ``base``'s, in each repetition that ran both."""
    ratios = []
    for rep in sorted({r.repetition for r in runs}):
        rates = {
            r.kind: r.rate
            for r in runs
            if r.workload == workload and r.pool == pool and r.repetition == rep
        }
        of_kind, of_base = rates.get(kind), rates.get(base)
        if of_kind and of_base:
            ratios.append(of_kind / of_base)
    return ratios


def _verdict(runs: Sequence[Run], target: Target, pool: str) -> str:
    mine = ratios_to(runs, target.kind, "plain", target.workload, pool)
    theirs = ratios_to(runs, target.against, "plain", target.workload, pool)
    if not mine or not theirs:
        return "not run"
    mine_median, their_median = statistics.median(mine), statistics.median(theirs)
    paired = statistics.median(ratios_to(runs, target.kind, target.against, target.workload, pool))
    # judged on the figures the table prints (two decimals)
    short = round(their_median - target.margin, 2) - round(mine_median, 2)
    verdict = "met" if short <= 1e-9 else f"**MISS** ({short:.2f} short)"
    return f"{mine_median:.2f} / {their_median:.2f}, paired {paired:.2f}: {verdict}"


def target_lines(runs: Sequence[Run], workloads: Sequence[str], pools: Sequence[str]) -> list[str]:
    """The Markdown section judging each target whose workload and kinds ran."""
    ran = {(r.workload, r.kind) for r in runs}
    judged = [
        t
        for t in TARGETS
        if t.workload in workloads and {(t.workload, t.kind), (t.workload, t.against)} <= ran
    ]
    if not judged:
        return []
    lines = [
        "### Targets",
        "",
        "Each cell: the kind's median ratio to plain Celery / the other kind's, "
        "then the median of the two kinds' ratio within each repetition. "
        "Why these targets: [Performance](performance.md#the-50-ms-target).",
        "",
        "| target | " + " | ".join(pools) + " |",
        "|---|" + "---|" * len(pools),
    ]
    for target in judged:
        cells = " | ".join(_verdict(runs, target, pool) for pool in pools)
        lines.append(f"| {target} | {cells} |")
    return [*lines, ""]
