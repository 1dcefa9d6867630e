"""Senders in many processes at once: exactly one publishes per key.

Eight processes (started with ``spawn``, each with its own app and store
handle, as separate web processes would be) wait at a barrier and then all
send the same key at once, round after round, each round a new key. The
broker is a real Redis; the lease store is Redis, PostgreSQL, SQLite (one
file, its write lock shared by the processes) or MariaDB.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.synchronize import Barrier
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


def sender(
    broker: str,
    queue: str,
    store: str,
    store_options: dict[str, Any],
    barrier: Barrier,
    outbox: multiprocessing.Queue[tuple[int, str, bool]],
) -> None:
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


@pytest.mark.parametrize(
    "store_kind",
    ["redis", "postgres", "sqlite", pytest.param("mysql", marks=pytest.mark.mysql)],
)
def test_senders_at_once_publish_one_message_per_key(
    redis_server: RedisServer,
    store_url: tuple[str, dict[str, Any]],
    open_test_store: StoreFactory,
    unique: str,
) -> None:
    url, options = store_url
    open_test_store()  # a SQL store makes its table before the senders start
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(SENDERS)
    outbox: multiprocessing.Queue[tuple[int, str, bool]] = context.Queue()
    broker, queue = redis_server.url, f"race{unique}"
    processes = [
        context.Process(target=sender, args=(broker, queue, url, options, barrier, outbox))
        for _ in range(SENDERS)
    ]
    for process in processes:
        process.start()
    answers = [outbox.get(timeout=WAIT) for _ in range(SENDERS * ROUNDS)]
    for process in processes:
        process.join(timeout=WAIT)
        assert process.exitcode == 0
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
