"""The leased bodies running in each thread, innermost first.

A run is pushed when its body starts and popped when it ends, in that
order (a nested run, such as ``replace()`` in eager mode or a direct call
of a task on the same job, ends before the run it is nested in). Each
thread's innermost run is one entry of a dictionary keyed by the thread's
(or greenlet's) identity, and each run points at the one it is nested in:
a running task costs that entry, not a per-thread object
(``threading.local`` makes a dictionary for each thread that touches it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from celery_leases.lease import Lease

__all__ = ["Run", "innermost", "pop", "push", "running"]


class Run:
    """A leased body running in this thread (nested runs share the lease)."""

    __slots__ = ("handed_over", "lease", "outer", "request", "task_name")

    def __init__(self, task_name: str, lease: Lease, request: Any) -> None:
        self.task_name = task_name
        self.lease = lease
        self.request = request
        #: the lease was given up before a retry or replace was published
        self.handed_over = False
        #: the run this one is nested in, in the same thread
        self.outer: Run | None = None


#: each thread's innermost run; ``threading.get_ident`` is read at each call,
#: so under a green pool's monkey patching the key is the greenlet
_innermost: dict[int, Run] = {}


def push(run: Run) -> None:
    """Start ``run`` in this thread, inside whatever runs here already."""
    ident = threading.get_ident()
    run.outer = _innermost.get(ident)
    _innermost[ident] = run


def pop(run: Run) -> None:
    """End ``run`` (the innermost run of this thread, or unlinked from its chain)."""
    ident = threading.get_ident()
    inner: Run | None = None
    current = _innermost.get(ident)
    while current is not None and current is not run:
        inner, current = current, current.outer
    if current is None:
        return  # not running here: nothing to end
    if inner is not None:
        inner.outer = run.outer
    elif run.outer is None:
        del _innermost[ident]
    else:
        _innermost[ident] = run.outer
    run.outer = None


def innermost() -> Iterator[Run]:
    """This thread's runs, innermost first."""
    run = _innermost.get(threading.get_ident())
    while run is not None:
        yield run
        run = run.outer


def running(request: Any) -> bool:
    """Whether a run of ``request`` is running in this thread."""
    return any(run.request is request for run in innermost())
