"""docs/examples/fenced_http_task.py, which the fencing guide shows whole: its
task writes to the example's HTTP service (docs/examples/fenced_service.py)
in a worker of this process, on a real Redis lease store."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from celery_leases import LeaseState, LeaseStore
from tests.docs.test_fencing_examples import WAIT, load
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[Any, str]]:
    example = load("fenced_service")
    app = example.ValueService()
    server, _ = example.serve_in_thread(app)
    yield app, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def example(redis_server: RedisServer, service: tuple[Any, str]) -> ModuleType:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FENCING_BROKER", "memory://")  # the worker of this process
        patch.setenv("FENCING_STORE", redis_server.url)
        patch.setenv("FENCING_SERVICE", service[1])
        module = load("fenced_http_task")
    module.app.conf.result_backend = "cache+memory://"
    return module


@pytest.fixture
def leases_app(example: ModuleType) -> Any:
    return example.app


@pytest.fixture
def lease_store_url(example: ModuleType) -> str:
    return str(example.app.conf.leases_store)


@pytest.mark.usefixtures("leases_worker")
def test_the_http_task_writes_with_its_fencing_headers(
    example: ModuleType, service: tuple[Any, str], lease_store: LeaseStore
) -> None:
    result = example.publish.delay("greeting", "hello")
    assert result.get(timeout=WAIT) == 200
    assert service[0].values["greeting"] == b"hello"
    record = lease_store.get(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
