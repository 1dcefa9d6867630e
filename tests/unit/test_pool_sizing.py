"""A one-process worker's Redis store gets a task pool as wide as the worker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_leases.pool_sizing import SPARE_CONNECTIONS, size_task_pool
from celery_leases.runtime import settings_for
from celery_leases.task import forget_runtime


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("sizing", set_as_current=False)
    app.conf.leases_store = "redis://127.0.0.1:1/0"
    app.conf.leases_store_options = {"prefix": "x:"}
    yield app
    forget_runtime(app)
    app.close()


@pytest.mark.parametrize(
    "pool", ["threads", "gevent", "eventlet", "<class 'celery.concurrency.thread.TaskPool'>"]
)
def test_a_one_process_pool_wider_than_redis_py_s_pool_widens_it(app: Celery, pool: str) -> None:
    settings_for(app)  # read before the worker's step, as the CLI options' check does
    assert size_task_pool(app, pool, 500) is None
    assert dict(app.conf.leases_store_options) == {
        "prefix": "x:",
        "max_connections": 500 + SPARE_CONNECTIONS,
    }
    # the settings are read again: the store opens with the option
    assert settings_for(app).store_options["max_connections"] == 500 + SPARE_CONNECTIONS


@pytest.mark.parametrize(
    ("url", "pool", "concurrency"),
    [
        ("redis://127.0.0.1:1/0", "prefork", 500),  # a task per child process
        ("redis://127.0.0.1:1/0", "solo", 1),
        ("redis://127.0.0.1:1/0", "threads", 100 - SPARE_CONNECTIONS),  # fits the default
        ("postgresql+psycopg://u@127.0.0.1:1/leases", "threads", 500),  # a pool that waits
        ("memory://", "threads", 500),
    ],
)
def test_other_workers_and_stores_keep_their_options(
    app: Celery, url: str, pool: str, concurrency: int
) -> None:
    app.conf.leases_store = url
    assert size_task_pool(app, pool, concurrency) is None
    assert dict(app.conf.leases_store_options) == {"prefix": "x:"}


def test_a_cluster_or_sentinel_url_is_widened_too(app: Celery) -> None:
    app.conf.leases_store = "redis+cluster://127.0.0.1:1/0"
    size_task_pool(app, "gevent", 1000)
    assert app.conf.leases_store_options["max_connections"] == 1000 + SPARE_CONNECTIONS


def test_a_pool_size_the_user_set_is_kept_and_one_too_small_named(app: Celery) -> None:
    app.conf.leases_store_options = {"max_connections": 50}
    warning = size_task_pool(app, "threads", 200)
    assert warning is not None
    assert "max_connections=50, below the worker's concurrency (200)" in warning
    assert dict(app.conf.leases_store_options) == {"max_connections": 50}
    app.conf.leases_store_options = {"max_connections": 300}
    forget_runtime(app)
    assert size_task_pool(app, "threads", 200) is None
    assert dict(app.conf.leases_store_options) == {"max_connections": 300}
