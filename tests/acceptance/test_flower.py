"""Lease fields in a real Flower, fed by real workers started with plain ``-E``.

Flower runs as ``celery flower --conf=<file>`` where the file imports
``celery_leases.flower``, as docs/flower.md tells users to. A headless
Chromium renders the task page.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_leases import LeaseState
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import REPO_ROOT, wait_until
from tests.browser import chromium
from tests.servers import free_port

TTL = 2.0
#: set to a path to keep the task page's screenshot there (docs/flower-task.png)
SCREENSHOT_ENV = "LEASES_FLOWER_SCREENSHOT"


class Flower:
    """A ``celery flower`` process on the cluster's broker."""

    def __init__(self, cluster: Cluster, tmp_path: Path) -> None:
        self.port = free_port()
        conf = tmp_path / "flowerconfig.py"
        conf.write_text("import celery_leases.flower  # noqa: F401\n")
        self.log_path = tmp_path / "flower.log"
        env = {
            **os.environ,
            **cluster.config.to_env(),
            "PYTHONPATH": str(REPO_ROOT),
            "FLOWER_UNAUTHENTICATED_API": "true",
        }
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "tests.acceptance.app",
                    "flower",
                    "--address=127.0.0.1",
                    f"--port={self.port}",
                    f"--conf={conf}",
                ],
                cwd=REPO_ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_until(self._healthy, timeout=60, message="Flower to answer")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"Flower exited: {self.log_path.read_text()}"
        try:
            return self.get("/healthcheck") == "OK"
        except OSError:
            return False

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:  # noqa: S310
            body: bytes = response.read()
        return body.decode()

    def task_info(self, task_id: str) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = json.loads(self.get(f"/api/task/info/{task_id}"))
        except urllib.error.HTTPError:
            return None  # 404 until its first event arrives
        return info

    def wait_task(self, task_id: str, *, timeout: float, **expected: Any) -> dict[str, Any]:
        """Wait until the task's info has every field in ``expected``."""

        def probe() -> dict[str, Any] | None:
            info = self.task_info(task_id)
            if info and all(info.get(key) == value for key, value in expected.items()):
                return info
            return None

        return wait_until(probe, timeout=timeout, interval=0.2, message=f"task info {expected}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)


@pytest.fixture
def flower(cluster: Cluster, tmp_path: Path) -> Iterator[Flower]:
    started = Flower(cluster, tmp_path)
    try:
        yield started
    finally:
        started.stop()
        # the test's AsyncResults sit in reference cycles and talk to the result
        # backend when collected: collect them while the servers are up
        gc.collect()


def test_task_page_shows_the_lease_of_a_normal_run(
    cluster: Cluster, flower: Flower, tmp_path: Path
) -> None:
    cluster.configure(ttl=TTL)
    worker = cluster.worker("a", extra_args=("-E",))
    result = cluster.send(STEPS, 2.0)
    value = result.get(timeout=30)
    generation = value["generation"]

    info = flower.wait_task(result.id, timeout=30, state="SUCCESS", lease_ran_on=value["worker"])
    assert info["lease_job_id"] == result.id
    assert info["lease_generation"] == generation
    assert info["lease_owner"].startswith(f"{os.uname().nodename}:")
    # written as Flower writes its own times
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6} UTC", info["lease_until"])
    assert info["lease_renewals"] >= 1  # a 2 s body with renewals every 2/3 s
    assert info["lease_takeovers"] == 0
    assert info["lease_fate"] == f"completed by generation {generation}"
    assert info["worker"] == value["worker"]
    (attempt,) = info["lease_attempts"]
    assert attempt["generation"] == generation
    assert attempt["worker"] == value["worker"]
    assert attempt["outcome"] == "completed"
    assert worker.alive()

    page = f"{flower.url}/task/{result.id}"
    dom = chromium(page, tmp_path, "--dump-dom")
    assert "Lease generation" in dom
    assert f"completed by generation {generation}" in dom
    assert f"generation {generation} on {value['worker']}: completed" in dom  # attempts
    assert info["lease_until"] in dom
    screenshot = tmp_path / "flower-task.png"
    chromium(page, tmp_path, f"--screenshot={screenshot}", "--window-size=1200,1900")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get(SCREENSHOT_ENV):
        shutil.copyfile(screenshot, os.environ[SCREENSHOT_ENV])


def test_task_page_keeps_started_while_the_lease_is_held(cluster: Cluster, flower: Flower) -> None:
    cluster.configure(ttl=TTL)
    cluster.worker("a", extra_args=("-E",))
    result = cluster.send(STEPS, 4.0)

    # renewals arrive while the body runs; the state stays STARTED
    info = flower.wait_task(result.id, timeout=30, state="STARTED", lease_fate="held")
    wait_until(
        lambda: (flower.task_info(result.id) or {}).get("lease_renewals", 0) >= 2,
        timeout=10,
        message="two renewals",
    )
    info = flower.task_info(result.id)
    assert info is not None
    assert info["state"] == "STARTED"
    assert "Terminate" in flower.get(f"/task/{result.id}")
    result.get(timeout=30)
    flower.wait_task(result.id, timeout=30, state="SUCCESS")


