"""The notifier: one daemon thread per process that runs slow reactions.

Log lines, signals, ``on_lease_lost`` hooks and task events can block (a
handler lock, a broker that accepts connections but never answers). None of
them may run on the thread that enforces lease deadlines or sends renewals,
so those threads hand them over here with :func:`notify` and go on at once.

A callable that raises is logged and the thread carries on. The thread is
made anew after a fork, like the heartbeat.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Notifier", "notify", "process_notifier"]

logger = logging.getLogger("celery_leases")

_STOP = object()


class Notifier:
    """Runs callables in order on a daemon thread of its own."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()

    def submit(self, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)``; never blocks, never raises."""
        self._queue.put((fn, args, kwargs))
        thread = self._thread
        if thread is None or not thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._run, name="celery-leases-notifier", daemon=True
                    )
                    self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Run what is queued, then stop the thread and wait for it."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._queue.put(_STOP)
        if thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args, kwargs = item
            try:
                fn(*args, **kwargs)
            except Exception:
                logger.exception("a lease notification (%r) failed", fn)


_process_lock = threading.Lock()
_process_notifier: Notifier | None = None


def process_notifier() -> Notifier:
    """The notifier of this process, made anew after a fork."""
    global _process_notifier
    with _process_lock:
        if _process_notifier is None or _process_notifier.pid != os.getpid():
            _process_notifier = Notifier()
        return _process_notifier


def notify(fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Run ``fn(*args, **kwargs)`` soon on this process's notifier thread."""
    process_notifier().submit(fn, *args, **kwargs)


def _forget_after_fork() -> None:
    global _process_lock, _process_notifier
    _process_lock = threading.Lock()
    _process_notifier = None


os.register_at_fork(after_in_child=_forget_after_fork)
