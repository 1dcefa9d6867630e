"""Lease settings, read once from the Celery configuration and validated.

Every key is prefixed ``leases_`` in ``app.conf``:

============================  ==============  ==============================================
key                           default         meaning
============================  ==============  ==============================================
``leases_store``              (required)      URL of the lease store
``leases_store_options``      ``{}``          keyword arguments for ``open_store`` (a dict)
``leases_ttl``                ``60.0``        seconds a claim or renewal lasts (0.1 to 86400)
``leases_renew_interval``     ``ttl / 3``     seconds between heartbeat renewals (>= 0.01)
``leases_drift_margin``       see below       seconds cut off the local deadline
``leases_on_lost``            ``"flag"``      ``"flag"``, ``"raise"`` or ``"stop"``
``leases_on_busy``            ``"wait"``      a call whose key another send holds:
                                              ``"wait"`` (run after it) or ``"skip"``
``leases_max_takeovers``      ``5``           takeovers before a job is poison
``leases_defer_backoff``      ``1.0``         first delay when the store is down (<= 86400)
``leases_defer_max``          ``60.0``        cap on any deferral delay (<= 86400)
``leases_result_max_bytes``   ``65536``       largest encoded result kept in the lease
                                              record for a redelivered copy; 0: none;
                                              at most 1048576
``leases_republish_options``  ``{}``          ``queue`` and/or ``priority`` for copies
                                              published again after a store outage or
                                              a fenced-out run
============================  ==============  ==============================================

The default drift margin is 5 % of the TTL, at least 0.5 s, and never more
than a quarter of the TTL. Every value of seconds must be a finite number.

``"flag"`` is cooperative: a lost lease sets ``lease.lost``, and
``lease.check()`` and every fenced helper refuse from then on; nothing is
raised into the task's thread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from celery_leases.errors import LeaseConfigurationError
from celery_leases.redact import mask_settings, secrets_of

# the longest lease ttl: one constant for the settings and the stores
from celery_leases.stores.checks import MAX_TTL
from celery_leases.values import is_number, is_whole

__all__ = [
    "DEFAULT_QUEUED_FOR",
    "MAX_DEFER",
    "MAX_RESULT_MAX_BYTES",
    "MAX_TTL",
    "MIN_RENEW_INTERVAL",
    "MIN_TTL",
    "ON_BUSY_MODES",
    "ON_LOST_MODES",
    "LeaseSettings",
    "LeaseTiming",
    "OnBusy",
    "OnLost",
    "check_defer_max",
    "check_on_busy",
    "check_queue_unique",
    "check_republish_options",
    "default_drift_margin",
]

OnLost = Literal["flag", "raise", "stop"]
ON_LOST_MODES: tuple[OnLost, ...] = ("flag", "raise", "stop")
#: what a call does when another send holds its job: wait and run after the
#: holder, or be answered at once with ``LeaseSkipped`` and not run
OnBusy = Literal["wait", "skip"]
ON_BUSY_MODES: tuple[OnBusy, ...] = ("wait", "skip")

#: the shortest lease ttl, in seconds: a shorter lease runs out within a few
#: store round trips, and its default renew interval (ttl/3) would keep the
#: heartbeat renewing in a tight loop
MIN_TTL = 0.1
#: the shortest renew interval, in seconds, for the same reason
MIN_RENEW_INTERVAL = 0.01
#: the longest deferral delay and backoff, in seconds (one day)
MAX_DEFER = 86400.0
#: the largest ``leases_result_max_bytes`` (1 MiB): a lease record is read on
#: every claim, so it must stay small
MAX_RESULT_MAX_BYTES = 1048576
DEFAULT_RESULT_MAX_BYTES = 65536


def default_drift_margin(ttl: float) -> float:
    """The drift margin used when none is configured: 5 % of ``ttl``, >= 0.5 s, <= ttl/4."""
    return min(max(0.5, ttl * 0.05), ttl / 4)


def _seconds(
    name: str,
    value: object,
    *,
    allow_zero: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    if (
        not is_number(value)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        wanted = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
        if minimum is not None and maximum is not None:
            wanted = f"a number of seconds from {minimum:g} to {maximum:g}"
        elif minimum is not None:
            wanted = f"a number of seconds of at least {minimum:g}"
        elif maximum is not None:
            wanted += f" of at most {maximum:g}"
        raise LeaseConfigurationError(f"{name} must be {wanted}, got {value!r}")
    return float(value)


_TTL_NAME = "the lease ttl (leases_ttl / lease_ttl)"


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
        ttl = _seconds(_TTL_NAME, self.ttl, minimum=MIN_TTL, maximum=MAX_TTL)
        drift = _seconds(
            "the drift margin (leases_drift_margin / lease_drift_margin)",
            self.drift_margin,
            allow_zero=True,
        )
        renew = _seconds(
            "the renew interval (leases_renew_interval / lease_renew_interval)",
            self.renew_interval,
            minimum=MIN_RENEW_INTERVAL,
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
    on_lost: OnLost = "flag"
    on_busy: OnBusy = "wait"
    max_takeovers: int | None = 5
    defer_backoff: float = 1.0
    defer_max: float = 60.0
    result_max_bytes: int = DEFAULT_RESULT_MAX_BYTES
    republish_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.store_url, str) or not self.store_url.strip():
            raise LeaseConfigurationError(
                "the leases_store setting is missing: set it to the lease store URL (for "
                "example 'redis://localhost:6379/0' or 'postgresql+psycopg://user@host/db'), "
                "or pass --leases-store to the worker"
            )
        _check_store_options(self.store_options)
        check_on_lost(self.on_lost, "leases_on_lost")
        check_on_busy(self.on_busy, "leases_on_busy")
        check_max_takeovers(self.max_takeovers, "leases_max_takeovers")
        backoff = _seconds("leases_defer_backoff", self.defer_backoff, maximum=MAX_DEFER)
        if check_defer_max(self.defer_max, "leases_defer_max") < backoff:
            raise LeaseConfigurationError(
                f"leases_defer_max ({self.defer_max:g} s) must not be below "
                f"leases_defer_backoff ({backoff:g} s): raise leases_defer_max or lower "
                "leases_defer_backoff"
            )
        check_result_max_bytes(self.result_max_bytes, "leases_result_max_bytes")
        check_republish_options(self.republish_options, "leases_republish_options")
        self.timing()

    def __repr__(self) -> str:
        # error trackers (Sentry records local variables) and debug logs show
        # settings: the store's password must not be in what they show
        secrets = secrets_of(self.store_url, self.store_options)
        shown = ", ".join(
            f"{f.name}={mask_settings(getattr(self, f.name), secrets=secrets)!r}"
            for f in dataclasses.fields(self)
        )
        return f"{type(self).__name__}({shown})"

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> LeaseSettings:
        """Read the ``leases_*`` keys of a Celery configuration.

        Raises:
            LeaseConfigurationError: a key is missing or invalid.
        """

        def get(key: str, default: Any) -> Any:
            value = conf.get(key)
            return default if value is None else value

        options = get("leases_store_options", {})
        _check_store_options(options)
        return cls(
            store_url=get("leases_store", ""),
            store_options=dict(options),
            ttl=get("leases_ttl", 60.0),
            renew_interval=conf.get("leases_renew_interval"),
            drift_margin=conf.get("leases_drift_margin"),
            on_lost=get("leases_on_lost", "flag"),
            on_busy=get("leases_on_busy", "wait"),
            max_takeovers=get("leases_max_takeovers", 5),
            defer_backoff=get("leases_defer_backoff", 1.0),
            defer_max=get("leases_defer_max", 60.0),
            result_max_bytes=get("leases_result_max_bytes", DEFAULT_RESULT_MAX_BYTES),
            republish_options=get("leases_republish_options", {}),
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
        ttl = _seconds(
            _TTL_NAME, self.ttl if ttl is None else ttl, minimum=MIN_TTL, maximum=MAX_TTL
        )
        if renew_interval is None:
            renew_interval = self.renew_interval if self.renew_interval is not None else ttl / 3
        if drift_margin is None:
            drift_margin = (
                self.drift_margin if self.drift_margin is not None else default_drift_margin(ttl)
            )
        return LeaseTiming(ttl, renew_interval, drift_margin)


def _check_mode(value: object, modes: tuple[str, ...], name: str) -> None:
    if value not in modes:
        raise LeaseConfigurationError(
            f"{name} must be one of {', '.join(map(repr, modes))}, got {value!r}"
        )


def check_on_lost(value: object, name: str) -> OnLost:
    """Check an ``on_lost`` mode; raises LeaseConfigurationError naming ``name``."""
    _check_mode(value, ON_LOST_MODES, name)
    return value  # type: ignore[return-value]


def check_on_busy(value: object, name: str) -> OnBusy:
    """Check an ``on_busy`` mode; raises LeaseConfigurationError naming ``name``."""
    _check_mode(value, ON_BUSY_MODES, name)
    return value  # type: ignore[return-value]


def check_max_takeovers(value: object, name: str) -> int | None:
    """Check a takeover limit (None = no limit); raises LeaseConfigurationError."""
    if value is None:
        return None
    if not is_whole(value, 0):
        raise LeaseConfigurationError(
            f"{name} must be a whole number >= 0 or None (no limit), got {value!r}"
        )
    return value


def check_defer_max(value: object, name: str) -> float:
    """Check a cap on deferral delays, in seconds; raises LeaseConfigurationError naming ``name``.

    A positive, finite number of at most :data:`MAX_DEFER` (one day): zero
    would re-publish a deferred message in a tight loop.
    """
    return _seconds(name, value, maximum=MAX_DEFER)


#: how long a queued mark of ``lease_queue_unique = True`` lasts at most
#: (seconds, counted from the message's countdown or eta)
DEFAULT_QUEUED_FOR = 3600.0


def check_queue_unique(value: object, name: str) -> float | None:
    """Check a ``lease_queue_unique`` option; raises LeaseConfigurationError naming ``name``.

    Returns:
        ``None`` when it is off (``False`` or ``None``); otherwise how long a
        queued mark lasts at most: :data:`DEFAULT_QUEUED_FOR` for ``True``,
        or the positive number of seconds given, up to a day (``MAX_TTL``).
    """
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_QUEUED_FOR
    return _seconds(name, value, maximum=MAX_TTL)


def check_result_max_bytes(value: object, name: str) -> int:
    """Check a result size limit in bytes (0: keep no result); raises LeaseConfigurationError."""
    if not is_whole(value, 0, MAX_RESULT_MAX_BYTES):
        raise LeaseConfigurationError(
            f"{name} must be a whole number of bytes from 0 (keep no result) to "
            f"{MAX_RESULT_MAX_BYTES}, got {value!r}"
        )
    return value


#: what ``leases_republish_options`` may set
REPUBLISH_OPTIONS = ("queue", "priority")


def check_republish_options(value: object, name: str) -> Mapping[str, Any]:
    """Check the publish options of re-published copies; raises LeaseConfigurationError.

    A dict with ``queue`` (a queue name) and/or ``priority`` (0 to 255, as
    the broker's priorities go).
    """
    example = "for example {'queue': 'leases-again'} or {'priority': 9}"
    if not isinstance(value, Mapping):
        raise LeaseConfigurationError(f"{name} must be a dict ({example}), got {value!r}")
    unknown = sorted(str(key) for key in value if key not in REPUBLISH_OPTIONS)
    if unknown:
        raise LeaseConfigurationError(
            f"{name} takes only {' and '.join(REPUBLISH_OPTIONS)} ({example}), got "
            f"{', '.join(map(repr, unknown))}"
        )
    queue = value.get("queue")
    if queue is not None and (not isinstance(queue, str) or not queue.strip()):
        raise LeaseConfigurationError(f"{name}['queue'] must be a queue name, got {queue!r}")
    priority = value.get("priority")
    if priority is not None and not is_whole(priority, 0, 255):
        raise LeaseConfigurationError(
            f"{name}['priority'] must be a whole number from 0 to 255, got {priority!r}"
        )
    return value


def _check_store_options(value: object) -> None:
    # the value is not echoed: store options may hold a password
    if not isinstance(value, Mapping):
        raise LeaseConfigurationError(
            "leases_store_options must be a dict of keyword arguments for the store "
            f"(for example {{'prefix': 'leases:'}}), got a {type(value).__name__}"
        )
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise LeaseConfigurationError(
                "leases_store_options must be a dict whose keys are keyword argument "
                f"names of the store, got the key {key!r}"
            )
