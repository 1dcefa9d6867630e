"""The live demo (``bash scripts/demo``) end to end, with real worker processes.

The demo is a check: it exits 0 only if the worked example happened. These
tests also read the timeline it reports and check it themselves, so a demo
that stops checking cannot pass.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.broker_servers import RabbitServer
from tests.servers import PostgresServer, RedisServer

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, *args: str) -> dict[str, Any]:
    """Run ``bash scripts/demo`` with this interpreter; return its JSON report."""
    report_path = tmp_path / "report.json"
    completed = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "demo"), "--json", str(report_path), *args],
        env={**os.environ, "DEMO_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert "proven:" in completed.stdout
    report: dict[str, Any] = json.loads(report_path.read_text())
    return report


def check_timeline(report: dict[str, Any]) -> None:
    """The timeline shows the worked example, step by step, in order."""
    n = report["generation"]
    assert isinstance(n, int)
    steps = [(e["worker"], e["event"], e["generation"]) for e in report["timeline"]]
    # B's generation is max(N + 1, the store's clock in ms): above N
    [m] = [g for who, event, g in steps if (who, event) == ("B", "claimed")]
    assert isinstance(m, int)
    assert m > n
    expected = [
        ("A", "claimed", n),
        ("demo", "froze A (SIGSTOP)", n),
        ("demo", "sent the charge again", None),
        ("B", "deferred", None),
        ("B", "claimed", m),
        ("B", "ledger write accepted", m),
        ("B", "receipt accepted", m),
        ("B", "completed", m),
        ("demo", "resumed A (SIGCONT)", n),
        ("A", "ledger write refused", n),
        ("A", "completion refused", n),
    ]
    positions = [steps.index(step) for step in expected]  # ValueError if one is missing
    assert positions == sorted(positions), steps
    assert not [s for s in steps if s[0] == "A" and s[1] in ("completed", "ledger write accepted")]
    assert [(e["worker"], e["generation"]) for e in report["ledger"]] == [("B", m)]
    assert report["receipt"]["generation"] == m
    assert report["result_state"] == "SUCCESS"
    assert report["result"]["worker"] == report["roles"]["B"]
    assert report["result"]["generation"] == m
    assert report["checks"]
    assert all(check["ok"] for check in report["checks"])


def test_demo_without_servers(tmp_path: Path) -> None:
    check_timeline(run_demo(tmp_path))


@pytest.mark.redis
@pytest.mark.postgres
def test_demo_on_redis_and_postgresql(
    tmp_path: Path, redis_server: RedisServer, postgres_server: PostgresServer
) -> None:
    report = run_demo(tmp_path, "--broker", redis_server.url, "--store", postgres_server.url)
    check_timeline(report)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_process_the_demo_started_also_a_frozen_one(tmp_path: Path) -> None:
    demo = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "example_project" / "run.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # as at a terminal: a suite started in the background by a shell
        # without job control inherits SIGINT ignored, and Python then
        # installs no KeyboardInterrupt for it
        preexec_fn=_default_sigint,
    )
    try:
        assert demo.stdout is not None
        groups: list[int] = []
        for line in demo.stdout:
            if line.startswith("worker process groups:"):
                groups = [int(part.split()[1]) for part in line.split(":", 1)[1].split(",")]
            if " froze holding the lease" in line:  # worker A is stopped with SIGSTOP now
                break
        assert len(groups) == 2
        demo.send_signal(signal.SIGINT)
        rest = demo.communicate(timeout=60)[0]
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, rest
    assert "stopped every process" in rest
    for group in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)


def test_demo_on_rabbitmq(tmp_path: Path, rabbit_server: RabbitServer) -> None:
    """On RabbitMQ the frozen holder keeps its message unacked; the demo's second
    send is deferred by B until A's lease runs out, as on Redis."""
    report = run_demo(tmp_path, "--broker", rabbit_server.url)
    check_timeline(report)
