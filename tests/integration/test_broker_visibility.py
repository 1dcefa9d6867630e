"""Visibility extensions on kombu's Redis transport, against a real redis-server.

A message is taken from a kombu queue and left unacknowledged, so it sits
in the transport's ``unacked_index`` under its delivery tag, scored by its
delivery time; the test ages that score and watches the
:class:`~celery_leases.broker_visibility.Extender` move it back to now. The
lease is only the extender's input (held or lost): a memory-store claim.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection

from celery_leases.broker_visibility import Delivery, Extender, delivery_of
from celery_leases.errors import LeaseLost
from celery_leases.lease import Lease
from celery_leases.settings import LeaseTiming
from celery_leases.stores.memory import MemoryStore
from tests.acceptance.harness import wait_until
from tests.broker_servers import SqsServer
from tests.servers import RedisServer, SentinelGroup

TIMING = LeaseTiming(ttl=30.0, renew_interval=10.0, drift_margin=1.0)
#: how far back the test ages a delivery (seconds)
AGE = 1000.0


@pytest.fixture
def extender() -> Iterator[Extender]:
    extender = Extender()
    yield extender
    extender.stop()


def _app(url: str, unique: str, **transport_options: Any) -> Celery:
    app = Celery(f"visibility{unique}", set_as_current=False, broker=url)
    app.conf.broker_transport_options = transport_options
    return app


def _lease(job_id: str, kind: type[Lease] = Lease) -> Lease:
    store = MemoryStore()
    claim = store.claim(job_id, "host:1:abc", TIMING.ttl, task_name="job")
    return kind(
        job_id=job_id, owner="host:1:abc", generation=claim.generation,
        lease_until_ms=claim.lease_until_ms, store=store, started_at=time.monotonic(),
        timing=TIMING, task_name="job",
    )  # fmt: skip


class _Marker(Lease):
    """A lease that reads as lost (the extender skips it, asking the broker
    nothing) and notes when the extender looks at it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.looked_at = threading.Event()

    @property
    def lost(self) -> bool:
        self.looked_at.set()
        return True


def _handled_so_far(extender: Extender, app: Celery) -> None:
    """Wait until the extender has handled every request made before this call.

    Its one thread handles requests in the order they came: once it has
    looked at a marker requested now, it has handled all of them.
    """
    marker = _lease("marker", _Marker)
    assert isinstance(marker, _Marker)
    extender.watch(marker, app, Delivery("marker"))
    assert marker.looked_at.wait(timeout=10), "the extender never reached the marker"
    extender.forget(marker)


class Unacked:
    """A message delivered from a kombu queue and not acknowledged (yet)."""

    def __init__(self, app: Celery, queue: str, direct_url: str | None = None) -> None:
        self.connection: Connection = app.connection_for_read()
        self.queue = self.connection.SimpleQueue(queue)
        self.queue.put({"job": queue})
        self.message = self.queue.get(timeout=5)
        channel = self.connection.default_channel
        # the index's full name: kombu's client adds the prefix to ZADD, not ZSCORE
        self.index = channel.global_keyprefix + channel.unacked_index_key
        self.client: redis.Redis = redis.Redis.from_url(direct_url or str(app.conf.broker_url))

    @property
    def tag(self) -> str:
        return str(self.message.delivery_tag)

    def score(self) -> float | None:
        return self.client.zscore(self.index, self.tag)

    def age(self) -> float:
        """Move the delivery time back by :data:`AGE`; returns the new score."""
        aged = time.time() - AGE
        self.client.zadd(self.index, {self.tag: aged}, xx=True)
        return aged

    def close(self) -> None:
        self.client.close()
        self.queue.close()
        self.connection.release()


@pytest.fixture
def unacked(redis_server: RedisServer, unique: str) -> Iterator[Callable[..., Unacked]]:
    made: list[Unacked] = []

    def make(app: Celery | None = None, direct_url: str | None = None) -> Unacked:
        app = app or _app(redis_server.url, unique)
        message = Unacked(app, f"q{unique}{len(made)}", direct_url)
        made.append(message)
        return message

    yield make
    for message in made:
        message.close()


