"""A wall clock that a test sets, for store servers started under it.

``tests/store_clock.c``, preloaded into a process (``LD_PRELOAD``), makes
its realtime clock (``clock_gettime(CLOCK_REALTIME)``, ``gettimeofday``,
``time``) read a millisecond count from a file and stand still until the
test writes another; monotonic clocks stay real, so the server's own timers
and timeouts still run. A redis-server, a PostgreSQL cluster or a Python
process with SQLite started under it reads exactly the time the test set,
so a test can put the store at any millisecond it likes.

libfaketime does not do here: preloaded into redis-server, whose jemalloc
asks for the time while it starts, it recurses and the server hangs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any

from celery_leases.errors import LeaseLost
from celery_leases.fencing.sql_transaction import fenced_transaction
from celery_leases.stores.sql import SqlStore
from tests.servers import ServerMissing

__all__ = ["SqliteUnderClock", "StoreClock", "sqlite_store_under"]

_SOURCE = Path(__file__).with_name("store_clock.c")
_built: Path | None = None


def _library() -> Path:
    """The preload library, built once per test session."""
    global _built
    if _built is None:
        compiler = shutil.which("cc")
        if compiler is None:
            raise ServerMissing("a C compiler (cc) builds the test clock (apt-get install gcc)")
        folder = Path(tempfile.mkdtemp(prefix="leases-clock-lib-"))
        folder.chmod(0o755)  # servers run as another user when the tests run as root
        library = folder / "store_clock.so"
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(library),
             str(_SOURCE)],
            check=True, capture_output=True,
        )  # fmt: skip
        _built = library
    return _built


class StoreClock:
    """The clock of the processes started with :meth:`env` in their environment.

    It starts at the real time, rounded down to a whole second, and moves
    only when :attr:`now_ms` is set.
    """

    def __init__(self) -> None:
        self.library = _library()
        self.dir = Path(tempfile.mkdtemp(prefix="leases-clock-"))
        self.dir.chmod(0o755)
        self.path = self.dir / "now_ms"
        self._now_ms = time.time_ns() // 1_000_000_000 * 1000
        self.path.write_bytes(struct.pack("<q", self._now_ms))
        self.path.chmod(0o644)
        self._fd = os.open(self.path, os.O_WRONLY)

    def env(self) -> dict[str, str]:
        """What a process's environment needs to run on this clock."""
        return {"LD_PRELOAD": str(self.library), "STORE_CLOCK_FILE": str(self.path)}

    @property
    def now_ms(self) -> int:
        return self._now_ms

    @now_ms.setter
    def now_ms(self, value: int) -> None:
        # one aligned 8-byte write: a reader sees the old or the new time
        os.pwrite(self._fd, struct.pack("<q", value), 0)
        self._now_ms = value

    def close(self) -> None:
        os.close(self._fd)
        shutil.rmtree(self.dir, ignore_errors=True)


class SqliteUnderClock(SqlStore):
    """A SQLite store in a process of its own, whose clock a test sets.

    SQLite reads the time in the process that runs the statement, so the
    store lives in a child process started on a :class:`StoreClock`; the
    test calls it through a proxy (every result comes back pickled).
    """

    def fenced_write(self, job_id: str, owner: str, generation: int) -> str:
        """``"written"`` when a fenced transaction of this holder may commit
        now, else the reason of its ``LeaseLost``."""
        token = _Holder(job_id, owner, generation)
        try:
            with fenced_transaction(self, token):
                return "written"
        except LeaseLost as lost:
            return str(lost.reason)


class _Holder:
    """A holder's token: what a fenced transaction reads of a lease."""

    def __init__(self, job_id: str, owner: str, generation: int) -> None:
        self.job_id, self.owner, self.generation = job_id, owner, generation


class _Manager(BaseManager):
    pass


_Manager.register("SqliteUnderClock", SqliteUnderClock.from_url)


@contextlib.contextmanager
def sqlite_store_under(clock: StoreClock, url: str, **options: Any) -> Iterator[Any]:
    """A proxy of a :class:`SqliteUnderClock` on ``url`` that runs on ``clock``."""
    manager = _Manager(ctx=multiprocessing.get_context("spawn"))
    # the child is spawned with this process's environment, at start only
    saved = {name: os.environ.get(name) for name in clock.env()}
    os.environ.update(clock.env())
    try:
        manager.start()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    try:
        yield manager.SqliteUnderClock(url, **options)  # type: ignore[attr-defined]
    finally:
        manager.shutdown()
