"""Real ``celery worker`` processes that the demo starts, freezes and stops.

Each worker runs in a session of its own, so its main process and its pool
child form one process group: SIGSTOP, SIGCONT and SIGKILL reach all of
them and nothing else. Only groups started here are ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from invoices.config import Config

__all__ = ["EXAMPLE_DIR", "WorkerProcess", "wait_until"]

#: the example project's folder (holds the ``invoices`` package)
EXAMPLE_DIR = Path(__file__).resolve().parents[1]

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], *, timeout: float, what: str) -> T:
    """Call ``probe`` every 50 ms until it returns something truthy; return it.

    Raises:
        TimeoutError: ``timeout`` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.05)


class WorkerProcess:
    """One ``celery -A invoices.tasks worker`` (prefork, one pool child)."""

    def __init__(self, name: str, config: Config) -> None:
        self.name = name
        self.log_path = config.data_dir / f"worker-{name}.log"
        self.argv = [
            sys.executable, "-m", "celery", "-A", "invoices.tasks", "worker",
            "--pool", "prefork", "-c", "1", "-n", f"{name}@%h", "-Q", config.queue,
            "--without-mingle", "--without-gossip", "--without-heartbeat",
            "--loglevel", "INFO", "--logfile", str(self.log_path),
        ]  # fmt: skip
        python_path = [str(EXAMPLE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {
            **os.environ,
            **config.to_env(),
            "INVOICES_WORKER": name,
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONUNBUFFERED": "1",
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.with_suffix(".out").open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=EXAMPLE_DIR,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        """Pid of the worker's main process, also its process group id."""
        assert self.proc is not None, "worker not started"
        return self.proc.pid

    def log(self) -> str:
        parts = []
        for path in (self.log_path, self.log_path.with_suffix(".out")):
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited while starting:\n{self.log()}")
            return re.search(r"\bready\.", self.log()) is not None

        wait_until(ready, timeout=timeout, what=f"worker {self.name} to start")

    def _signal(self, signum: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)

    def freeze(self) -> None:
        """SIGSTOP the worker and its pool child, as a long stall would."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: the worker goes on where it stopped."""
        self._signal(signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGCONT, SIGTERM (warm shutdown), then SIGKILL whatever is left."""
        if self.proc is None:
            return
        self._signal(signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self._signal(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
