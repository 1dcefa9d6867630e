"""Fixtures of the in-process worker tests: an app factory, a signal recorder, a worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_leases import signals
from celery_leases.task import forget_runtime
from tests.conftest import serve
from tests.servers import MariadbServer, PostgresServer, RedisServer, SentinelGroup

WAIT = 30.0  # generous: the machine is shared


class Recorder:
    """What task bodies and signal receivers saw, across threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, Any]] = []

    def add(self, kind: str, value: Any = None) -> None:
        with self.lock:
            self.events.append((kind, value))

    def of(self, kind: str) -> list[Any]:
        with self.lock:
            return [value for k, value in self.events if k == kind]

    def wait(self, kind: str, count: int = 1, timeout: float = WAIT) -> list[Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.of(kind)) >= count:
                return self.of(kind)
            time.sleep(0.02)
        raise AssertionError(f"waited {timeout} s for {count} x {kind!r}; saw {self.events!r}")


@pytest.fixture
def lease_server() -> Iterator[RedisServer]:
    """A redis-server of this test alone for the lease store, free to be stopped."""
    yield from serve(RedisServer)


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    """Redis master, replica and three sentinels of this test alone, ready."""
    for started in serve(SentinelGroup):
        started.wait_ready()
        yield started


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    recorder = Recorder()
    receivers = []
    for name in signals.__all__:
        signal = getattr(signals, name)

        def receive(sender: Any, _name: str = name, **kwargs: Any) -> None:
            recorder.add(_name, kwargs)

        signal.connect(receive, weak=False)
        receivers.append((signal, receive))
    yield recorder
    for signal, receive in receivers:
        signal.disconnect(receive)


@pytest.fixture
def make_app(redis_server: RedisServer, unique: str) -> Iterator[Callable[..., Celery]]:
    apps: list[Celery] = []

    def factory(store: str = "memory://", **conf: Any) -> Celery:
        app = Celery(f"leases{unique}{len(apps)}", set_as_current=False)
        app.conf.update(
            broker_url=redis_server.url,
            result_backend=redis_server.url,
            broker_connection_retry_on_startup=True,
            # no expiry: Celery's Redis backend would call setex, deprecated in redis-py 8
            result_expires=None,
            task_default_queue=f"q{unique}{len(apps)}",
            leases_store=store,
            leases_defer_backoff=0.2,
            leases_defer_max=1.0,
            **conf,
        )
        apps.append(app)
        return app

    yield factory
    for app in apps:
        forget_runtime(app)


@contextmanager
def worker(
    app: Celery, pool: str = "solo", concurrency: int = 1, queues: list[str] | None = None
) -> Iterator[Any]:
    """A worker of ``app`` in a thread; it consumes ``queues``, else the default queue."""
    extra: dict[str, Any] = {} if queues is None else {"queues": queues}
    with start_worker(
        app,
        pool=pool,
        concurrency=concurrency,
        perform_ping_check=False,
        shutdown_timeout=30,
        **extra,
    ) as running:
        yield running


@pytest.fixture(params=["postgres", "sqlite", pytest.param("mysql", marks=pytest.mark.mysql)])
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of the session's PostgreSQL or MariaDB database, or of a fresh
    SQLite file (``leases.db`` in the test's folder)."""
    if request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        return server.url
    if request.param == "mysql":
        mariadb: MariadbServer = request.getfixturevalue("mariadb_server")
        return mariadb.url
    return f"sqlite:///{tmp_path / 'leases.db'}"
