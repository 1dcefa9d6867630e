"""The in-process tracer benchmark still runs: each kind traced, its CPU per task printed.

No timing is asserted: only that the three kinds ran their tasks through
Celery's tracer against a real redis-server and that the report reads.
"""

from __future__ import annotations

import re

import pytest

from tests.bench_runs import run_bench

pytestmark = pytest.mark.redis


def test_tracer_benchmark_reports_each_kind() -> None:
    out = run_bench("trace.py", "--rounds", "2", "--tasks", "20")
    assert "median of 2 rounds of 20" in out
    for kind in ("plain", "floor", "leased"):
        found = re.search(rf"^  {kind} +(\d+\.\d) +\((\d+\.\d)\.\.(\d+\.\d)\)$", out, re.M)
        assert found, out
        median, low, high = map(float, found.groups())
        assert 0 < low <= median <= high
    assert re.search(r"leased beyond the floor, per round: median [+-]\d", out)
