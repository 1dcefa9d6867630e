"""Running a benchmark script of ``bench/`` as a user would, for the smoke tests."""

from __future__ import annotations

import subprocess
import sys

from tests.acceptance.harness import REPO_ROOT


def run_bench(script: str, *args: str, timeout: float = 100) -> str:
    """Run ``bench/<script>`` with ``args`` from the repository root; its output.

    Fails the test when the script exits with an error.
    """
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / script), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout
