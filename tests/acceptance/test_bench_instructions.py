"""The instruction-count benchmark still runs: its smoke profile counts a
leased task's worker and Redis store under cachegrind and prints the table.

No count is compared with another: only that the tasks ran in counted
processes, that each count is a number of instructions a task can take,
and that the table reads.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.acceptance.harness import REPO_ROOT
from tests.bench_runs import run_bench

pytestmark = pytest.mark.redis


@pytest.mark.bench
def test_smoke_profile_counts_worker_and_store() -> None:
    out = run_bench("instructions.py", "--quick", timeout=600)
    assert "python bench/instructions.py --quick" in out
    row = re.search(r"^\| leases-redis \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| one \|$", out, re.M)
    assert row, out
    worker, store, both = (int(cell.replace(",", "")) for cell in row.groups())
    # a Python worker's task is millions of instructions, a store's scripts
    # tens of thousands: a count of a process that did not run is neither
    assert 500_000 < worker < 50_000_000
    assert 10_000 < store < 2_000_000
    assert abs(both - worker - store) <= 1


def test_refuses_a_kind_it_cannot_count() -> None:
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "instructions.py"), "--kinds", "relier"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 2
    assert "cannot count relier" in run.stderr
