"""Keep a leased message invisible on the broker while its lease is renewed.

The Redis and SQS brokers hand an unacknowledged message to another worker
once their ``visibility_timeout`` has passed since it was delivered, however
alive the run that holds it. With ``leases_broker_keep_invisible = True``,
every accepted renewal of a lease also pushes that moment forward for the
message the run came from:

- Redis (kombu's ``redis``, ``rediss`` and ``sentinel`` transports): the
  message's delivery tag in the transport's unacked index (the sorted set
  ``unacked_index``, with ``global_keyprefix`` and the ``unacked_index_key``
  transport option applied) gets the worker's current time as its score,
  with ``ZADD XX``: a message acknowledged meanwhile is not put back.
  Nothing else is written (the ``unacked`` hash is left alone).
- SQS: ``ChangeMessageVisibility`` on the delivery's receipt handle, for
  the transport's ``visibility_timeout`` (rounded up to whole seconds).

So ``visibility_timeout`` no longer has to exceed the longest run: it only
has to outlast two renew intervals (the start checks refuse less), and a
job whose worker died comes back one visibility timeout after its last
renewal instead of hours later::

    claim ─ extend ── renew ─ extend ── renew ─ extend ── (worker killed)
    broker: invisible ......................................... visible again
                                                 └── visibility_timeout ──┘

A lease that is lost (refused renewal, passed deadline) is renewed no more,
so its message is extended no more. Extensions run on a thread of their
own (:class:`Extender`), never on the heartbeat's: a renewal only queues
one, a broker that hangs delays nothing but the next extension, each call
is bounded by socket timeouts (:data:`CALL_TIMEOUT`), and a failure is
logged, never raised. Messages a worker holds before their run claims a
lease (prefetched, or waiting for a countdown) are not extended.

The renewal happens in the process that runs the task (a prefork child),
which has no consumer connection of its own, so each process opens one
broker connection for extensions, lazily, anew after a fork.

:func:`read_queue_visibility` reads, at worker start, the
``VisibilityTimeout`` an existing SQS queue really has: kombu applies the
transport's option only to a queue it creates.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from celery_leases import signals
from celery_leases.broker_checks import (
    VISIBILITY_OPTION,
    configured_visibility_timeout,
    note_queue_visibility,
    visibility_transport,
)
from celery_leases.lease import Lease
from celery_leases.per_process import JobThread, ProcessLocal

__all__ = [
    "CALL_TIMEOUT",
    "Delivery",
    "Extender",
    "delivery_of",
    "enable",
    "process_extender",
    "read_queue_visibility",
    "stop",
]

logger = logging.getLogger("celery_leases")

#: seconds one extension may wait on the broker (socket and HTTP timeouts)
CALL_TIMEOUT = 5.0

#: SQS error codes of a queue that does not exist (the query and JSON protocols)
_SQS_NO_QUEUE = frozenset({"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"})

#: SQS error codes of a receipt handle whose message was deleted (acknowledged)
#: or handed out again
_SQS_GONE = frozenset({"ReceiptHandleIsInvalid", "AWS.SimpleQueueService.MessageNotInflight"})


@dataclass(frozen=True)
class Delivery:
    """Where a message sits on the broker while it is unacknowledged.

    Attributes:
        tag: the delivery tag (Redis) or the receipt handle (SQS).
        queue_url: the SQS queue's URL (None on Redis).
    """

    tag: str
    queue_url: str | None = None


def delivery_of(request: Any, transport: str) -> Delivery | None:
    """The :class:`Delivery` of a task request's message (None: none known).

    kombu keeps the delivery tag in the message's properties; on SQS it is
    the receipt handle, and ``delivery_info['sqs_queue']`` is the queue URL.
    An eager or direct call has no message.
    """
    properties = getattr(request, "properties", None) or {}
    tag = properties.get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        return None
    if transport == "sqs":
        info = properties.get("delivery_info") or {}
        queue_url = info.get("sqs_queue")
        if not isinstance(queue_url, str) or not queue_url:
            return None
        return Delivery(tag, queue_url)
    return Delivery(tag)


class _Broker:
    """One broker connection of this process for extensions, opened on first use."""

    def __init__(self, app: Any, transport: str) -> None:
        self.app = app
        self.transport = transport
        self._connection: Any = None
        self._channel: Any = None

    def open(self) -> Any:
        """The channel for extensions, opened on first use."""
        if self._channel is None:
            options = dict(self.app.conf.broker_transport_options or {})
            # a broker that is down costs one try, not kombu's endless retries
            options.update(max_retries=1, connect_retries_timeout=CALL_TIMEOUT)
            if self.transport == "redis":
                options.update(socket_timeout=CALL_TIMEOUT, socket_connect_timeout=CALL_TIMEOUT)
            else:
                config = dict(options.get("client-config") or {})
                config.update(
                    connect_timeout=CALL_TIMEOUT,
                    read_timeout=CALL_TIMEOUT,
                    retries={"max_attempts": 1},
                )
                options["client-config"] = config
            self._connection = self.app.connection_for_read(transport_options=options)
            self._channel = self._connection.default_channel
        return self._channel

    def extend(self, delivery: Delivery) -> bool:
        """Push the message's visibility forward; returns whether it was still there."""
        channel = self.open()
        if self.transport == "redis":
            changed = channel.client.zadd(
                channel.unacked_index_key, {delivery.tag: time.time()}, xx=True, ch=True
            )
            return bool(changed)
        client = channel.sqs(queue=_predefined_name(channel, delivery.queue_url))
        try:
            client.change_message_visibility(
                QueueUrl=delivery.queue_url,
                ReceiptHandle=delivery.tag,
                VisibilityTimeout=math.ceil(channel.visibility_timeout),
            )
        except Exception as exc:
            code = _sqs_error_code(exc)
            if code in _SQS_GONE or (
                # an expired handle, said with the code of any bad parameter
                code == "InvalidParameterValue" and "ReceiptHandle" in str(exc)
            ):
                return False
            raise
        return True

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            try:
                connection.release()
            except Exception:  # a broken connection is dropped either way
                logger.debug("closing the broker connection for extensions failed", exc_info=True)