def _extended(message: Unacked, before: float) -> Callable[[], bool]:
    return lambda: (message.score() or 0.0) > before + AGE / 2


def test_an_extension_moves_the_delivery_to_now(
    redis_server: RedisServer, unique: str, unacked: Callable[..., Unacked], extender: Extender
) -> None:
    app = _app(redis_server.url, unique)
    message = unacked(app)
    aged = message.age()
    lease = _lease("j1")
    extender.watch(lease, app, Delivery(message.tag))
    wait_until(_extended(message, aged), timeout=10, message="the delivery to be extended")
    # each renewal asks again
    aged = message.age()
    extender.request(lease)
    wait_until(_extended(message, aged), timeout=10, message="the second extension")
    # the count moves just after the call returns
    wait_until(lambda: extender.extended == 2, timeout=10, message="two extensions counted")


def test_the_global_key_prefix_and_index_name_are_those_of_the_transport(
    redis_server: RedisServer, unique: str, unacked: Callable[..., Unacked], extender: Extender
) -> None:
    app = _app(
        redis_server.url,
        unique,
        global_keyprefix=f"p{unique}:",
        unacked_index_key=f"idx{unique}",
    )
    message = unacked(app)
    assert message.index == f"p{unique}:idx{unique}"
    assert message.score() is not None
    aged = message.age()
    extender.watch(_lease("j1"), app, Delivery(message.tag))
    wait_until(_extended(message, aged), timeout=10, message="the prefixed index to move")
    assert message.client.zscore("unacked_index", message.tag) is None


def test_a_sentinel_broker_is_reached_through_its_sentinels(
    sentinel_group: SentinelGroup,
    unique: str,
    unacked: Callable[..., Unacked],
    extender: Extender,
) -> None:
    app = _app(sentinel_group.url, unique, master_name=SentinelGroup.MASTER_NAME)
    master = sentinel_group.master_port()
    message = unacked(app, direct_url=f"redis://127.0.0.1:{master}/0")
    aged = message.age()
    extender.watch(_lease("j1"), app, Delivery(message.tag))
    wait_until(_extended(message, aged), timeout=10, message="the master's index to move")


def test_a_lost_lease_extends_its_message_no_more(
    redis_server: RedisServer, unique: str, unacked: Callable[..., Unacked], extender: Extender
) -> None:
    app = _app(redis_server.url, unique)
    lost_message, held_message = unacked(app), unacked(app)
    lost_aged, held_aged = lost_message.age(), held_message.age()
    lost = _lease("lost")
    lost.mark_lost(LeaseLost("gone", job_id="lost", owner=lost.owner, generation=1))
    extender.watch(lost, app, Delivery(lost_message.tag))
    # asked after the lost one: once it is extended, the lost one was seen
    extender.watch(_lease("held"), app, Delivery(held_message.tag))
    wait_until(_extended(held_message, held_aged), timeout=10, message="the held lease's message")
    wait_until(lambda: extender.extended, timeout=10, message="the extension counted")
    assert lost_message.score() == pytest.approx(lost_aged)
    assert extender.extended == 1


def test_an_acknowledged_message_is_not_written_back(
    redis_server: RedisServer, unique: str, unacked: Callable[..., Unacked], extender: Extender
) -> None:
    app = _app(redis_server.url, unique)
    message, other = unacked(app), unacked(app)
    other_aged = other.age()
    message.message.ack()
    assert message.score() is None
    lease = _lease("acked")
    extender.watch(lease, app, Delivery(message.tag))
    extender.watch(_lease("other"), app, Delivery(other.tag))
    wait_until(_extended(other, other_aged), timeout=10, message="the other message")
    wait_until(lambda: extender.extended == 2, timeout=10, message="both tries counted")
    assert message.score() is None
    # nothing left to extend: later renewals ask for nothing
    extender.request(lease)
    _handled_so_far(extender, app)
    assert message.score() is None
    assert extender.extended == 2


