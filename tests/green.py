"""What the green pools' test apps use to hold the hub."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["unpatched_sleep"]


def unpatched_sleep() -> Callable[[float], None]:
    """``time.sleep`` as it was before gevent or eventlet patched it: a
    blocking C call that holds the hub when a greenlet makes it."""
    if "gevent.monkey" in sys.modules:
        from gevent import monkey  # type: ignore[import-untyped]

        if monkey.is_module_patched("time"):
            sleep: Callable[[float], None] = monkey.get_original("time", "sleep")
            return sleep
    if "eventlet.patcher" in sys.modules:
        from eventlet import patcher  # type: ignore[import-untyped]

        if patcher.is_monkey_patched("time"):
            original: Callable[[float], None] = patcher.original("time").sleep
            return original
    return time.sleep
