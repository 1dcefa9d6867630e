"""What happened to each job, as every process saw it.

The tasks (through ``celery_leases.signals`` and their own steps) and the
demo write events into one SQLite table shared by all processes; the row id
orders them as they were committed.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Event", "Timeline"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    worker TEXT NOT NULL,
    event TEXT NOT NULL,
    job_id TEXT NOT NULL,
    generation INTEGER,
    detail TEXT NOT NULL DEFAULT ''
)
"""


@dataclass(frozen=True)
class Event:
    """One line of the timeline."""

    at: float
    worker: str
    event: str
    job_id: str
    generation: int | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Timeline:
    """The events table in the SQLite file at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            with conn:
                conn.execute(_SCHEMA)
                yield conn
        finally:
            conn.close()

    def record(
        self,
        worker: str,
        event: str,
        job_id: str,
        generation: int | None = None,
        detail: str = "",
    ) -> None:
        """Append one event, stamped with this machine's wall clock."""
        with self._connect() as conn:
            conn.execute(
                "INSERT INTO events (at, worker, event, job_id, generation, detail)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), worker, event, job_id, generation, detail),
            )

    def events(self, job_id: str | None = None) -> list[Event]:
        """Events in the order they were recorded, of one job or all."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT at, worker, event, job_id, generation, detail FROM events"
                " WHERE ? IS NULL OR job_id = ? ORDER BY id",
                (job_id, job_id),
            ).fetchall()
        return [Event(*row) for row in rows]
