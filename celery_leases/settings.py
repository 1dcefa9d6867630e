"""Lease settings, read once from the Celery configuration and validated.

Every key is prefixed ``leases_`` in ``app.conf``:

=========================  ==================  ==========================================
key                        default             meaning
=========================  ==================  ==========================================
``leases_store``           (required)          URL of the lease store
``leases_store_options``   ``{}``              keyword arguments for ``open_store``
``leases_ttl``             ``60.0``            seconds a claim or renewal lasts
``leases_renew_interval``  ``ttl / 3``         seconds between heartbeat renewals
``leases_drift_margin``    see below           seconds cut off the local deadline
``leases_on_lost``         ``"raise"``         ``"flag"``, ``"raise"`` or ``"stop"``
``leases_max_takeovers``   ``5``               takeovers before a job is poison
``leases_defer_backoff``   ``1.0``             first delay when the store is down
``leases_defer_max``       ``60.0``            cap on any deferral delay
=========================  ==================  ==========================================

The default drift margin is 5 % of the TTL, at least 0.5 s, and never more
than a quarter of the TTL.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from celery_leases.errors import LeaseConfigurationError

__all__ = [
    "ON_LOST_MODES",
    "LeaseSettings",
    "LeaseTiming",
    "OnLost",
    "default_drift_margin",
]

OnLost = Literal["flag", "raise", "stop"]
ON_LOST_MODES: tuple[OnLost, ...] = ("flag", "raise", "stop")


def default_drift_margin(ttl: float) -> float:
    """The drift margin used when none is configured: 5 % of ``ttl``, >= 0.5 s, <= ttl/4."""
    return min(max(0.5, ttl * 0.05), ttl / 4)


def _seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        wanted = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
        raise LeaseConfigurationError(f"{name} must be {wanted}, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """The resolved timing of one task's leases, in seconds.

    Raises:
        LeaseConfigurationError: the values cannot keep a lease alive; the
            message says which setting to change.
    """

    ttl: float
    renew_interval: float
    drift_margin: float

    def __post_init__(self) -> None:
        ttl = _seconds("the lease ttl (leases_ttl / lease_ttl)", self.ttl)
        drift = _seconds(
            "the drift margin (leases_drift_margin / lease_drift_margin)",
            self.drift_margin,
            allow_zero=True,
        )
        renew = _seconds(
            "the renew interval (leases_renew_interval / lease_renew_interval)",
            self.renew_interval,
        )
        if drift >= ttl / 2:
            raise LeaseConfigurationError(
                f"the drift margin ({drift:g} s) must be below half the lease ttl "
                f"({ttl:g} s): lower leases_drift_margin or raise leases_ttl"
            )
        if renew >= ttl - drift:
            raise LeaseConfigurationError(
                f"the renew interval ({renew:g} s) must be shorter than the lease ttl minus "
                f"the drift margin ({ttl:g} - {drift:g} s), or the lease runs out before "
                "its first renewal: lower leases_renew_interval (ttl/3 is the default)"
            )

    @property
    def safe_duration(self) -> float:
        """Seconds from sending a claim or renewal to the local safe deadline."""
        return self.ttl - self.drift_margin


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """Lease settings of one Celery app; build it with :meth:`from_conf`.

    ``renew_interval`` and ``drift_margin`` may be ``None``: they then
    follow the TTL of each task (see :meth:`timing`).
    """

    store_url: str
    store_options: Mapping[str, Any] = field(default_factory=dict)
    ttl: float = 60.0
    renew_interval: float | None = None
    drift_margin: float | None = None
    on_lost: OnLost = "raise"
    max_takeovers: int | None = 5
    defer_backoff: float = 1.0
    defer_max: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.store_url, str) or not self.store_url.strip():
            raise LeaseConfigurationError(
                "the leases_store setting is missing: set app.conf.leases_store to the "
                "lease store URL (for example 'redis://localhost:6379/0' or "
                "'postgresql+psycopg://user@host/db'), or pass --leases-store to the worker"
            )
        if not isinstance(self.store_options, Mapping):
            raise LeaseConfigurationError(
                f"leases_store_options must be a dict, got {self.store_options!r}"
            )
        check_on_lost(self.on_lost, "leases_on_lost")
        check_max_takeovers(self.max_takeovers, "leases_max_takeovers")
        backoff = _seconds("leases_defer_backoff", self.defer_backoff)
        if _seconds("leases_defer_max", self.defer_max) < backoff:
            raise LeaseConfigurationError(
                f"leases_defer_max ({self.defer_max:g} s) must not be below "
                f"leases_defer_backoff ({backoff:g} s)"
            )
        self.timing()

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> LeaseSettings:
        """Read the ``leases_*`` keys of a Celery configuration.

        Raises:
            LeaseConfigurationError: a key is missing or invalid.
        """

        def get(key: str, default: Any) -> Any:
            value = conf.get(key)
            return default if value is None else value

        return cls(
            store_url=get("leases_store", ""),
            store_options=dict(get("leases_store_options", {})),
            ttl=get("leases_ttl", 60.0),
            renew_interval=conf.get("leases_renew_interval"),
            drift_margin=conf.get("leases_drift_margin"),
            on_lost=get("leases_on_lost", "raise"),
            max_takeovers=get("leases_max_takeovers", 5),
            defer_backoff=get("leases_defer_backoff", 1.0),
            defer_max=get("leases_defer_max", 60.0),
        )

    def timing(
        self,
        ttl: float | None = None,
        renew_interval: float | None = None,
        drift_margin: float | None = None,
    ) -> LeaseTiming:
        """The timing for a task, its own values first, then these settings.

        A task that sets only its TTL gets ``ttl / 3`` and the default drift
        margin for that TTL, unless the app configured them explicitly.

        Raises:
            LeaseConfigurationError: the resulting timing is invalid.
        """
        ttl = _seconds("the lease ttl (leases_ttl / lease_ttl)", self.ttl if ttl is None else ttl)
        if renew_interval is None:
            renew_interval = self.renew_interval if self.renew_interval is not None else ttl / 3
        if drift_margin is None:
            drift_margin = (
                self.drift_margin if self.drift_margin is not None else default_drift_margin(ttl)
            )
        return LeaseTiming(ttl, renew_interval, drift_margin)


def check_on_lost(value: object, name: str) -> OnLost:
    """Check an ``on_lost`` mode; raises LeaseConfigurationError naming ``name``."""
    if value not in ON_LOST_MODES:
        raise LeaseConfigurationError(
            f"{name} must be one of {', '.join(map(repr, ON_LOST_MODES))}, got {value!r}"
        )
    return value


def check_max_takeovers(value: object, name: str) -> int | None:
    """Check a takeover limit (None = no limit); raises LeaseConfigurationError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LeaseConfigurationError(
            f"{name} must be a whole number >= 0 or None (no limit), got {value!r}"
        )
    return value


def check_defer_max(value: object, name: str) -> float:
    """Check a cap on deferral delays; raises LeaseConfigurationError naming ``name``."""
    return _seconds(name, value)
