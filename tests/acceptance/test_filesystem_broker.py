"""The embedded broker (``celery_leases.filesystem``) keeps every job whose
worker dies: real ``celery worker`` processes on one broker folder.

A worker takes a message by moving its file into its own in-flight folder,
which it keeps locked while it lives; a worker killed with SIGKILL loses the
lock, and the next worker on the folder puts its messages back.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_leases import LeaseState
from celery_leases.filesystem import IN_FLIGHT_FOLDER
from tests.acceptance.app import SLOW_ONCE
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import Worker, wait_until


@pytest.fixture
def broker_folder(cluster: Cluster, tmp_path: Path) -> Path:
    """The test's broker: the filesystem transport on a folder of its own."""
    folder = tmp_path / "broker"
    cluster.configure(broker=f"filesystem://{folder}")
    return folder


def _held_files(folder: Path) -> list[Path]:
    """The message files in the workers' in-flight folders."""
    return sorted((folder / "messages" / IN_FLIGHT_FOLDER).glob("*/*.msg"))


def _queued_files(folder: Path) -> list[Path]:
    return sorted((folder / "messages").glob("*.msg"))


def _running_on_a(
    cluster: Cluster, folder: Path, seconds: float, *extra_args: str
) -> tuple[Worker, AsyncResult, dict[str, Any], list[Path]]:
    """Worker A (with ``extra_args``), running a job whose first run takes
    ``seconds``: A, the job's result, its start event and the message files
    held in flight."""
    worker_a = cluster.worker("a", extra_args=extra_args)
    result = cluster.send(SLOW_ONCE, seconds)
    (started,) = cluster.side.wait_event(result.id, "start", timeout=60)
    assert started["run"] == 1
    assert started["worker"].startswith(f"{worker_a.name}@")
    return worker_a, result, started, _held_files(folder)


def test_a_killed_worker_s_job_runs_on_a_fresh_worker(
    cluster: Cluster, broker_folder: Path
) -> None:
    # A takes the job and is killed (SIGKILL, the whole group) in its body;
    # B, started afterwards on the same folder, gets the message back, takes
    # the lease over once A's has run out, and runs the job to SUCCESS
    worker_a, result, started, held = _running_on_a(cluster, broker_folder, 600.0)
    worker_a.kill()
    killed = time.monotonic()
    record = cluster.record(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.HELD, started["generation"])

    cluster.worker("b")
    outcome = result.get(timeout=120)
    took = time.monotonic() - killed
    assert result.status == "SUCCESS"
    assert outcome["run"] == 2
    assert outcome["generation"] > started["generation"]
    assert cluster.side.done_count(result.id) == 1
    print(f"killed worker's job completed by a fresh worker {took:.1f} s after the kill")
    # A's in-flight folder is gone; nothing is left waiting or held
    assert len(held) == 1
    assert not held[0].parent.exists()
    wait_until(
        lambda: not _held_files(broker_folder) and not _queued_files(broker_folder),
        timeout=30,
        message="every message acknowledged",
    )


def test_a_living_worker_s_running_job_is_not_taken_by_another(
    cluster: Cluster, broker_folder: Path
) -> None:
    # A runs a job for a while; B, alive on the same folder and sweeping it,
    # runs a later job and never takes A's: the job runs once, on A
    _, first, started, [held] = _running_on_a(cluster, broker_folder, 8.0)
    worker_b = cluster.worker("b")
    second = cluster.send(SLOW_ONCE, 0.0)
    assert second.get(timeout=60)["run"] == 1
    (second_started,) = cluster.side.events(second.id, "start")
    assert second_started["worker"].startswith(f"{worker_b.name}@")
    assert held.exists()  # still in A's in-flight folder
    outcome = first.get(timeout=120)
    assert outcome == {"run": 1, "generation": started["generation"]}
    assert cluster.side.events(first.id, "start") == [started]


def test_a_worker_that_shuts_down_gives_back_what_it_did_not_finish(
    cluster: Cluster, broker_folder: Path
) -> None:
    # A runs one job and holds a second one prefetched; a cold shutdown
    # stops the run: both message files go back into the queue under their
    # own names (no copies), and B runs both jobs to SUCCESS
    worker_a, first, _, _ = _running_on_a(
        cluster, broker_folder, 600.0, "--prefetch-multiplier", "2"
    )
    second = cluster.send(SLOW_ONCE, 0.0)
    held = wait_until(
        lambda: [f.name for f in _held_files(broker_folder)][1:] and _held_files(broker_folder),
        timeout=60,
        message="A to take the second job too",
    )
    worker_a.cold_shutdown()
    assert worker_a.wait_exit(timeout=60) == 0
    assert sorted(f.name for f in _queued_files(broker_folder)) == sorted(f.name for f in held)
    assert _held_files(broker_folder) == []
    cluster.worker("b")
    assert first.get(timeout=120)["run"] == 2
    assert second.get(timeout=60)["run"] == 1
