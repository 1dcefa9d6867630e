"""The tutorial as a reader follows it: its tests pass, and a real worker
charges an order sent by ``send.py``, with no server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.acceptance.harness import Worker

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "examples" / "tutorial"


def test_the_tutorials_own_tests_pass(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TUTORIAL)],
        env={**os.environ, "SHOP_DATA": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "2 passed" in completed.stdout


def test_a_worker_charges_what_send_py_sends(tmp_path: Path) -> None:
    env = {"SHOP_DATA": str(tmp_path), "PYTHONPATH": str(TUTORIAL)}
    worker = Worker("shop", env, tmp_path, app="shop", cwd=TUTORIAL, queue="celery", pool="solo")
    worker.start()
    try:
        completed = subprocess.run(
            [sys.executable, "send.py"],
            cwd=TUTORIAL,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        worker.stop()
    assert completed.returncode == 0, completed.stderr + worker.log()
    assert "order 1 charged with generation" in completed.stdout