def test_an_unreachable_broker_is_logged_and_never_raised(
    unique: str, extender: Extender, caplog: pytest.LogCaptureFixture
) -> None:
    # nothing listens on port 1
    app = _app("redis://127.0.0.1:1/0", unique)
    with caplog.at_level(logging.WARNING, logger="celery_leases"):
        extender.watch(_lease("j1"), app, Delivery("tag"))
        wait_until(lambda: extender.failed, timeout=30, message="the failed try to be counted")
        # the try is counted before the warning is logged, on the extender's thread
        wait_until(
            lambda: "could not keep the message of job 'j1' invisible" in caplog.text,
            timeout=10,
            message="the warning",
        )


def test_a_broker_that_hangs_holds_nobody_who_asks(
    lease_server: RedisServer, unique: str, unacked: Callable[..., Unacked], extender: Extender
) -> None:
    # a redis-server of this test alone (the conftest's), free to be frozen
    broker_server = lease_server
    app = _app(broker_server.url, unique)
    message = unacked(app)
    lease = _lease("j1")
    extender.watch(lease, app, Delivery(message.tag))
    wait_until(lambda: extender.extended, timeout=10, message="the first extension")
    assert broker_server.proc is not None
    broker_server.proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(50):
            extender.request(lease)  # returns at once: the thread waits, not the caller
        # the call in flight gives up within its socket timeout
        wait_until(lambda: extender.failed, timeout=30, message="the hanging call to give up")
        assert extender.extended == 1
    finally:
        broker_server.proc.send_signal(signal.SIGCONT)
    aged = message.age()
    extender.request(lease)
    wait_until(_extended(message, aged), timeout=30, message="an extension after the thaw")


# --- SQS, against a local server ---------------------------------------------------

SQS_VISIBILITY = 2


def _sqs_app(server: SqsServer, unique: str) -> Celery:
    app = Celery(f"visibility-sqs{unique}", set_as_current=False, broker=server.url)
    app.conf.broker_transport_options = {
        "region": "us-east-1",
        "is_secure": False,
        "visibility_timeout": SQS_VISIBILITY,
        "wait_time_seconds": 1,
    }
    return app


@contextmanager
def _sqs_delivered(app: Celery, name: str) -> Iterator[tuple[Any, Any, Delivery]]:
    """(queue, message, delivery) of one message received and not acknowledged."""
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(name)
        try:
            queue.put({"job": name})
            message = queue.get(timeout=10)
            delivery = delivery_of(SimpleNamespace(properties=message.properties), "sqs")
            assert delivery is not None
            yield queue, message, delivery
        finally:
            queue.close()


def test_on_sqs_extensions_keep_a_message_from_the_next_receiver(
    sqs_server: SqsServer, unique: str, extender: Extender
) -> None:
    app = _sqs_app(sqs_server, unique)
    with _sqs_delivered(app, f"q{unique}") as (queue, _, delivery):
        lease = _lease("j1")
        extender.watch(lease, app, delivery)
        # renewals for two visibility timeouts: nobody else receives it
        end = time.monotonic() + 2 * SQS_VISIBILITY
        while time.monotonic() < end:
            extender.request(lease)
            time.sleep(0.4)
        wait_until(lambda: extender.extended >= 4, timeout=10, message="the extensions")
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)
        # no more renewals: it comes back after one visibility timeout
        extender.forget(lease)
        again = queue.get(timeout=SQS_VISIBILITY + 5)
        assert again.payload == {"job": f"q{unique}"}
        assert extender.failed == 0
        again.ack()


def test_on_sqs_an_acknowledged_message_is_let_go_without_a_warning(
    sqs_server: SqsServer, unique: str, extender: Extender, caplog: pytest.LogCaptureFixture
) -> None:
    app = _sqs_app(sqs_server, unique)
    with _sqs_delivered(app, f"q{unique}") as (_, message, delivery):
        message.ack()  # deletes it: its receipt handle is invalid from now on
        lease = _lease("j1")
        with caplog.at_level(logging.WARNING, logger="celery_leases"):
            extender.watch(lease, app, delivery)
            wait_until(lambda: extender.extended, timeout=10, message="the try")
            extender.request(lease)  # forgotten: nothing is asked
            _handled_so_far(extender, app)
        assert (extender.extended, extender.failed) == (1, 0)
        assert "invisible" not in caplog.text
