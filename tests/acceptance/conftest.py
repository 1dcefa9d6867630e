"""Fixtures for the acceptance tier: a broker database, a lease store and
real ``celery worker`` processes per test.

Every test gets its own Redis database on the session ``redis_server`` for the
broker, result backend and side channel (flushed first), its own queue, and
its own store namespace (Redis key prefix, or SQL table). A test parametrized
indirectly over ``broker_kind`` (``"amqp"``, ``"sqs"``) has its broker on the
session's RabbitMQ node or local SQS server instead, each started only when a
test asks for it; backend and side channel stay on Redis. Worker logs of a
failed test are shown in its report.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from celery_leases import LeaseRecord, LeaseStore, open_store
from tests.acceptance.app import AcceptanceConfig, make_app
from tests.acceptance.harness import SideChannel, Worker, stop_workers, wait_until
from tests.broker_servers import RabbitServer, SqsServer
from tests.conftest import serve
from tests.servers import MariadbServer, PostgresServer, RedisServer

# Databases 1-15 take turns (0 belongs to the other tiers' key prefixes);
# each is flushed before a test uses it.
_BROKER_DBS = itertools.cycle(range(1, 16))

#: lines of each worker log shown in a failed test's report
_LOG_TAIL = 300


@dataclasses.dataclass
class StoreTarget:
    """A lease store URL and options the workers and the test share."""

    kind: str
    url: str
    options: dict[str, Any]


@pytest.fixture
def lease_store_target(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> StoreTarget:
    """Redis by default; parametrize indirectly with postgres, sqlite or mysql."""
    kind = getattr(request, "param", "redis")
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return StoreTarget(kind, server.url, {"prefix": f"acc{unique}:"})
    if kind == "postgres":
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        return StoreTarget(kind, pg.url, {"table_name": f"acc_{unique}"})
    if kind == "mysql":
        mariadb: MariadbServer = request.getfixturevalue("mariadb_server")
        return StoreTarget(kind, mariadb.url, {"table_name": f"acc_{unique}"})
    if kind == "sqlite":
        path = tmp_path / "leases.db"
        return StoreTarget(kind, f"sqlite:///{path}", {"table_name": f"acc_{unique}"})
    raise AssertionError(f"unknown store kind {kind!r}")


class Cluster:
    """Workers, a client app, the lease store and the side channel of a test.

    Args:
        config: the base configuration; :meth:`worker` may override fields.
        log_dir: where worker logs go.
    """

    def __init__(self, config: AcceptanceConfig, log_dir: Path) -> None:
        self.config = config
        self.log_dir = log_dir
        self.workers: list[Worker] = []
        self.side = SideChannel(config.side)
        self._apps: list[Celery] = []
        self._stores: list[LeaseStore] = []
        self._client: Celery | None = None

    def configure(self, **changes: Any) -> None:
        """Change the configuration of the workers and apps made from now on."""
        self.config = dataclasses.replace(self.config, **changes)

    @property
    def client(self) -> Celery:
        """A client app on the test's broker, backend and store."""
        if self._client is None:
            self._client = self.new_app()
        return self._client

    def new_app(self) -> Celery:
        """A fresh app (own broker and backend connections)."""
        celery_app = make_app(self.config)
        self._apps.append(celery_app)
        return celery_app

    @property
    def store(self) -> LeaseStore:
        """A handle on the lease store the workers use."""
        if not self._stores:
            self._stores.append(open_store(self.config.store, **self.config.store_options))
        return self._stores[0]

    def worker(
        self,
        name: str,
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        start: bool = True,
        extra_args: tuple[str, ...] = (),
        app: str = "tests.acceptance.app",
        env: dict[str, str] | None = None,
        **changes: Any,
    ) -> Worker:
        """A worker on this test's queue, started unless ``start=False``.

        ``changes`` override fields of the configuration for this worker;
        ``app`` is its ``-A`` module and ``env`` more variables for it.
        """
        config = dataclasses.replace(self.config, **changes)
        worker = Worker(
            f"{name}-{config.queue}",
            {**config.to_env(), **(env or {})},
            self.log_dir,
            pool=pool,
            concurrency=concurrency,
            queue=config.queue,
            app=app,
            extra_args=extra_args,
        )
        self.workers.append(worker)
        if start:
            worker.start()
        return worker

    def send(self, task_name: str, *args: Any, **options: Any) -> AsyncResult:
        """Send ``task_name`` with positional ``args`` to the test's queue."""
        return self.client.send_task(task_name, args=args, queue=self.config.queue, **options)

    def record(self, job_id: str) -> LeaseRecord | None:
        return self.store.get(job_id)

    def wait_record(
        self, job_id: str, *, timeout: float, message: str, **expected: Any
    ) -> LeaseRecord:
        """Wait until the job's record has every attribute in ``expected``."""

        def probe() -> LeaseRecord | None:
            record = self.store.get(job_id)
            if record is None:
                return None
            if all(getattr(record, key) == value for key, value in expected.items()):
                return record
            return None

        return wait_until(probe, timeout=timeout, message=message)

    def assert_not_held_past_ttl(self, job_id: str, *, since: float) -> LeaseRecord | None:
        """Check the job has no live holder once a TTL passed after ``since``.

        ``since`` is a ``time.monotonic()`` instant after which no worker
        could renew the lease any more (it was released, or its holder was
        stopped). The store is polled until then plus the TTL and a margin.
        """
        deadline = since + self.config.ttl + 2.0

        def probe() -> tuple[LeaseRecord | None] | None:
            record = self.store.get(job_id)
            if record is None or not record.is_live(self.store.now_ms()):
                return (record,)
            return None

        (record,) = wait_until(
            probe,
            timeout=max(deadline - time.monotonic(), 0.1),
            message=f"the lease of {job_id} to be released or run out",
        )
        return record

    def close(self) -> None:
        stop_workers(self.workers)
        for celery_app in self._apps:
            celery_app.close()
        for store in self._stores:
            store.close()
        self.side.close()


