"""How long the SQL store's calls wait for a pooled connection.

SQLAlchemy's ``QueuePool`` keeps ``pool_size`` connections (5 unless told)
and opens up to ``max_overflow`` more (10); a checkout that finds them all
in use waits up to ``pool_timeout`` for one, whatever the caller's
deadline. On an engine the store opened from a URL, each store call first
takes a slot of :class:`Checkouts`, as many as that pool holds, waiting at
most until the caller's deadline (:func:`~celery_leases.stores.deadline.time_left`)
or the store's ``timeout``, whichever is sooner; the pool then has a
connection for it. Other users of ``store.engine`` (a fenced transaction,
your own queries) take no slot: while they hold connections a store call
may still wait in the pool, for its ``pool_timeout``, which the store sets
to its ``timeout`` unless given.

A worker that runs many tasks in one process (threads, gevent, eventlet)
gets a pool as wide as its tasks: :mod:`celery_leases.pool_sizing`, which
reads the numbers here.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from celery_leases.stores.deadline import time_left

__all__ = ["MAX_OVERFLOW", "POOL_SIZE", "Checkouts", "pool_capacity"]

#: SQLAlchemy's ``pool_size`` and ``max_overflow`` when none is given
POOL_SIZE = 5
MAX_OVERFLOW = 10


def pool_capacity(options: Mapping[str, Any]) -> int | None:
    """The most connections a ``QueuePool`` made with ``create_engine``
    ``options`` holds at once, or None when it has no limit (``max_overflow``
    below 0, ``pool_size`` 0) or ``options`` choose another pool."""
    if "poolclass" in options or "pool" in options or "creator" in options:
        return None
    size, overflow = options.get("pool_size", POOL_SIZE), options.get("max_overflow", MAX_OVERFLOW)
    if not (isinstance(size, int) and isinstance(overflow, int)) or size <= 0 or overflow < 0:
        return None
    return size + overflow


#: gates of open stores; a forked child starts with every slot free
_GATES: weakref.WeakSet[Checkouts] = weakref.WeakSet()


class Checkouts:
    """``width`` slots, one per connection of the store's pool; a store call holds one.

    Args:
        width: the pool's capacity (:func:`pool_capacity`).
        timeout: the store's ``timeout``: the longest wait for a slot
            without a sooner deadline.
    """

    def __init__(self, width: int, timeout: float) -> None:
        self.width = width
        self.timeout = timeout
        self._free = threading.BoundedSemaphore(width)
        _GATES.add(self)

    def _after_fork(self) -> None:
        # the parent's threads that held slots do not exist in the child
        self._free = threading.BoundedSemaphore(self.width)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a slot for the call inside.

        Raises:
            sqlalchemy.exc.TimeoutError: none came free in time.
        """
        left = time_left()
        wait = self.timeout if left is None else min(self.timeout, left)
        free = self._free
        if not free.acquire(timeout=wait):
            from sqlalchemy import exc

            raise exc.TimeoutError(
                f"all {self.width} connections of the pool were in use for {wait:.3g} s "
                "(the pool is sized by pool_size and max_overflow)"
            )
        try:
            yield
        finally:
            free.release()


def _free_after_fork() -> None:
    for gate in list(_GATES):
        gate._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_after_fork)
