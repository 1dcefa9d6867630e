"""Owner tokens: who made a claim, unique to it.

Used by :mod:`celery_leases.lease` (and through it the task), which exports
:func:`make_owner`.
"""

from __future__ import annotations

import functools
import itertools
import os
import secrets
import socket

__all__ = ["make_owner"]


def make_owner() -> str:
    """A new owner token: host, pid, a random part and a count.

    Each claim gets its own token. The random part is drawn once per process
    and drawn again in a forked child (a child must never share its parent's
    tokens, or a stale child would pass the owner check); the count tells
    the claims of one process apart without a random draw each.
    """
    state = _owner_prefix.state
    if state[0] != os.getpid():  # a fork that ran no at-fork hooks
        state = _owner_prefix.reset()
    return f"{state[1]}{next(state[2])}"


class _OwnerPrefix:
    """This process's (pid, prefix, count), replaced as one tuple: a thread
    never sees a new pid with the old prefix."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> tuple[int, str, itertools.count[int]]:
        pid = os.getpid()
        self.state = (pid, f"{_hostname()}:{pid}:{secrets.token_hex(8)}-", itertools.count(1))
        return self.state


@functools.lru_cache(maxsize=1)
def _hostname() -> str:
    return socket.gethostname()


_owner_prefix = _OwnerPrefix()
os.register_at_fork(after_in_child=_owner_prefix.reset)  # the common case, before any thread