@pytest.fixture
def store_server() -> Iterator[RedisServer]:
    """A redis-server of its own for the lease store, which a test may
    freeze, stop or restart while the broker keeps working."""
    yield from serve(RedisServer)


@pytest.fixture
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Redis by default; parametrize indirectly with ``"amqp"`` or ``"sqs"``."""
    return str(getattr(request, "param", "redis"))


@pytest.fixture
def broker_url(request: pytest.FixtureRequest, broker_kind: str, redis_db_url: str) -> str:
    """The broker of the test: the Redis database, or the session's RabbitMQ or SQS."""
    if broker_kind == "redis":
        return redis_db_url
    if broker_kind == "amqp":
        rabbit: RabbitServer = request.getfixturevalue("rabbit_server")
        return rabbit.url
    if broker_kind == "sqs":
        sqs: SqsServer = request.getfixturevalue("sqs_server")
        return sqs.url
    raise AssertionError(f"unknown broker kind {broker_kind!r}")


@pytest.fixture
def redis_db_url(redis_server: RedisServer) -> str:
    """A flushed Redis database for the result backend and side channel (and
    the broker, unless the test runs on another one)."""
    db = next(_BROKER_DBS)
    url = f"redis://127.0.0.1:{redis_server.port}/{db}"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest,
    broker_url: str,
    redis_db_url: str,
    lease_store_target: StoreTarget,
    tmp_path: Path,
    unique: str,
) -> Iterator[Cluster]:
    """Everything one acceptance test needs; workers stop at teardown."""
    config = AcceptanceConfig(
        broker=broker_url,
        backend=redis_db_url,
        side=redis_db_url,
        queue=f"q{unique}",
        store=lease_store_target.url,
        store_options=lease_store_target.options,
        ttl=2.0,
    )
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    built = Cluster(config, log_dir)
    try:
        yield built
    finally:
        built.close()
        for worker in built.workers:
            tail = "\n".join(worker.log().splitlines()[-_LOG_TAIL:])
            request.node.add_report_section("teardown", f"log of worker {worker.name}", tail)