def read_queue_visibility(app: Any) -> list[str]:
    """Read the ``VisibilityTimeout`` of each existing SQS queue ``app`` consumes.

    kombu sets ``broker_transport_options['visibility_timeout']`` on a queue
    only when it creates it: a queue that already exists keeps its own
    attribute, and that is what SQS uses. What is read is noted
    (:func:`~celery_leases.broker_checks.note_queue_visibility`), so the
    start checks and the deferral cap use the shortest. A queue that does
    not exist yet is created by kombu with the option, unless
    ``sqs-creation-attributes`` names a ``VisibilityTimeout`` of its own:
    the queue gets that one, and it counts as the queue's. Nothing is read
    on other brokers. Each call waits at most :data:`CALL_TIMEOUT` seconds.

    Returns:
        Warnings: a queue whose attribute (or the one it will be created
        with) is below the option, or queues that could not be read (the
        checks then use the option).
    """
    if visibility_transport(app) != "sqs":
        return []
    configured = configured_visibility_timeout(app) or 0.0
    broker = _Broker(app, "sqs")
    created = _creation_visibility(app)
    found: dict[str, float] = {}
    to_create: dict[str, float] = {}
    try:
        channel = broker.open()
        for queue in app.amqp.queues.consume_from.values():
            seconds = _queue_visibility(channel, queue.name)
            if seconds is not None:
                found[queue.name] = seconds
            elif created is not None and not channel.predefined_queues:
                to_create[queue.name] = created
    except Exception as exc:
        note_queue_visibility(app, {})
        return [
            f"could not read the VisibilityTimeout of the SQS queues this worker consumes "
            f"({type(exc).__name__}: {exc}); the lease checks assume {VISIBILITY_OPTION} "
            f"({configured:g} s), which SQS uses only for a queue kombu creates"
        ]
    finally:
        broker.close()
    below = {
        name: seconds for name, seconds in {**found, **to_create}.items() if seconds < configured
    }
    note_queue_visibility(app, below)
    return [
        f"SQS queue {name!r} has a VisibilityTimeout of {seconds:g} s, below {VISIBILITY_OPTION} "
        f"({configured:g} s): kombu sets the option only on a queue it creates, and SQS "
        f"uses the queue's own, so the lease checks and deferral countdowns use {seconds:g} s. "
        f"Set the queue's VisibilityTimeout attribute to {math.ceil(configured)} (aws sqs "
        "set-queue-attributes), or lower the option"
        if name in found
        else f"SQS queue {name!r} does not exist yet, and kombu will create it with the "
        f"VisibilityTimeout of broker_transport_options['sqs-creation-attributes'] "
        f"({seconds:g} s), below {VISIBILITY_OPTION} ({configured:g} s), so the lease checks "
        f"and deferral countdowns use {seconds:g} s. Remove VisibilityTimeout from "
        "sqs-creation-attributes, or lower the option"
        for name, seconds in sorted(below.items())
    ]