def test_task_that_moved_between_workers_shows_each_attempt(
    cluster: Cluster, flower: Flower
) -> None:
    """A holds the job, B defers the duplicate, A is killed, B takes over."""
    cluster.configure(ttl=TTL)
    workers = [cluster.worker("a", extra_args=("-E",)), cluster.worker("b", extra_args=("-E",))]
    result = cluster.send(STEPS, 4.0)
    (started_a,) = cluster.side.wait_event(result.id, "start", timeout=30)
    generation_a = started_a["generation"]
    worker_a, worker_b = sorted(
        workers, key=lambda w: not started_a["worker"].startswith(f"{w.name}@")
    )
    cluster.send(STEPS, 4.0, task_id=result.id)
    info = wait_until(
        lambda: (
            any(
                entry["outcome"] == "deferred"
                for entry in (flower.task_info(result.id) or {}).get("lease_attempts") or []
            )
            and flower.task_info(result.id)
        ),
        timeout=20,
        message="the duplicate to be deferred",
    )
    assert info["state"] == "STARTED"
    worker_a.kill()

    generation_b = _completed_generation(cluster, result.id, generation_a)
    info = flower.wait_task(result.id, timeout=60, state="SUCCESS", lease_generation=generation_b)
    info = flower.wait_task(result.id, timeout=10, lease_fate=info["lease_fate"])
    claims = [e for e in info["lease_attempts"] if e.get("generation") is not None]
    assert [(e["generation"], e["worker"]) for e in claims] == [
        (generation_a, started_a["worker"]),
        (generation_b, info["lease_ran_on"]),
    ]
    assert info["lease_ran_on"].startswith(f"{worker_b.name}@")
    assert claims[1]["outcome"] == "completed"
    assert claims[1]["takeovers"] == 1
    assert info["lease_takeovers"] == 1
    assert info["lease_fate"].startswith(f"completed by generation {generation_b}")
    deferred = [e for e in info["lease_attempts"] if e["outcome"] == "deferred"]
    assert deferred
    assert deferred[0]["reason"] == "held"
    # in the order they happened: A's claim, the copy deferred while A held
    # the job, B's takeover
    attempts = info["lease_attempts"]
    first_deferred = next(i for i, e in enumerate(attempts) if e["outcome"] == "deferred")
    claimed_at = [e.get("generation") for e in attempts]
    assert claimed_at.index(generation_a) < first_deferred < claimed_at.index(generation_b)
    assert info["worker"] == info["lease_ran_on"]


def _completed_generation(cluster: Cluster, job_id: str, generation_a: int) -> int:
    """The generation that completed the job: the claim after A's, max(A + 1, clock)."""
    record = cluster.wait_record(
        job_id, state=LeaseState.COMPLETED, timeout=60, message="B's completion"
    )
    assert record.claimed_at_ms is not None
    assert record.generation == max(generation_a + 1, record.claimed_at_ms)
    return record.generation


def test_a_stale_run_that_wakes_up_late_shows_as_fenced_out(
    cluster: Cluster, flower: Flower
) -> None:
    """The worked example: A is paused past its lease, B takes over and
    completes, then A wakes up; Flower keeps SUCCESS and B as the worker."""
    cluster.configure(ttl=TTL)
    workers = [cluster.worker("a", extra_args=("-E",)), cluster.worker("b", extra_args=("-E",))]
    result = cluster.send(STEPS, 4.0)
    (started_a,) = cluster.side.wait_event(result.id, "start", timeout=30)
    generation_a = started_a["generation"]
    worker_a, worker_b = sorted(
        workers, key=lambda w: not started_a["worker"].startswith(f"{w.name}@")
    )
    worker_a.freeze()
    try:
        cluster.send(STEPS, 4.0, task_id=result.id)
        generation_b = _completed_generation(cluster, result.id, generation_a)
        flower.wait_task(result.id, timeout=60, state="SUCCESS", lease_generation=generation_b)
    finally:
        worker_a.thaw()

    def fenced_out() -> dict[str, Any] | None:
        info = flower.task_info(result.id) or {}
        first = (info.get("lease_attempts") or [{}])[0]
        return info if first.get("outcome") == "fenced-out" else None

    info = wait_until(fenced_out, timeout=30, message="A's run to be fenced out")
    stale = info["lease_attempts"][0]
    assert (stale["generation"], stale["worker"]) == (generation_a, started_a["worker"])
    assert stale["reason"] == "deadline"
    assert info["state"] == "SUCCESS"
    assert info["lease_ran_on"].startswith(f"{worker_b.name}@")
    assert info["worker"] == info["lease_ran_on"]
    assert info["lease_fate"].startswith(f"completed by generation {generation_b}")
