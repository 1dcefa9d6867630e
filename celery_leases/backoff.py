"""Exponential backoff: the waits between the tries of something that failed.

Used by the completion that retries an unavailable store, the publish that
retries a broker, and the deferral of a run whose store is down.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

__all__ = ["backoff_delay", "backoff_delays"]

#: the wait stops doubling after this many tries (it is capped long before)
_MAX_DOUBLINGS = 30


def backoff_delay(first: float, tries: int, *, cap: float, jitter: float = 0.0) -> float:
    """The wait after ``tries`` failed tries: ``first`` doubled each time, at most ``cap``.

    Args:
        first: the wait after the first failure (``tries`` 0).
        tries: failures before this one.
        cap: the longest wait.
        jitter: the wait is drawn from ``[w, w * (1 + jitter)]`` before the cap,
            so processes that failed together do not try again together.
    """
    wait = first * 2.0 ** min(tries, _MAX_DOUBLINGS)
    if jitter:
        wait *= random.uniform(1.0, 1.0 + jitter)
    return min(wait, cap)


def backoff_delays(first: float, *, cap: float = float("inf")) -> Iterator[float]:
    """The waits :func:`backoff_delay` gives after each failure, one per ``next()``."""
    for tries in itertools.count():
        yield backoff_delay(first, tries, cap=cap)
