"""The history log: one append-only JSON-lines file per process.

Every line is written with a single ``os.write`` on a file opened with
``O_APPEND``, so a line is whole or absent even when the process is killed
right after, and lines of one process keep their order. Under gevent or
eventlet the heartbeat records from OS threads: the lock is an OS lock
(:func:`celery_leases.unpatched.lock`), held only while one line is made
and written, and ``os.write`` is left alone by monkey-patching. Records carry
``mono``, the system-wide ``CLOCK_MONOTONIC`` of the host (the same for
every process on one machine, and left alone by libfaketime with
``DONT_FAKE_MONOTONIC=1``), which orders records of different processes.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from celery_leases import unpatched

__all__ = ["History", "read_history"]


class History:
    """Appends records to ``<folder>/history-<pid>.jsonl`` (the pid at write time)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._fd: int | None = None
        self._pid = 0
        # an OS lock: under gevent or eventlet the heartbeat records from OS
        # threads, and a record never switches while holding it
        self._lock = unpatched.lock()
        self._ids = itertools.count(1)

    def _file(self) -> int:
        pid = os.getpid()
        if self._fd is None or self._pid != pid:  # a forked child writes its own file
            path = self.folder / f"history-{pid}.jsonl"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._pid = pid
            self._ids = itertools.count(1)
        return self._fd

    def record(self, kind: str, **fields: Any) -> str:
        """Append one record; return its id (``<pid>-<n>``), unique on this host."""
        with self._lock:
            fd = self._file()
            record_id = f"{self._pid}-{next(self._ids)}"
            line = json.dumps(
                {
                    "kind": kind,
                    "id": record_id,
                    "pid": self._pid,
                    "mono": time.monotonic(),
                    **fields,
                },
                default=str,
            )
            os.write(fd, line.encode() + b"\n")
        return record_id


def read_history(folder: str | Path) -> list[dict[str, Any]]:
    """Every record of every process, ordered by ``mono``; a torn last line is skipped."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(folder).glob("history-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    records.sort(key=lambda r: float(r["mono"]))
    return records
