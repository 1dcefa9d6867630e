"""When a deferred duplicate looks at a held job again.

A copy of a job whose lease another run holds is published again with a
countdown. Waiting for the whole remaining lease made the copy start up to
one TTL after the holder finished (a holder renews its lease, so the
remaining time stays near the TTL while it runs). Instead the copy comes
back every :data:`POLL_INTERVAL` seconds, or when the lease would run out
if that is sooner::

    holder   |== runs ==========|end
    copy      d  c  c  c  c  c  c claims   (d: deferred, c: claim refused)
                                 <= 1 s after the holder's end

Each look is one claim, one store call: at most one per copy per second,
and the copy starts at most one interval after the holder completes or
releases its lease (plus the broker's delivery of the countdown message).
"""

from __future__ import annotations

import random

__all__ = ["MIN_COUNTDOWN", "POLL_INTERVAL", "held_countdown"]

#: seconds between two looks of a waiting copy at a held job: the longest
#: it waits after the holder's end, and the shortest gap between its claims
POLL_INTERVAL = 1.0

#: the shortest countdown, in seconds, for a lease about to run out
MIN_COUNTDOWN = 0.05


def held_countdown(remaining: float, defer_max: float) -> float:
    """Seconds until a copy of a held job tries to claim it again.

    Args:
        remaining: seconds the holder's lease has left, by the store's clock.
        defer_max: the cap on any deferral (``leases_defer_max``).

    Returns:
        :data:`POLL_INTERVAL`, or the remaining lease plus a little (the
        claim then finds it run out) if that is sooner; never above
        ``defer_max`` nor below :data:`MIN_COUNTDOWN`.
    """
    until_run_out = max(remaining, 0.0) + random.uniform(0.02, 0.1)
    return max(min(until_run_out, POLL_INTERVAL, defer_max), MIN_COUNTDOWN)
