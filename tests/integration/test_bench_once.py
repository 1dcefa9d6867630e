"""The exactly-once benchmark still runs: a short run on SQLite prints its ratio.

No timing is asserted: only that both kinds ran and wrote one row per job.
"""

from __future__ import annotations

import re

from tests.bench_runs import run_bench


def test_a_short_run_prints_the_ratio_and_one_row_per_job() -> None:
    out = run_bench("once.py", "--stores", "sqlite", "--tasks", "10", "--rounds", "1")
    assert re.search(r"sqlite: separate +[\d.]+/s +once +[\d.]+/s +ratio [\d.]+", out)
    assert "most rows per job 1" in out
