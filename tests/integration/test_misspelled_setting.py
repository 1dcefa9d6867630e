"""A real ``celery worker`` and ``celery leases check`` name a misspelled setting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

APP = """
from celery import Celery
from celery_leases import LeasedTask

app = Celery("spelled", broker="memory://")
app.conf.leases_store = "memory://"
app.conf.leases_tll = 5


@app.task(base=LeasedTask, lease_on_los="raise")
def job():
    return 1
"""

SETTING_HINT = (
    "'leases_tll' is not a celery-leases setting and is ignored; did you mean 'leases_ttl'?"
)
ATTRIBUTE_HINT = "sets 'lease_on_los', which is not a LeasedTask attribute"


def _env(folder: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{folder}"}


def test_a_worker_warns_at_start_about_a_misspelled_setting(tmp_path: Path) -> None:
    (tmp_path / "spelled.py").write_text(APP)
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "spelled", "worker", "-P", "solo", "-l", "info"],
            cwd=tmp_path, env=_env(tmp_path), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while "ready." not in log.read_text() and worker.poll() is None:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
    text = log.read_text()
    assert SETTING_HINT in text
    assert ATTRIBUTE_HINT in text
    assert "did you mean 'lease_on_lost'?" in text


def test_check_warns_about_a_misspelled_setting(tmp_path: Path) -> None:
    (tmp_path / "spelled.py").write_text(APP)
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "spelled", "leases", "check"],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        SETTING_HINT in done.stdout.replace("\n", " ") or "did you mean 'leases_ttl'" in done.stdout
    )
    assert "WARNING" in done.stdout