def _creation_visibility(app: Any) -> float | None:
    """The ``VisibilityTimeout`` kombu gives a queue it creates in place of
    the option (``sqs-creation-attributes``), or None: the option's."""
    options = app.conf.broker_transport_options or {}
    value = (options.get("sqs-creation-attributes") or {}).get("VisibilityTimeout")
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None  # SQS refuses it when kombu creates the queue, with its own message


def _queue_visibility(channel: Any, name: str) -> float | None:
    """The ``VisibilityTimeout`` of SQS queue ``name`` (None: it does not exist yet)."""
    predefined = channel.predefined_queues or {}
    if predefined:
        if name not in predefined:
            return None  # kombu refuses to consume it, with its own message
        client, url = channel.sqs(queue=name), predefined[name]["url"]
    else:
        client = channel.sqs()
        try:
            reply = client.get_queue_url(QueueName=channel.canonical_queue_name(name))
        except Exception as exc:
            if _sqs_error_code(exc) in _SQS_NO_QUEUE:
                return None
            raise
        url = reply["QueueUrl"]
    attributes = client.get_queue_attributes(QueueUrl=url, AttributeNames=["VisibilityTimeout"])
    return float(attributes["Attributes"]["VisibilityTimeout"])


def _sqs_error_code(exc: BaseException) -> object:
    """The error code of a botocore ``ClientError`` (None for any other error)."""
    return ((getattr(exc, "response", None) or {}).get("Error") or {}).get("Code")


def _predefined_name(channel: Any, queue_url: str | None) -> str | None:
    # a predefined queue has a client of its own (region, credentials)
    for name, queue in (channel.predefined_queues or {}).items():
        if queue.get("url") == queue_url:
            return str(name)
    return None


@dataclass
class _Watched:
    broker: _Broker
    delivery: Delivery


