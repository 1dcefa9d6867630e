"""The task and sender of docs/examples/queue_unique.py, which the
queue-unique guide shows, with a real Redis broker and store and a worker
of this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from celery_leases.task import forget_runtime
from tests.by_path import load_file
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "queue_unique.py"
WAIT = 30.0


@pytest.fixture
def example(redis_server: RedisServer, unique: str) -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUEUE_UNIQUE_BROKER", redis_server.url)
        patch.setenv("QUEUE_UNIQUE_STORE", redis_server.url)
        module = load_file("queue_unique_example", EXAMPLE)
    module.app.conf.task_default_queue = f"reindex{unique}"
    module.app.conf.leases_store_options = {"prefix": f"doc{unique}:"}
    yield module
    forget_runtime(module.app)
    module.app.close()


def test_a_burst_of_saves_queues_one_reindex_that_runs_once(
    example: ModuleType, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    results = [example.on_profile_saved(42) for _ in range(5)]
    assert [r.lease_coalesced for r in results] == [False, True, True, True, True]
    assert {r.id for r in results} == {results[0].id}
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert client.llen(example.app.conf.task_default_queue) == 1
    finally:
        client.close()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"user 42: reindex queued as {results[0].id}"
    assert printed[1] == f"user 42: reindex already queued as {results[0].id}"
    with start_worker(example.app, pool="solo", perform_ping_check=False):
        assert results[0].get(timeout=WAIT).startswith("reindexed 42 (generation ")
        again = example.on_profile_saved(42)
        assert not again.lease_coalesced
        assert again.id != results[0].id
        assert again.get(timeout=WAIT).startswith("reindexed 42")
