"""The concurrency benchmark still runs: a short run prints both sizes and their ratio.

No timing is asserted: only that every size claimed jobs and that the CPU
split was read.
"""

from __future__ import annotations

import re

import pytest

from tests.bench_runs import run_bench


@pytest.mark.postgres
def test_a_short_run_prints_claims_per_second_of_both_sizes_and_their_ratio() -> None:
    out = run_bench(
        "concurrency.py", "--stores", "postgres,redis", "--processes", "1,2",
        "--seconds", "1.5", "--rounds", "1",
    )  # fmt: skip
    for store in ("postgres", "redis"):
        section = out.split(f"{store}: ", 1)[1]
        rows = re.findall(
            r"^\| (\d+) \| ([\d,]+) \| [\d,]+-[\d,]+ \| (\d+)% \| (\d+)% \|", section, re.M
        )
        assert [size for size, *_ in rows[:2]] == ["1", "2"], section
        assert all(int(rate.replace(",", "")) > 0 for _, rate, *_ in rows[:2]), section
        assert all(0 < int(busy) <= 100 for _, _, busy, _ in rows[:2]), section
        assert re.search(r"2 processes / 1 processes: [\d.]+x", section), section
