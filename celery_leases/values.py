"""Plain values read one way everywhere: numbers a caller passes, text a server answers.

``True`` is an ``int`` to Python, never a count or a number of seconds here.
"""

from __future__ import annotations

from typing import Any, TypeGuard

__all__ = ["as_text", "is_number", "is_whole"]


def is_whole(value: object, low: int | None = None, high: int | None = None) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` (not a ``bool``) from ``low`` to ``high``."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (low is None or value >= low)
        and (high is None or value <= high)
    )


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an ``int`` or a ``float`` (not a ``bool``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_text(value: Any) -> str:
    """``value`` as text: bytes decoded as UTF-8 (a Redis reply), anything else by ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)
