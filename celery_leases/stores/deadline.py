"""A deadline for the store calls of one thread, on ``time.monotonic()``.

A caller that must hear back before some moment (the heartbeat before a
lease's local deadline) wraps its store calls in :func:`bounded`; a store
that can bound its waits reads :func:`time_left` and never waits past it::

    with bounded(lease.remaining()):
        store.renew_many(requests)   # each wait for the store ends in time

Deadlines nest: an inner one can only shorten an outer one. The deadline
lives in a context variable, so it belongs to one thread (or one task of an
event loop) and never leaks into another.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["REPLY_MARGIN", "bounded", "reply_limit", "store_waits", "time_left"]

#: seconds a SQL client waits for a reply beyond the server's own limits
#: (statement and lock timeouts): on a live connection the server's error
#: comes first and the connection stays usable
REPLY_MARGIN = 0.5

_deadline: ContextVar[float | None] = ContextVar("celery_leases_store_deadline", default=None)


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Let the store calls inside wait at most ``seconds`` from now, in all."""
    deadline = time.monotonic() + max(0.0, seconds)
    outer = _deadline.get()
    token = _deadline.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _deadline.reset(token)


def time_left() -> float | None:
    """Seconds until the deadline of the enclosing :func:`bounded` (at
    least 0), or ``None`` outside one."""
    deadline = _deadline.get()
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())


#: the longest wait for one reply inside a store call (seconds), or None
#: outside the store's calls
_wait_limit: ContextVar[float | None] = ContextVar("celery_leases_sql_wait", default=None)


@contextlib.contextmanager
def store_waits(timeout: float) -> Iterator[None]:
    """Inside: each wait for a SQL reply ends after ``timeout`` plus
    :data:`REPLY_MARGIN` seconds, or at the deadline of an enclosing
    :func:`bounded` if that comes first."""
    token = _wait_limit.set(timeout + REPLY_MARGIN)
    try:
        yield
    finally:
        _wait_limit.reset(token)


def reply_limit() -> float | None:
    """How long the wait for the next reply may last now, or None (no limit)."""
    limit = _wait_limit.get()
    if limit is None:
        return None
    left = time_left()
    return limit if left is None else min(limit, left)
