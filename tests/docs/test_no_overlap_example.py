"""The beat job of docs/examples/no_overlap.py, which docs/howto/no-overlap.md
shows, in a worker of this process on a real Redis lease store."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_leases import LeaseSkipped, LeaseState, LeaseStore
from tests.acceptance.harness import wait_until
from tests.by_path import load_file
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "no_overlap.py"
WAIT = 30.0


@pytest.fixture
def example() -> ModuleType:
    return load_file("no_overlap", EXAMPLE)


@pytest.fixture
def leases_app(example: ModuleType, unique: str) -> Iterator[Any]:
    app = example.app
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        leases_store_options={"prefix": f"docs{unique}:"},
    )
    yield app
    app.close()


@pytest.fixture
def lease_store_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def leases_worker_parameters() -> Mapping[str, Any]:
    return {"pool": "threads", "concurrency": 2}


@pytest.mark.usefixtures("leases_worker")
def test_a_call_while_the_job_runs_is_skipped_and_the_next_one_runs(
    example: ModuleType, lease_store: LeaseStore
) -> None:
    running = example.refresh_prices.delay(5.0)
    held = wait_until(
        lambda: (r := lease_store.get("refresh-prices")) and r.state is LeaseState.HELD and r,
        timeout=WAIT,
        message="the first call's lease",
    )
    with pytest.raises(LeaseSkipped, match=f"held by task {running.id}") as raised:
        example.refresh_prices.delay(0.0).get(timeout=WAIT)
    raised.value.with_traceback(None)  # its frames would keep the result alive
    assert example.refresh_now().startswith("not run: task prices.refresh[")
    assert not running.ready()  # both answered while the run goes on
    assert running.get(timeout=WAIT) == {"generation": held.generation}
    after = example.refresh_prices.delay(0.0).get(timeout=WAIT)
    assert after["generation"] > held.generation