class Extender:
    """Extends the visibility of leased messages on a thread of its own.

    :meth:`request` never waits: it notes the latest wish per lease and
    queues one pass over the wishes on a
    :class:`~celery_leases.per_process.JobThread`, so a broker that hangs
    cannot hold whoever asked.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: weakref.WeakKeyDictionary[Lease, _Watched] = weakref.WeakKeyDictionary()
        self._pending: dict[int, Lease] = {}
        #: whether a pass over ``_pending`` is queued and not begun yet
        self._pass_queued = False
        self._brokers: dict[int, _Broker] = {}
        self._thread = JobThread("celery-leases-visibility")
        #: extensions applied, and tries that failed (for tests and operators)
        self.extended = 0
        self.failed = 0

    def watch(self, lease: Lease, app: Any, delivery: Delivery) -> None:
        """Extend ``delivery``'s visibility at each renewal of ``lease``, and now."""
        transport = visibility_transport(app)
        if transport is None:
            return
        with self._lock:
            broker = self._brokers.get(id(app))
            if broker is None or broker.app is not app:
                broker = self._brokers[id(app)] = _Broker(app, transport)
            self._watched[lease] = _Watched(broker, delivery)
        # a message that waited for a countdown was delivered a while ago:
        # its visibility runs from then, not from the claim
        self.request(lease)

    def request(self, lease: Lease) -> None:
        """Queue an extension for ``lease``'s message, if it is watched."""
        with self._lock:
            if lease not in self._watched:
                return
            self._pending[id(lease)] = lease
            queue_pass, self._pass_queued = not self._pass_queued, True
        if queue_pass:
            self._thread.submit(self._extend_pending)

    def forget(self, lease: Lease) -> None:
        """Extend ``lease``'s message no more (the run has ended)."""
        with self._lock:
            self._watched.pop(lease, None)
            self._pending.pop(id(lease), None)

    def stop(self, timeout: float = CALL_TIMEOUT * 2) -> None:
        """Stop the thread, wait for it and close the broker connections.

        Extensions not begun are dropped; the next one starts the thread again.
        """
        with self._lock:
            self._pending.clear()
        self._thread.stop(timeout)
        with self._lock:
            brokers = list(self._brokers.values())
        for broker in brokers:
            broker.close()

    def _extend_pending(self) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
            self._pass_queued = False
        for lease in pending:
            self._extend(lease)

    def _extend(self, lease: Lease) -> None:
        with self._lock:
            watched = self._watched.get(lease)
        # a lost lease must not keep its message from the next worker
        if watched is None or lease.lost or lease.finished:
            return
        try:
            present = watched.broker.extend(watched.delivery)
        except Exception as exc:
            self.failed += 1
            watched.broker.close()  # the next try opens a fresh connection
            logger.warning(
                "could not keep the message of job %r invisible on the broker: %r; it may "
                "be delivered again after the visibility timeout",
                lease.job_id,
                exc,
            )
            return
        self.extended += 1
        if not present:
            # acknowledged, or handed out again already: nothing to extend
            self.forget(lease)


_extender: ProcessLocal[Extender] = ProcessLocal(Extender)
_enabled_apps: weakref.WeakSet[Any] = weakref.WeakSet()


def process_extender() -> Extender:
    """This process's :class:`Extender`, made anew after a fork."""
    return _extender.get()


def stop() -> None:
    """Stop this process's extension thread, if it runs (``celery_leases.stop``)."""
    extender = _extender.made()
    if extender is not None:
        extender.stop()


def _on_claimed(sender: Any, lease: Lease | None = None, **_: Any) -> None:
    if lease is None:
        return
    app = sender.app
    if app not in _enabled_apps:
        return
    transport = visibility_transport(app)
    delivery = delivery_of(sender.request, transport) if transport else None
    if delivery is not None:
        process_extender().watch(lease, app, delivery)


def _on_renewed(sender: Any, lease: Lease | None = None, **_: Any) -> None:
    if lease is not None:
        process_extender().request(lease)


def _on_ended(sender: Any, lease: Lease | None = None, **_: Any) -> None:
    if lease is not None:
        process_extender().forget(lease)


def enable(app: Any) -> None:
    """Extend the visibility of ``app``'s leased messages from now on (idempotent).

    The worker's bootstep calls it when ``leases_broker_keep_invisible`` is
    set, before the pool forks, so every pool process inherits it.
    """
    _enabled_apps.add(app)
    uid = "celery_leases.broker_visibility"
    signals.lease_claimed.connect(_on_claimed, weak=False, dispatch_uid=f"{uid}.claimed")
    signals.lease_renewed.connect(_on_renewed, weak=False, dispatch_uid=f"{uid}.renewed")
    for signal in (
        signals.lease_completed,
        signals.lease_released,
        signals.lease_lost,
        signals.lease_fenced_out,
    ):
        signal.connect(_on_ended, weak=False, dispatch_uid=f"{uid}.{signal.name}")
