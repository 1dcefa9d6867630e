"""The nemesis: seeded, bounded faults against real processes and servers.

Each fault is chosen by a seeded :class:`random.Random`, so a run's fault
schedule is the same for the same seed (the timing of the processes is
not). Only processes started by the harness are ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.acceptance.harness import Worker
from tests.proxy import Proxy

__all__ = ["FAULTS", "Nemesis", "StoreControl", "children_of"]

FAULTS = (
    "pause-child",
    "pause-worker",
    "kill-child",
    "kill-worker",
    "duplicate",
    "partition",
    "store-restart",
)


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc``), e.g. prefork pool processes."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@dataclass
class StoreControl:
    """How the nemesis kills and restarts the store (with its data)."""

    kill: Callable[[], None]
    start: Callable[[], None]


class Nemesis:
    """Injects faults until its time or its budget runs out.

    Args:
        seed: seeds the choice of faults, targets and durations.
        ttl: the lease TTL; pauses last 1.5-3 TTLs, partitions 1-2.
        budget: the most faults of each kind (0 disables a kind).
        workers: the live workers (the list may change: killed ones are replaced).
        replace: starts a new worker in place of a killed one.
        proxy: the TCP proxy between the workers and the store.
        store: kill and restart of the store.
        duplicate: sends a duplicate of one submitted job.
    """

    def __init__(
        self,
        *,
        seed: int,
        ttl: float,
        budget: dict[str, int],
        workers: list[Worker],
        replace: Callable[[Worker], Worker],
        proxy: Proxy,
        store: StoreControl,
        duplicate: Callable[[random.Random], bool],
        log: Callable[[str], None] = print,
    ) -> None:
        self.random = random.Random(seed)
        self.ttl = ttl
        self.budget = dict(budget)
        self.workers = workers
        self.replace = replace
        self.proxy = proxy
        self.store = store
        self.duplicate = duplicate
        self.log = log
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._paused: list[tuple[float, Callable[[], None]]] = []

    def run(self, seconds: float, interval: float) -> None:
        """Inject faults for ``seconds``, one every ~``interval`` s, then heal everything."""
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end and not self._stop.is_set():
                self._resume_due()
                kinds = [k for k in FAULTS if self.budget.get(k, 0) > self.counts[k]]
                if kinds:
                    self._inject(self.random.choice(kinds))
                self._stop.wait(self.random.uniform(0.5, 1.5) * interval)
        finally:
            self.heal()

    def stop(self) -> None:
        self._stop.set()

    def heal(self) -> None:
        """Resume every pause, end the partition, make sure the store runs."""
        for _, resume in self._paused:
            resume()
        self._paused.clear()
        self.proxy.heal()

    def _resume_due(self) -> None:
        now = time.monotonic()
        due = [p for p in self._paused if p[0] <= now]
        self._paused = [p for p in self._paused if p[0] > now]
        for _, resume in due:
            resume()

    def _pause_for(self) -> float:
        return self.random.uniform(1.5, 3.0) * self.ttl

    def _live(self) -> list[Worker]:
        return [w for w in self.workers if w.alive()]

    def _inject(self, kind: str) -> None:
        done = getattr(self, "_" + kind.replace("-", "_"))()
        if done:
            self.counts[kind] += 1

    def _child(self) -> tuple[Worker, int] | None:
        candidates = [(w, c) for w in self._live() for c in children_of(w.pid)]
        return self.random.choice(candidates) if candidates else None

    def _pause_child(self) -> bool:
        found = self._child()
        if found is None:
            return False
        _, pid = found
        seconds = self._pause_for()
        self.log(f"nemesis: SIGSTOP pool process {pid} for {seconds:.1f} s")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        self._paused.append((time.monotonic() + seconds, lambda: _signal(pid, signal.SIGCONT)))
        return True

    def _pause_worker(self) -> bool:
        live = self._live()
        if not live:
            return False
        worker = self.random.choice(live)
        seconds = self._pause_for()
        self.log(f"nemesis: SIGSTOP worker {worker.name} for {seconds:.1f} s")
        worker.freeze()
        self._paused.append((time.monotonic() + seconds, worker.thaw))
        return True

    def _kill_child(self) -> bool:
        found = self._child()
        if found is None:
            return False
        self.log(f"nemesis: SIGKILL pool process {found[1]}")
        _signal(found[1], signal.SIGKILL)
        return True

    def _kill_worker(self) -> bool:
        live = self._live()
        if len(live) < 2:
            return False
        worker = self.random.choice(live)
        self.log(f"nemesis: SIGKILL worker {worker.name} (group)")
        worker.kill()
        self.workers.append(self.replace(worker))
        return True

    def _duplicate(self) -> bool:
        return self.duplicate(self.random)

    def _partition(self) -> bool:
        seconds = self.random.uniform(1.0, 2.0) * self.ttl
        cut = self.random.random() < 0.3
        self.log(f"nemesis: partition workers/store for {seconds:.1f} s (cut={cut})")
        self.proxy.blackhole()
        if cut:
            self.proxy.cut()
        self._paused.append((time.monotonic() + seconds, self.proxy.heal))
        return True

    def _store_restart(self) -> bool:
        self.log("nemesis: kill -9 the store, restart it with its data")
        self.store.kill()
        time.sleep(self.random.uniform(0.2, 1.0) * self.ttl)
        self.store.start()
        return True


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
