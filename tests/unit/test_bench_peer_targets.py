"""The peers benchmark's verdicts on its targets (``bench/peer_targets.py``), on made-up runs."""

from __future__ import annotations

from dataclasses import dataclass

from tests.acceptance.harness import REPO_ROOT
from tests.by_path import load_file

targets = load_file("peer_targets", REPO_ROOT / "bench" / "peer_targets.py")


@dataclass
class Run:
    kind: str
    workload: str
    pool: str
    repetition: int
    rate: float | None


def _runs(rates: dict[str, list[float | None]], workload: str = "trivial", pool: str = "solo"):
    return [
        Run(kind, workload, pool, rep, rate)
        for kind, per_rep in rates.items()
        for rep, rate in enumerate(per_rep)
    ]


def _row(lines: list[str], target: str) -> list[str]:
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == target:
            return cells[1:]
    raise AssertionError(f"no row for {target!r} in {lines}")


def test_ratios_to_pairs_the_kinds_of_each_repetition_and_skips_a_failed_run() -> None:
    runs = _runs({"plain": [100, 200, 100], "floor": [80, 100, None]})
    assert targets.ratios_to(runs, "floor", "plain", "trivial", "solo") == [0.8, 0.5]
    assert targets.ratios_to(runs, "floor", "plain", "50ms", "solo") == []


def test_a_kind_within_the_margin_meets_its_target() -> None:
    runs = _runs({"plain": [100, 100, 100], "leases-redis": [74, 76, 75], "floor": [76, 77, 78]})
    lines = targets.target_lines(runs, ["trivial"], ["solo"])
    assert lines[0] == "### Targets"
    (cell,) = _row(lines, "trivial, leases-redis >= floor - 0.02")
    # medians 0.75 and 0.77; within each repetition 74/76, 76/77, 75/78
    assert cell == "0.75 / 0.77, paired 0.97: met"


def test_a_kind_below_the_margin_misses_by_what_it_lacks() -> None:
    runs = _runs({"plain": [100, 100, 100], "leases-redis": [70, 71, 72], "floor": [76, 77, 78]})
    (cell,) = _row(targets.target_lines(runs, ["trivial"], ["solo"]), str(targets.TARGETS[0]))
    assert cell == "0.71 / 0.77, paired 0.92: **MISS** (0.04 short)"


def test_the_verdict_reads_the_figures_the_table_prints() -> None:
    # 0.7549 prints as 0.75 and 0.7650 as 0.77: exactly the margin, so met
    runs = _runs({"plain": [10000], "leases-redis": [7549], "floor": [7650]})
    (cell,) = _row(targets.target_lines(runs, ["trivial"], ["solo"]), str(targets.TARGETS[0]))
    assert cell.endswith(": met")
    runs = _runs({"plain": [10000], "leases-redis": [7549], "floor": [7760]})
    (cell,) = _row(targets.target_lines(runs, ["trivial"], ["solo"]), str(targets.TARGETS[0]))
    assert cell.endswith("**MISS** (0.01 short)")


def test_the_50_ms_tasks_are_judged_against_the_floor_and_late_acks() -> None:
    runs = _runs(
        {
            "plain": [100, 100],
            "plain-acks-late": [97, 97],
            "leases-redis": [95, 95],
            "floor": [96, 96],
            "celery-once": [100, 100],
        },
        workload="50ms",
        pool="prefork",
    )
    lines = targets.target_lines(runs, ["50ms"], ["prefork", "threads"])
    assert _row(lines, "50ms, leases-redis >= floor - 0.02") == [
        "0.95 / 0.96, paired 0.99: met",
        "not run",
    ]
    assert _row(lines, "50ms, leases-redis >= plain-acks-late - 0.02")[0].endswith(": met")
    assert not any("celery-once" in line for line in lines)


def test_only_targets_whose_kinds_ran_are_judged() -> None:
    runs = _runs({"plain": [100], "leases-redis": [75]})
    assert targets.target_lines(runs, ["trivial"], ["solo"]) == []
    runs = _runs({"plain": [100], "leases-redis": [75], "floor": [77]})
    assert targets.target_lines(runs, ["50ms"], ["solo"]) == []
    lines = targets.target_lines(runs, ["trivial"], ["solo"])
    assert [line for line in lines if line.startswith("| trivial")] == [
        "| trivial, leases-redis >= floor - 0.02 | 0.75 / 0.77, paired 0.97: met |"
    ]


def test_the_kinds_a_target_compares_run_side_by_side_and_next_to_plain() -> None:
    kinds = ["plain", "plain-acks-late", "leases-redis", "leases-postgres", "floor",
             "floor-postgres", "celery-once"]  # fmt: skip
    forwards, backwards = targets.run_order(kinds, 0), targets.run_order(kinds, 1)
    assert sorted(forwards) == sorted(kinds)
    assert backwards == forwards[::-1]
    assert targets.run_order(kinds, 2) == forwards
    assert forwards[:3] == ["plain", "leases-redis", "floor"]
    for target in targets.TARGETS:
        at = forwards.index(target.kind)
        assert forwards.index(target.against) - at in (1, 2), target  # plain-acks-late: 2
    assert abs(forwards.index("leases-postgres") - forwards.index("floor-postgres")) == 1
    # a kind no target names keeps its place after the targets' kinds
    assert forwards[-1] == "celery-once"


def test_the_run_order_leaves_out_kinds_that_do_not_run() -> None:
    assert targets.run_order(["plain", "floor", "leases-redis"], 0) == [
        "plain", "leases-redis", "floor",
    ]  # fmt: skip
    assert targets.run_order(["plain", "celery-once"], 1) == ["celery-once", "plain"]
