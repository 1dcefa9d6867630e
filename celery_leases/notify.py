"""The notifier: one daemon thread per process that runs slow reactions.

Log lines, signals, ``on_lease_lost`` hooks and task events can block (a
handler lock, a broker that accepts connections but never answers). None of
them may run on the thread that enforces lease deadlines or sends renewals,
so those threads hand them over here with :func:`notify` and go on at once.

A callable that raises is logged and the thread carries on. The thread is
made anew after a fork, like the heartbeat.

Under gevent or eventlet monkey-patching the notifier is a greenlet of the
hub, where the worker's sockets and locks live, while the lease threads are
OS threads (:mod:`celery_leases.unpatched`): they hand notices over through
an OS-level queue that never blocks a put, and the greenlet picks them up
every :data:`GREEN_POLL` seconds. A greenlet that holds the hub delays the
notices, never the deadlines.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from _queue import Empty, SimpleQueue  # the C queue: no patching reaches it
from collections.abc import Callable
from typing import Any

from celery_leases import unpatched

__all__ = ["GREEN_POLL", "Notifier", "notify", "process_notifier"]

logger = logging.getLogger("celery_leases")

_STOP = object()

#: seconds between two looks at the queue by a notifier greenlet
GREEN_POLL = 0.05


class Notifier:
    """Runs callables in order on a daemon thread of its own."""

    def __init__(self) -> None:
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self._lock = unpatched.lock()
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()

    def submit(self, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)``; never blocks, never raises."""
        self._queue.put((fn, args, kwargs))
        self.start()

    def start(self) -> None:
        """Start the thread if it is not running.

        Under monkey-patching only the hub's own thread can start the
        greenlet: a notice from an OS thread waits in the queue until then
        (the heartbeat starts the notifier when a lease is added).
        """
        if unpatched.green_library() is not None and not unpatched.in_main_os_thread():
            return
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
        green = unpatched.green_library() is not None
        while True:
            if green:
                try:
                    item = self._queue.get_nowait()
                except Empty:
                    time.sleep(GREEN_POLL)  # the patched sleep: lets the hub run
                    continue
            else:
                item = self._queue.get()
            if item is _STOP:
                return
            fn, args, kwargs = item
            try:
                fn(*args, **kwargs)
            except Exception:
                logger.exception("a lease notification (%r) failed", fn)


_process_lock = unpatched.lock()
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
    _process_lock = unpatched.lock()
    _process_notifier = None


os.register_at_fork(after_in_child=_forget_after_fork)
