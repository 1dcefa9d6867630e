"""Real ``celery worker`` subprocesses for the acceptance tests.

Each worker runs in a session of its own (``start_new_session=True``), so the
main process and its pool children form one process group: freezing,
resuming or killing the group reaches all of them, and nothing outside it.
Only groups started here are ever signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import redis

__all__ = ["REPO_ROOT", "SideChannel", "Worker", "stop_workers", "wait_until"]

REPO_ROOT = Path(__file__).resolve().parents[2]

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.05,
    message: str = "condition",
) -> T:
    """Call ``probe`` until it returns something truthy; return that.

    Raises:
        AssertionError: ``timeout`` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        time.sleep(interval)


class Worker:
    """One ``celery -A tests.acceptance.app worker`` process group.

    Args:
        name: node name prefix (``name@host``); unique per test.
        env: ``LEASES_TEST_*`` variables for ``tests/acceptance/app.py``.
        log_dir: folder for the worker's log file.
        pool: ``prefork``, ``threads`` or ``solo``.
        concurrency: pool size.
        queue: the queue to consume.
        app: the ``-A`` argument.
        extra_args: more ``celery worker`` arguments.
    """

    def __init__(
        self,
        name: str,
        env: Mapping[str, str],
        log_dir: Path,
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        queue: str,
        app: str = "tests.acceptance.app",
        cwd: Path = REPO_ROOT,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.pool = pool
        self.log_path = log_dir / f"worker-{name}.log"
        self.out_path = log_dir / f"worker-{name}.out"
        self.hostname = f"{name}@%h"
        self.argv = [
            sys.executable, "-m", "celery",
            "-A", app,
            "worker",
            "--pool", pool,
            "-c", str(concurrency),
            "-n", self.hostname,
            "-Q", queue,
            "--without-mingle", "--without-gossip", "--without-heartbeat",
            "--loglevel", "INFO",
            "--logfile", str(self.log_path),
            *extra_args,
        ]  # fmt: skip
        python_path = [str(REPO_ROOT)]
        if os.environ.get("PYTHONPATH"):
            python_path.append(os.environ["PYTHONPATH"])
        self.env = {
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONUNBUFFERED": "1",
        }
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    # --- life cycle ---------------------------------------------------------

    def start(self, *, ready_timeout: float = 60.0) -> Worker:
        """Start the worker and wait until it logs that it is ready."""
        with self.out_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_for_log(r"\bready\.", timeout=ready_timeout)
        return self

    @property
    def pid(self) -> int:
        """Pid of the worker's main process (also its process group id)."""
        assert self.proc is not None, "worker not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, signum: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def freeze(self) -> None:
        """SIGSTOP the whole group: main process, pool children, threads."""
        self._signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT the whole group."""
        self._signal_group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole group, as a machine crash would."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def warm_shutdown(self) -> None:
        """SIGTERM to the main process only: Celery's warm shutdown."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def cold_shutdown(self) -> None:
        """SIGQUIT to the main process: Celery's cold shutdown, which first
        waits ``worker_soft_shutdown_timeout`` for running tasks, then stops
        them and gives their unacked messages back to the broker."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGQUIT)

    def wait_exit(self, timeout: float) -> int:
        """Wait for the main process to exit; return its exit code."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the worker for good: SIGCONT, SIGTERM, then SIGKILL the group.

        The group is killed at the end even after a clean exit, so no pool
        child outlives the test.
        """
        stop_workers([self], timeout)

    # --- logs -----------------------------------------------------------------

    def log(self) -> str:
        """The worker's log file and its stdout/stderr, as text."""
        parts = []
        for path in (self.log_path, self.out_path):
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def wait_for_log(self, pattern: str, *, timeout: float) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) appears in the log.

        Raises:
            AssertionError: the worker exited or ``timeout`` passed first.
        """

        def probe() -> re.Match[str] | None:
            match = re.search(pattern, self.log())
            if match is None and not self.alive():
                raise AssertionError(
                    f"worker {self.name} exited before logging {pattern!r}:\n{self.log()}"
                )
            return match

        return wait_until(probe, timeout=timeout, message=f"{pattern!r} in {self.name}'s log")

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"Worker({self.name!r}, pool={self.pool!r}, pid={pid})"


def stop_workers(workers: Iterable[Worker], timeout: float = 20.0) -> None:
    """Stop ``workers`` for good, side by side: SIGCONT and SIGTERM to each
    (their warm shutdowns run at once), up to ``timeout`` seconds for them to
    exit, then SIGKILL each group, so no pool child outlives the test."""
    started = [w for w in workers if w.proc is not None]
    for worker in started:
        worker._signal_group(signal.SIGCONT)
        worker.warm_shutdown()
    deadline = time.monotonic() + timeout
    for worker in started:
        assert worker.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for worker in started:
        assert worker.proc is not None
        worker._signal_group(signal.SIGKILL)
        if worker.proc.poll() is None:
            worker.proc.wait(timeout=30)


class SideChannel:
    """Reads what the tasks of ``tests/acceptance/app.py`` reported."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def events(self, job_id: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        """Reported events, oldest first, filtered by job and kind."""
        found = [json.loads(raw) for raw in self.client.lrange("side:events", 0, -1)]
        return [
            event
            for event in found
            if (job_id is None or event["job"] == job_id)
            and (kind is None or event["event"] == kind)
        ]

    def wait_event(self, job_id: str, kind: str, *, timeout: float, count: int = 1) -> list[Any]:
        """Wait until ``count`` events of ``kind`` for ``job_id`` arrived."""
        return wait_until(
            lambda: found if len(found := self.events(job_id, kind)) >= count else None,
            timeout=timeout,
            message=f"{count} {kind!r} event(s) of job {job_id}",
        )

    def done_count(self, job_id: str) -> int:
        """How many bodies of ``job_id`` reached their last step."""
        return int(self.client.get(f"side:done:{job_id}") or 0)

    def close(self) -> None:
        self.client.close()
