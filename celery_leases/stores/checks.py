"""Argument checks of the public store methods, done before a store is asked.

Each check turns a value a store cannot keep into a
:class:`~celery_leases.errors.LeaseConfigurationError` that says what to
change, so such a value never reaches a driver (where it would fail as a
driver error, or be stored cut short).
"""

from __future__ import annotations

import math

from celery_leases.errors import LeaseConfigurationError
from celery_leases.values import is_number, is_whole

__all__ = [
    "MAX_OUTCOME_BYTES",
    "MAX_TTL",
    "MAX_GENERATION",
    "MIN_RETENTION",
    "REASON_LIMIT",
    "TEXT_LIMIT",
    "check_generation",
    "check_job_id",
    "check_outcome",
    "check_owner",
    "check_retention",
    "check_text",
    "ttl_to_ms",
]

#: The longest lease a claim or renewal may ask for, in seconds (one day).
#: A lease is renewed by a heartbeat; a longer one only hides a dead holder.
MAX_TTL = 86400.0

#: Completed and released records younger than this are never purged (seconds).
MIN_RETENTION = 60.0

#: The largest generation: a store's clock in ms is far below it, and Lua
#: numbers and JSON keep every integer up to it exact.
MAX_GENERATION = 2**53 - 1

#: The most characters a job id, owner, task name, send id or operator name may have.
TEXT_LIMIT = 255

#: The largest outcome a completion may store (1 MiB).
MAX_OUTCOME_BYTES = 1024 * 1024

#: The longest reason an operator may give for a forced release.
REASON_LIMIT = 1000


def check_text(
    value: object,
    name: str,
    *,
    empty: bool = False,
    limit: int = TEXT_LIMIT,
    hint: str = "",
) -> str:
    """``value`` if every store can keep it as ``name``, else a configuration error.

    It must be a string (non-empty unless ``empty``), at most ``limit``
    characters, without NUL (PostgreSQL text cannot hold it) and encodable as
    UTF-8 (a lone surrogate is not).
    """
    if not isinstance(value, str) or (not value and not empty):
        kind = "a string" if empty else "a non-empty string"
        raise LeaseConfigurationError(f"{name} must be {kind}, got {value!r}")
    if len(value) > limit:
        raise LeaseConfigurationError(
            f"{name} is {len(value)} characters long; the limit is {limit}." + hint
        )
    if "\x00" in value:
        raise LeaseConfigurationError(
            f"{name} {value!r} contains a NUL character, which a lease store cannot keep"
        )
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LeaseConfigurationError(
            f"{name} {value!r} cannot be stored: it is not valid Unicode text "
            f"({exc.reason} at position {exc.start})"
        ) from None
    return value


def check_job_id(job_id: object) -> str:
    return check_text(
        job_id, "job_id", hint=" Derive a shorter key (for example a hash of the arguments)."
    )


def check_owner(owner: object) -> str:
    return check_text(owner, "owner")


def check_generation(generation: object) -> int:
    """``generation`` if it is a whole number a store can have handed out."""
    if not is_whole(generation, 1, MAX_GENERATION):
        raise LeaseConfigurationError(
            f"generation must be a positive integer below 2**53, got {generation!r}"
        )
    return generation


def check_outcome(outcome: object) -> bytes | None:
    """``outcome`` as bytes (or ``None``) if it is at most :data:`MAX_OUTCOME_BYTES`."""
    if outcome is None:
        return None
    if not isinstance(outcome, (bytes, bytearray, memoryview)):
        raise LeaseConfigurationError(
            f"outcome must be bytes or None, got {type(outcome).__name__}"
        )
    data = bytes(outcome)
    if len(data) > MAX_OUTCOME_BYTES:
        raise LeaseConfigurationError(
            f"outcome is {len(data)} bytes; a lease store keeps at most "
            f"{MAX_OUTCOME_BYTES} bytes. Store a large result elsewhere and keep a "
            "reference to it as the outcome."
        )
    return data


def ttl_to_ms(ttl: object) -> int:
    """Check a TTL in seconds and convert it to whole milliseconds (>= 1).

    Raises:
        LeaseConfigurationError: not a positive finite number, or above
            :data:`MAX_TTL`.
    """
    if not is_number(ttl) or not math.isfinite(ttl) or ttl <= 0:
        raise LeaseConfigurationError(f"ttl must be a positive number of seconds, got {ttl!r}")
    if ttl > MAX_TTL:
        raise LeaseConfigurationError(
            f"ttl of {ttl!r} seconds is above the limit of {MAX_TTL:g} (one day). "
            "Use a shorter lease; the heartbeat renews it while the task runs."
        )
    return max(1, round(ttl * 1000))


def check_retention(older_than: object, name: str = "older_than") -> int:
    """``older_than`` seconds in milliseconds, if at least :data:`MIN_RETENTION`;
    the error names it ``name`` (the option or argument as the caller took it)."""
    if not is_number(older_than) or not math.isfinite(older_than) or older_than < MIN_RETENTION:
        raise LeaseConfigurationError(
            f"{name} must be at least {MIN_RETENTION:g} seconds, got "
            f"{older_than!r}: a late duplicate must still find the job completed"
        )
    # beyond a century nothing is old enough; keep the number a 64-bit integer
    return round(min(older_than, 100 * 365 * 86400.0) * 1000)
