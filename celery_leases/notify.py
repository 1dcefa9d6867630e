"""The notifier: one daemon thread per process that runs slow reactions.

Log lines, signals, ``on_lease_lost`` hooks and task events can block (a
handler lock, a broker that accepts connections but never answers). None of
them may run on the thread that enforces lease deadlines or sends renewals,
so those threads hand them over here with :func:`notify` and go on at once.

The notifier is a :class:`~celery_leases.per_process.JobThread`: a callable
that raises is logged and the thread carries on, a forked child gets a
thread of its own, and under gevent or eventlet monkey-patching it is a
greenlet of the hub that the lease threads (OS threads) hand notices to
through an OS-level queue. A greenlet that holds the hub delays the
notices, never the deadlines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_leases.per_process import JobThread, ProcessLocal

__all__ = ["notify", "process_notifier"]

_notifier: ProcessLocal[JobThread] = ProcessLocal(lambda: JobThread("celery-leases-notifier"))


def process_notifier() -> JobThread:
    """The notifier of this process, made anew after a fork."""
    return _notifier.get()


def notify(fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Run ``fn(*args, **kwargs)`` soon on this process's notifier thread."""
    _notifier.get().submit(fn, *args, **kwargs)
