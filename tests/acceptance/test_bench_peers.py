"""The peers benchmark still runs: its smoke profile on real workers writes the table and the plot.

No timing is asserted: only that every kind ran, that the table reads, that
the store round trips counted are the ones each kind makes, and that the
target it can judge is judged on the table's figures.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.bench_runs import run_bench

pytestmark = pytest.mark.redis


def _row(table: str, kind: str) -> list[str]:
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 9 and cells[1] == kind:
            return cells
    raise AssertionError(f"no row for {kind} in:\n{table}")


def test_smoke_profile_writes_table_and_plot(tmp_path: Path) -> None:
    run_bench("peers.py", "--quick", "--out", str(tmp_path))

    table = (tmp_path / "peers.md").read_text()
    assert "python bench/peers.py --quick" in table
    assert re.search(r"load average \d+\.\d", table)
    for kind in ("plain", "leases-redis", "floor"):
        workload, _, pool, ratio, _, cpu, _, _, redis_cpu = _row(table, kind)
        assert (workload, pool) == ("trivial", "solo")
        assert float(ratio) > 0
        assert float(cpu) >= 0
        assert float(redis_cpu) >= 0
    assert float(_row(table, "plain")[3]) == 1.0
    # claim and complete: two round trips per floor task; a leased task's
    # end also takes the job's waiters (wake.py): three
    assert 2.0 <= float(_row(table, "floor")[6]) < 3.0
    assert 3.0 <= float(_row(table, "leases-redis")[6]) < 4.0
    assert float(_row(table, "plain")[6]) < 1.0

    # the verdict on the target this profile can judge reads the table's figures
    verdict = re.search(
        r"^\| trivial, leases-redis >= floor - 0\.02 \| (\S+) / (\S+), paired \d\.\d\d: "
        r"(met|\*\*MISS\*\* \(\d\.\d\d short\)) \|$",
        table,
        re.MULTILINE,
    )
    assert verdict, table
    assert verdict[1] == _row(table, "leases-redis")[3]
    assert verdict[2] == _row(table, "floor")[3]

    assert (tmp_path / "peers.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
