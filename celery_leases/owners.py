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

from celery_leases.per_process import ProcessLocal

__all__ = ["make_owner"]


def make_owner() -> str:
    """A new owner token: host, pid, a random part and a count.

    Each claim gets its own token. The random part is drawn once per process
    and drawn again in a forked child (a child must never share its parent's
    tokens, or a stale child would pass the owner check); the count tells
    the claims of one process apart without a random draw each.
    """
    prefix, count = _prefix.get()
    return f"{prefix}{next(count)}"


def _new_prefix() -> tuple[str, itertools.count[int]]:
    """This process's prefix and count, made as one tuple: a thread never
    sees a new prefix with the old count."""
    return f"{_hostname()}:{os.getpid()}:{secrets.token_hex(8)}-", itertools.count(1)


@functools.lru_cache(maxsize=1)
def _hostname() -> str:
    return socket.gethostname()


_prefix: ProcessLocal[tuple[str, itertools.count[int]]] = ProcessLocal(_new_prefix)
