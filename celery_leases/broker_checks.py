"""What the broker allows a leased message: RabbitMQ's consumer timeout.

RabbitMQ closes a channel whose oldest delivery stays unacknowledged longer
than its ``consumer_timeout`` (30 minutes by default since 3.8.15), and a
Celery worker whose channel is closed that way exits. Two things keep a
leased message unacknowledged in a worker:

- the run itself (leased tasks acknowledge late);
- a deferred copy: it is published with a countdown, and the worker that
  receives it holds it, unacknowledged, until the countdown ends.

A client cannot ask the server for its ``consumer_timeout``, so the worker
takes it from ``leases_broker_consumer_timeout`` (seconds; ``0`` when the
server's timeout is turned off), else from an ``x-consumer-timeout``
argument (milliseconds) of the app's ``task_queues``, else RabbitMQ's
default. Deferral countdowns on RabbitMQ are capped at half of it
(:func:`countdown_cap`): a capped copy comes back early, finds the lease
still held and is deferred again, and no healthy worker loses its channel.
:func:`broker_warnings` is part of the worker's start checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from celery_leases.errors import LeaseConfigurationError

__all__ = [
    "AMQP_TRANSPORTS",
    "DEFAULT_CONSUMER_TIMEOUT",
    "broker_warnings",
    "consumer_timeout",
    "countdown_cap",
]

#: broker URL schemes of RabbitMQ (the transports with a consumer timeout)
AMQP_TRANSPORTS = ("amqp", "amqps", "pyamqp", "librabbitmq")

#: RabbitMQ's own ``consumer_timeout`` since 3.8.15, seconds
DEFAULT_CONSUMER_TIMEOUT = 1800.0

#: the shortest deferral countdown the cap leaves, seconds
_SHORTEST_CAP = 0.5


def _is_amqp(app: Any) -> bool:
    url = str(app.conf.broker_url or "")
    return url.split("://", 1)[0].lower() in AMQP_TRANSPORTS


def consumer_timeout(app: Any) -> float | None:
    """The consumer timeout of ``app``'s RabbitMQ broker, in seconds.

    Returns:
        None when the broker is not RabbitMQ or the timeout is turned off.

    Raises:
        LeaseConfigurationError: ``leases_broker_consumer_timeout`` is not a
            number of seconds >= 0.
    """
    if not _is_amqp(app):
        return None
    configured = app.conf.get("leases_broker_consumer_timeout")
    if configured is not None:
        try:
            seconds = float(configured)
        except (TypeError, ValueError) as exc:
            raise LeaseConfigurationError(
                f"leases_broker_consumer_timeout must be a number of seconds, got "
                f"{configured!r}; set it to the RabbitMQ server's consumer_timeout / 1000"
            ) from exc
        if not math.isfinite(seconds) or seconds < 0 or isinstance(configured, bool):
            raise LeaseConfigurationError(
                f"leases_broker_consumer_timeout must be >= 0 seconds (0: turned off on the "
                f"server), got {configured!r}"
            )
        return seconds or None
    from_queues = _queue_argument_timeouts(app)
    return min(from_queues) if from_queues else DEFAULT_CONSUMER_TIMEOUT


def _queue_argument_timeouts(app: Any) -> list[float]:
    found: list[float] = []
    for queue in app.conf.task_queues or ():
        arguments = getattr(queue, "queue_arguments", None) or {}
        value = arguments.get("x-consumer-timeout")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(float(value) / 1000)
    return found


def countdown_cap(app: Any) -> float | None:
    """The longest countdown a deferred copy may get on ``app``'s broker (None: no cap)."""
    timeout = consumer_timeout(app)
    if timeout is None:
        return None
    return max(timeout / 2, _SHORTEST_CAP)


def broker_warnings(app: Any, tasks: Iterable[Any]) -> list[str]:
    """Warnings for leased ``tasks`` whose timing reaches the consumer timeout.

    Args:
        tasks: bound ``LeasedTask`` instances (their ``lease_timing()``,
            ``lease_defer_limit()`` and ``time_limit`` are read).
    """
    timeout = consumer_timeout(app)
    if timeout is None:
        return []
    warnings: list[str] = []
    where = (
        "leases_broker_consumer_timeout"
        if app.conf.get("leases_broker_consumer_timeout") is not None
        else "the RabbitMQ consumer_timeout the worker assumes"
    )
    for task in tasks:
        ttl = task.lease_timing().ttl
        defer_max = task.lease_defer_limit()
        time_limit = task.time_limit or app.conf.task_time_limit
        if ttl >= timeout or defer_max >= timeout:
            warnings.append(
                f"task {task.name!r}: its lease ttl ({ttl:g} s) or leases_defer_max "
                f"({defer_max:g} s) reaches {where} ({timeout:g} s); deferred copies are "
                f"held at most {max(timeout / 2, _SHORTEST_CAP):g} s each, so a duplicate "
                "comes back more often; lower the ttl and leases_defer_max below half the "
                "consumer timeout"
            )
        if time_limit and time_limit >= timeout:
            warnings.append(
                f"task {task.name!r} may run for {time_limit:g} s (time_limit) but {where} "
                f"is {timeout:g} s: RabbitMQ closes the channel of a run that long (its "
                "message is unacknowledged until the run ends) and the worker exits; raise "
                "the server's consumer_timeout (and leases_broker_consumer_timeout) above "
                "the time limit"
            )
    return warnings
