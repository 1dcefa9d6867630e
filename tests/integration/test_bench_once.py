"""The exactly-once benchmark still runs: a short run on SQLite prints its ratio.

No timing is asserted: only that both kinds ran and wrote one row per job.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_prints_the_ratio_and_one_row_per_job() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "once.py"), "--stores", "sqlite", "--tasks", "10",
         "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.search(r"sqlite: separate +[\d.]+/s +once +[\d.]+/s +ratio [\d.]+", run.stdout)
    assert "most rows per job 1" in run.stdout
