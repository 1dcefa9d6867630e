"""Senders in many processes at once: exactly one publishes per key.

Eight processes (started with ``spawn`` once for the file, each with its
own app and store handle per test, as separate web processes would be) wait
at a barrier and then all send the same key at once, round after round, each
round a new key. The broker is a real Redis; the lease store is Redis,
PostgreSQL, SQLite (one file, its write lock shared by the processes) or
MariaDB.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from queue import Empty
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import LeasedTask
from tests.conftest import StoreFactory
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

SENDERS = 8
ROUNDS = 5
WAIT = 120.0
#: seconds an idle sender waits for its next test before it ends
IDLE = 300.0


def sender(
    inbox: multiprocessing.Queue[tuple[str, str, str, dict[str, Any]] | None],
    barrier: Barrier,
    outbox: multiprocessing.Queue[tuple[int, str, bool]],
) -> None:
    """Per test, take its broker, queue and store, make an app of them, and send
    one key per round at the barrier. ``None`` ends the loop."""
    while (test := inbox.get(timeout=IDLE)) is not None:
        broker, queue, store, store_options = test
        app = Celery("race", broker=broker, set_as_current=False)
        app.conf.update(
            task_default_queue=queue, leases_store=store, leases_store_options=store_options
        )

        @app.task(
            base=LeasedTask, bind=True, shared=False, name="race.report", lease_key="report-{key}",
            lease_queue_unique=True,
        )  # fmt: skip
        def report(self: Any, key: str) -> None:
            pass

        for round_ in range(ROUNDS):
            barrier.wait(timeout=WAIT)
            result = report.delay(f"r{round_}")
            outbox.put((round_, result.id, result.lease_coalesced))
        app.close()


@dataclass
class Senders:
    """The sender processes and their queues."""

    processes: list[BaseProcess]
    inboxes: list[multiprocessing.Queue[tuple[str, str, str, dict[str, Any]] | None]]
    outbox: multiprocessing.Queue[tuple[int, str, bool]]
    barrier: Barrier


@pytest.fixture(scope="module")
def senders() -> Iterator[Senders]:
    """The file's sender processes (starting eight is the slow part)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(SENDERS)
    outbox: multiprocessing.Queue[tuple[int, str, bool]] = context.Queue()
    inboxes: list[multiprocessing.Queue[tuple[str, str, str, dict[str, Any]] | None]] = [
        context.Queue() for _ in range(SENDERS)
    ]
    processes: list[BaseProcess] = [
        context.Process(target=sender, args=(inboxes[n], barrier, outbox), daemon=True)
        for n in range(SENDERS)
    ]
    for process in processes:
        process.start()
    yield Senders(processes, inboxes, outbox, barrier)
    for inbox in inboxes:
        inbox.put(None)
    barrier.abort()
    for process in processes:
        process.join(timeout=WAIT)
        assert process.exitcode == 0


@pytest.mark.parametrize(
    "store_kind",
    ["redis", "postgres", "sqlite", pytest.param("mysql", marks=pytest.mark.mysql)],
)
def test_senders_at_once_publish_one_message_per_key(
    senders: Senders,
    redis_server: RedisServer,
    store_url: tuple[str, dict[str, Any]],
    open_test_store: StoreFactory,
    unique: str,
) -> None:
    url, options = store_url
    open_test_store()  # a SQL store makes its table before the senders start
    broker, queue = redis_server.url, f"race{unique}"
    for inbox in senders.inboxes:
        inbox.put((broker, queue, url, options))
    try:
        answers = [senders.outbox.get(timeout=WAIT) for _ in range(SENDERS * ROUNDS)]
    except Empty:
        dead = [p.pid for p in senders.processes if not p.is_alive()]
        pytest.fail(f"the senders did not answer within {WAIT} s (dead: {dead})")
    for round_ in range(ROUNDS):
        sends = [(task_id, coalesced) for r, task_id, coalesced in answers if r == round_]
        assert len(sends) == SENDERS
        assert len({task_id for task_id, _ in sends}) == 1, sends
        assert sorted(coalesced for _, coalesced in sends) == [False] + [True] * (SENDERS - 1)
    client = redis.Redis.from_url(broker)
    try:
        assert client.llen(queue) == ROUNDS
    finally:
        client.close()
