"""What the broker allows a leased message: RabbitMQ's consumer timeout,
and the visibility timeout of Redis and SQS.

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

Redis and SQS hand an unacknowledged message out again after their
``visibility_timeout`` (:func:`visibility_timeout`: the transport option,
kombu's default when unset, or an existing SQS queue's own shorter
attribute, which the start check reads), and so does the embedded
filesystem broker (:mod:`celery_leases.filesystem`), whose visibility no
renewal extends. Deferral countdowns are capped at half of it too: a
deferred copy held longer would be handed out again, and each of those
deliveries would defer a copy of its own. With
``leases_broker_keep_invisible`` (:func:`keep_invisible`) renewals push it
forward on Redis and SQS (:mod:`celery_leases.broker_visibility`), and
:func:`visibility_warnings` checks at start that they come often enough.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from celery_leases.errors import LeaseConfigurationError
from celery_leases.filesystem import TRANSPORT as WHOLE_FILES_TRANSPORT
from celery_leases.filesystem import Transport as WholeFilesTransport
from celery_leases.filesystem import visibility_timeout_option
from celery_leases.urls import url_scheme

__all__ = [
    "AMQP_TRANSPORTS",
    "DEFAULT_CONSUMER_TIMEOUT",
    "KEEP_INVISIBLE",
    "VISIBILITY_OPTION",
    "broker_warnings",
    "configured_visibility_timeout",
    "consumer_timeout",
    "countdown_cap",
    "filesystem_warnings",
    "keep_invisible",
    "note_queue_visibility",
    "visibility_source",
    "visibility_timeout",
    "visibility_transport",
    "visibility_warnings",
]

#: broker URL schemes of RabbitMQ (the transports with a consumer timeout)
AMQP_TRANSPORTS = ("amqp", "amqps", "pyamqp", "librabbitmq")

#: RabbitMQ's own ``consumer_timeout`` since 3.8.15, seconds
DEFAULT_CONSUMER_TIMEOUT = 1800.0

#: the setting that turns extensions on
KEEP_INVISIBLE = "leases_broker_keep_invisible"

#: broker URL schemes of kombu's Redis transport, and of SQS
_REDIS_SCHEMES = ("redis", "rediss", "sentinel")
_SQS_SCHEMES = ("sqs",)

#: the shortest deferral countdown the cap leaves, seconds
_SHORTEST_CAP = 0.5


def _is_amqp(app: Any) -> bool:
    return url_scheme(app.conf.broker_url) in AMQP_TRANSPORTS


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
    """The longest countdown a deferred copy may get on ``app``'s broker (None: no cap).

    The worker that receives a copy holds it unacknowledged until its
    countdown ends. Past RabbitMQ's consumer timeout the channel is closed;
    past the visibility timeout of Redis or SQS the broker hands the copy out
    again, and each of those deliveries defers a copy of its own. The cap is
    half of either.
    """
    timeout = consumer_timeout(app)
    if timeout is None:
        timeout = visibility_timeout(app)
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


# --- Redis and SQS: the visibility timeout ---------------------------------------


#: kombu's own visibility timeouts when the transport option is not set
_DEFAULT_VISIBILITY = {"redis": 3600.0, "sqs": 1800.0}


def visibility_transport(app: Any) -> str | None:
    """``"redis"``, ``"sqs"`` or None: the transport ``app`` consumes from."""
    scheme = url_scheme(app.conf.broker_read_url or app.conf.broker_url)
    if scheme in _REDIS_SCHEMES:
        return "redis"
    if scheme in _SQS_SCHEMES:
        return "sqs"
    return None


def keep_invisible(app: Any) -> bool:
    """Whether ``app`` asks for extensions (``leases_broker_keep_invisible``).

    Raises:
        LeaseConfigurationError: the setting is not a boolean.
    """
    value = app.conf.get(KEEP_INVISIBLE)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise LeaseConfigurationError(
            f"{KEEP_INVISIBLE} must be True or False, got {value!r}: set it to True to keep a "
            "leased message invisible on a Redis or SQS broker while its lease is renewed"
        )
    return value


#: where a visibility timeout comes from when it is the transport option
VISIBILITY_OPTION = "broker_transport_options['visibility_timeout']"

#: per app: the shortest ``VisibilityTimeout`` an existing SQS queue has, and
#: that queue's name, as the start check read it (:func:`note_queue_visibility`)
_queue_visibility: weakref.WeakKeyDictionary[Any, tuple[float, str]] = weakref.WeakKeyDictionary()


def configured_visibility_timeout(app: Any) -> float | None:
    """``app``'s visibility timeout option, or kombu's default, on Redis or SQS,
    or the embedded filesystem broker's option (None: another broker, or
    turned off).

    Raises:
        LeaseConfigurationError: the filesystem broker's option is not a
            positive number or None.
    """
    options = app.conf.broker_transport_options or {}
    transport = visibility_transport(app)
    if transport is None:
        return visibility_timeout_option(options) if _whole_files(app) else None
    value = options.get("visibility_timeout", _DEFAULT_VISIBILITY[transport])
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def note_queue_visibility(app: Any, found: Mapping[str, float]) -> None:
    """Note the ``VisibilityTimeout`` each of ``app``'s SQS queues has (queue name: seconds).

    kombu applies the transport's ``visibility_timeout`` only to a queue it
    creates; SQS uses the attribute the queue has. From then on
    :func:`visibility_timeout` is the shortest of them, when below the option.
    Replaces what was noted before.
    """
    if found:
        queue = min(found, key=lambda name: found[name])
        _queue_visibility[app] = (found[queue], queue)
    else:
        _queue_visibility.pop(app, None)


def visibility_timeout(app: Any) -> float | None:
    """The visibility timeout of ``app``'s Redis, SQS or filesystem broker
    (None: another broker, or turned off).

    The transport option (or kombu's default), or the shortest
    ``VisibilityTimeout`` of an SQS queue the start check found below it.
    """
    configured = configured_visibility_timeout(app)
    noted = _queue_visibility.get(app)
    if configured is None or noted is None:
        return configured
    return min(configured, noted[0])


def visibility_source(app: Any) -> str:
    """Where :func:`visibility_timeout` comes from, for messages."""
    configured = configured_visibility_timeout(app)
    noted = _queue_visibility.get(app)
    if configured is not None and noted is not None and noted[0] < configured:
        return f"the VisibilityTimeout attribute of SQS queue {noted[1]!r}"
    return VISIBILITY_OPTION


def visibility_warnings(app: Any, tasks: Iterable[Any]) -> list[str]:
    """Start checks of ``leases_broker_keep_invisible`` for ``app``'s leased ``tasks``.

    Returns:
        Warnings worth logging (the setting has no effect on this broker).

    Raises:
        LeaseConfigurationError: the setting is not a boolean, or a task
            renews too rarely for the visibility timeout.
    """
    if not keep_invisible(app):
        return []
    timeout = visibility_timeout(app)
    if visibility_transport(app) is None or timeout is None:
        return [
            f"{KEEP_INVISIBLE} is set but the broker is neither Redis nor SQS: it has no effect "
            "there (only on those brokers does a renewal push a message's visibility forward)"
        ]
    for task in tasks:
        interval = task.lease_timing().renew_interval
        if interval >= timeout / 2:
            raise LeaseConfigurationError(
                f"task {task.name!r} renews its lease every {interval:g} s, but with "
                f"{KEEP_INVISIBLE} a renewal must come at least twice per visibility timeout "
                f"({timeout:g} s, {visibility_source(app)}), or the broker hands its message "
                f"out between two: lower the task's lease ttl or renew interval, or raise "
                f"{visibility_source(app)}"
            )
    return []


# --- the filesystem broker: whole message files ----------------------------------


def _whole_files(app: Any) -> bool:
    """Whether ``app``'s broker transport is :class:`celery_leases.filesystem.Transport`."""
    transport = app.conf.broker_transport
    return transport == WHOLE_FILES_TRANSPORT or (
        isinstance(transport, type) and issubclass(transport, WholeFilesTransport)
    )


def filesystem_warnings(app: Any) -> list[str]:
    """A warning when ``app``'s ``filesystem://`` broker uses kombu's own transport.

    That transport can hand a consumer a message file still being written,
    and the message is lost (:mod:`celery_leases.filesystem`).
    """
    urls = (app.conf.broker_read_url, app.conf.broker_write_url, app.conf.broker_url)
    if "filesystem" not in {url_scheme(url) for url in urls} or _whole_files(app):
        return []
    return [
        "the broker is filesystem:// on kombu's own transport, which loses a message when a "
        "worker takes its file while it is still being written (and leased tasks publish "
        f"deferred copies often): set broker_transport = {WHOLE_FILES_TRANSPORT!r}"
    ]
