"""The worker memory benchmark still runs: short runs print their figures.

No memory figure is asserted (it is a measurement): only that both workers
ran every task, that the trimmed round was counted, and that ``--trace``
names the lines of this library a lease allocates on.
"""

from __future__ import annotations

import re

import pytest

from tests.bench_runs import run_bench

pytestmark = pytest.mark.redis


def _bench(*args: str) -> str:
    return run_bench("worker_memory.py", "--tasks", "8", *args, timeout=110)


@pytest.mark.timeout(120)
def test_a_trimmed_round_prints_what_a_lease_adds_per_task() -> None:
    out = _bench("--rounds", "1", "--trim")
    assert re.search(r"round 1: plain idle \d+ KiB busy \d+ KiB", out)
    assert "left out" not in out
    assert re.search(r"median over 1 rounds: -?[\d.]+ KiB per task", out)


@pytest.mark.timeout(120)
def test_trace_names_the_lines_a_running_lease_allocates_on() -> None:
    out = _bench("--trace", "--lines", "40")
    assert re.search(r"live Python memory a lease adds per running task: -?\d+ bytes", out)
    assert "celery_leases/" in out
