"""When a deferred duplicate looks at a held job again.

A copy of a job whose lease another run holds registers as a waiter of
the job (:mod:`celery_leases.wake`): the holder's worker publishes it
again when the run ends. Its one fallback copy comes back when the
holder's lease would run out (:func:`fallback_countdown`), and takes the
job over if the holder died; while the holder lives and renews, it finds
the job held again and waits once more, about once per TTL::

    holder   |== runs (renews) ===============|end  (takes the waiters)
    copy      r                                  w claims    (<= ~1 s after the end)
    fallback   `-- about a TTL -------- f r  ... answered as a duplicate of w
               r: registered as a waiter   w: woken copy   f: fallback finds it held

    holder   |== runs ====X (SIGKILL)
    copy      r             .... lease runs out  f claims  (a takeover)

A copy that cannot register (the store unreachable at that moment, a
message too large for a waiter, a job with too many waiters) looks again
every :data:`POLL_INTERVAL` seconds instead (:func:`held_countdown`): one
claim and one re-published message per copy per second, and it starts at
most one interval after the holder ends.
"""

from __future__ import annotations

import random

__all__ = ["MIN_COUNTDOWN", "POLL_INTERVAL", "fallback_countdown", "held_countdown"]

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
    return fallback_countdown(remaining, min(defer_max, POLL_INTERVAL))


def fallback_countdown(remaining: float, defer_max: float) -> float:
    """Seconds until the fallback copy of a registered waiter looks at the job.

    Args:
        remaining: seconds the holder's lease has left, by the store's clock.
        defer_max: the cap on any deferral (``leases_defer_max``).

    Returns:
        The remaining lease plus a little (a claim then finds it run out, if
        the holder died), never above ``defer_max`` nor below
        :data:`MIN_COUNTDOWN`.
    """
    until_run_out = max(remaining, 0.0) + random.uniform(0.02, 0.1)
    return max(min(until_run_out, defer_max), MIN_COUNTDOWN)
