"""The waiting-copy benchmark still runs: one held job, one waiting copy, one row.

No timing is asserted: only that the copy waited for the holder on real
workers and a real Redis store, and that the report reads.
"""

from __future__ import annotations

import re

import pytest

from tests.bench_runs import run_bench

pytestmark = pytest.mark.redis


def test_waiting_benchmark_reports_the_copys_messages_and_start() -> None:
    out = run_bench("waiting.py", "--holder", "3", "--ttl", "3", timeout=180)
    assert "holder 3 s, TTL 3 s, one waiting copy" in out
    row = re.search(r"^\| redis \| (\d+) \| (\d+\.\d) s \| (\d+) \| (-?\d+\.\d\d) s \|$", out, re.M)
    assert row, out
    republished, waited, _, gap = (float(value) for value in row.groups())
    assert republished >= 1  # it waited: published again at least once
    assert waited > 0
    assert gap >= 0  # it started after the holder's end
