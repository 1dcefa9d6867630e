"""A one-process worker's Redis store gets a task pool as wide as the worker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_leases.pool_sizing import SPARE_CONNECTIONS, most_tasks, size_task_pool
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


@pytest.mark.parametrize("namespace", ["CELERY", "celery"])
def test_options_set_under_the_app_s_namespace_are_widened_where_they_are_read(
    namespace: str,
) -> None:
    app = Celery("sizing", set_as_current=False)
    app.config_from_object({}, namespace=namespace)
    assert app.conf.broker_url is None  # the configuration is read: the namespace applies
    key = f"{namespace}_leases_store_options"
    key = key.upper() if namespace.isupper() else key
    # set directly under the namespaced name, which Celery reads before the bare one
    app.conf[key] = {"prefix": "x:"}
    app.conf.leases_store = "redis://127.0.0.1:1/0"
    try:
        assert size_task_pool(app, "threads", 500) is None
        wanted = {"prefix": "x:", "max_connections": 500 + SPARE_CONNECTIONS}
        assert settings_for(app).store_options == wanted
        assert app.conf[key] == wanted
    finally:
        forget_runtime(app)
        app.close()


def test_options_it_cannot_replace_are_named_in_a_warning() -> None:
    app = Celery("sizing", set_as_current=False)
    app.config_from_object({}, namespace="CELERY")
    assert app.conf.broker_url is None  # the configuration is read: the namespace applies
    app.conf.CELERY_LEASES_STORE_OPTIONS = {"prefix": "x:"}
    app.conf.leases_store = "redis://127.0.0.1:1/0"
    app.namespace = None  # the configuration still reads the namespaced key first
    try:
        warning = size_task_pool(app, "threads", 500)
        assert warning is not None
        assert "could not give the Redis lease store's task pool max_connections=508" in warning
        assert dict(settings_for(app).store_options) == {"prefix": "x:"}
    finally:
        forget_runtime(app)
        app.close()


@pytest.mark.parametrize(
    ("url", "pool", "concurrency"),
    [
        ("redis://127.0.0.1:1/0", "prefork", 500),  # a task per child process
        ("redis://127.0.0.1:1/0", "solo", 1),
        ("redis://127.0.0.1:1/0", "threads", 100 - SPARE_CONNECTIONS),  # fits the default
        ("postgresql+psycopg://u@127.0.0.1:1/leases", "prefork", 500),
        ("postgresql+psycopg://u@127.0.0.1:1/leases", "threads", 15 - SPARE_CONNECTIONS),
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


@pytest.mark.parametrize(
    ("concurrency", "autoscale", "expected"),
    [
        (8, None, 8),
        (8, "500,10", 500),  # --autoscale as the command line gives it
        (8, (500, 10), 500),
        (8, [500, 10], 500),
        (600, "500,10", 600),
        (8, "not,a number", 8),  # Celery's pool step says what is wrong
        (8, (), 8),
    ],
)
def test_autoscale_s_maximum_counts_as_the_worker_s_tasks(
    concurrency: int, autoscale: object, expected: int
) -> None:
    assert most_tasks(concurrency, autoscale) == expected


def test_a_pool_size_in_the_url_is_kept_and_one_too_small_named(app: Celery) -> None:
    # redis-py reads the URL's max_connections over the options
    app.conf.leases_store = "redis://127.0.0.1:1/0?max_connections=50"
    warning = size_task_pool(app, "threads", 200)
    assert warning is not None
    assert "max_connections=50, below the worker's concurrency (200)" in warning
    assert dict(app.conf.leases_store_options) == {"prefix": "x:"}


def test_a_setting_mistake_is_left_to_the_start_check_s_message() -> None:
    # the start check names the mistake with its "did you mean" hint. (An app
    # of its own: Celery 5.3 keeps a key deleted from a configuration not yet read.)
    app = Celery("sizing", set_as_current=False)
    app.conf.leases_stor = "redis://127.0.0.1:1/0"
    app.conf.leases_store_options = {"prefix": "x:"}
    try:
        assert size_task_pool(app, "threads", 500) is None
        assert dict(app.conf.leases_store_options) == {"prefix": "x:"}
    finally:
        forget_runtime(app)
        app.close()


def test_a_pool_patched_by_gevent_counts_as_one_process(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a custom pool class whose name says nothing, in a gevent-patched process
    monkeypatch.setattr("celery_leases.unpatched.green_library", lambda: "gevent")
    size_task_pool(app, "<class 'proj.pools.Pool'>", 500)
    assert app.conf.leases_store_options["max_connections"] == 500 + SPARE_CONNECTIONS


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u@127.0.0.1:1/leases",
        "mariadb+pymysql://u@127.0.0.1:1/leases",
        "sqlite:///leases.db",
    ],
)
@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_a_one_process_pool_wider_than_sqlalchemy_s_pool_widens_it(
    app: Celery, url: str, pool: str
) -> None:
    app.conf.leases_store = url
    assert size_task_pool(app, pool, 20) is None
    assert dict(app.conf.leases_store_options) == {
        "prefix": "x:",
        "pool_size": 20 + SPARE_CONNECTIONS,
    }
    assert settings_for(app).store_options["pool_size"] == 20 + SPARE_CONNECTIONS


@pytest.mark.parametrize(
    ("options", "warned"),
    [
        ({"pool_size": 5}, "holds 15 connections"),
        ({"max_overflow": 0}, "holds 5 connections"),
        ({"pool_size": 10, "max_overflow": 5}, "holds 15 connections"),
        ({"pool_size": 30, "max_overflow": 0}, None),
        ({"max_overflow": -1}, None),  # no limit
    ],
)
def test_a_sql_pool_the_user_sized_is_kept_and_one_too_small_named(
    app: Celery, options: dict[str, int], warned: str | None
) -> None:
    app.conf.leases_store = "postgresql+psycopg://u@127.0.0.1:1/leases"
    app.conf.leases_store_options = options
    warning = size_task_pool(app, "threads", 20)
    if warned is None:
        assert warning is None
    else:
        assert warning is not None
        assert warned in warning
        assert "below the worker's concurrency (20)" in warning
    assert dict(app.conf.leases_store_options) == options


def test_a_sql_store_without_sqlalchemy_is_left_to_the_start_check() -> None:
    """The pool is sized before the start check, which names the package to
    install: without SQLAlchemy the sizing steps aside instead of failing
    with an ImportError (a process of its own, where SQLAlchemy cannot be
    imported)."""
    script = (
        "import sys; sys.modules['sqlalchemy'] = None\n"
        "from celery import Celery\n"
        "from celery_leases.pool_sizing import size_task_pool\n"
        "from celery_leases.stores import open_store\n"
        "from celery_leases.errors import LeaseConfigurationError\n"
        "app = Celery('sizing', set_as_current=False)\n"
        "app.conf.leases_store = 'postgresql+psycopg://u@127.0.0.1:1/leases'\n"
        "print(size_task_pool(app, 'threads', 20))\n"
        "try:\n"
        "    open_store(app.conf.leases_store)\n"
        "except LeaseConfigurationError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    sized, refused = done.stdout.splitlines()
    assert sized == "None"
    assert "pip install" in refused
