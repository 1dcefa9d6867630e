"""Session-wide fixtures: throwaway servers and the store under test.

Locally, a server whose binaries are missing skips the tests that need it,
with a message. With ``CI=true`` it fails them instead, so CI can never pass
without really exercising Redis, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from celery_leases import LeaseStore, open_store
from celery_leases.runtime import close_after_notices
from tests.broker_servers import RabbitServer, SqsServer
from tests.servers import (
    MariadbServer,
    PostgresServer,
    RedisCluster,
    RedisServer,
    ServerMissing,
)
from tests.store_clock import StoreClock

#: the Django tests need Django configured, once per process: they run under
#: pytest-django in a process of their own (tests/integration/test_django.py)
collect_ignore = ["django_app"]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench",
        action="store_true",
        default=False,
        help="also run the benchmarks' long smoke profiles (marked bench)",
    )


#: the test files that take longest (their tests' time summed), longest first.
#: Under ``--dist loadfile --no-loadscope-reorder`` (scripts/test) the
#: processes take files in collection order, so these start first and the
#: short files fill in around them: no process is left running a long file
#: alone at the end. The other files keep their order after them.
LONGEST_FILES = (
    "tests/integration/test_django.py",
    "tests/chaos/test_chaos_run.py",
    "tests/integration/test_cli.py",
    "tests/acceptance/test_exactly_once.py",
    "tests/acceptance/test_keep_invisible.py",
    "tests/acceptance/test_no_overlap.py",
    "tests/integration/test_exactly_once.py",
    "tests/example/test_demo.py",
    "tests/integration/test_sql_timeouts.py",
    "tests/acceptance/test_exactly_once_time.py",
    "tests/acceptance/test_duplicates.py",
    "tests/packaging/test_extras.py",
    "tests/acceptance/test_worked_example.py",
    "tests/acceptance/test_green_pools.py",
)


def longest_first(items: list[pytest.Item]) -> None:
    """Put the tests of LONGEST_FILES first, in its order (a file's own tests
    keep theirs, and so do the other files)."""
    rank = {path: n for n, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_first(items)
    if config.getoption("bench"):
        return
    opt_in = pytest.mark.skip(reason="a benchmark's long smoke profile: run with --bench")
    for item in items:
        if item.get_closest_marker("bench") is not None:
            item.add_marker(opt_in)


STORE_KINDS = ["memory", "redis", "postgres", "sqlite", "mysql"]


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: a missing server fails the run)")
    pytest.skip(reason)


Server = TypeVar("Server", RedisServer, PostgresServer, RedisCluster, MariadbServer)


def serve(make: Callable[[], Server]) -> Generator[Server, None, None]:
    """Start a server for a fixture, skip (or fail in CI) if it is missing,
    and close it when the fixture ends."""
    try:
        server = make()
    except ServerMissing as exc:
        _unavailable(str(exc))
        raise  # unreachable: _unavailable raises
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the session (one DB per test is not needed:
    every test uses its own key prefix)."""
    yield from serve(RedisServer)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    yield from serve(PostgresServer)


@pytest.fixture(scope="session")
def store_clock() -> Iterator[StoreClock]:
    """The clock of the session's clocked servers, which the test sets (it
    only moves forward: each test starts past where the last one left it)."""
    try:
        clock = StoreClock()
    except ServerMissing as exc:
        _unavailable(str(exc))
        raise  # unreachable: _unavailable raises
    yield clock
    clock.close()


@pytest.fixture(scope="session")
def clocked_redis_server(store_clock: StoreClock) -> Iterator[RedisServer]:
    """A redis-server whose clock is ``store_clock``."""
    yield from serve(lambda: RedisServer(env=store_clock.env()))


@pytest.fixture(scope="session")
def clocked_postgres_server(store_clock: StoreClock) -> Iterator[PostgresServer]:
    """A PostgreSQL cluster whose clock is ``store_clock``."""
    yield from serve(lambda: PostgresServer(env=store_clock.env()))


@pytest.fixture(scope="session")
def rabbit_server() -> Iterator[RabbitServer]:
    """A private RabbitMQ node shared by the session (tests use their own queue)."""
    yield from serve(RabbitServer)


@pytest.fixture(scope="session")
def sqs_server() -> Iterator[SqsServer]:
    """A local SQS server shared by the session (tests use their own queue)."""
    yield from serve(SqsServer)


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[MariadbServer]:
    """A MariaDB server shared by the session (tests use their own tables)."""
    yield from serve(MariadbServer)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """3 masters and 3 replicas, shared by the session (tests use their own prefix)."""
    yield from serve(RedisCluster)


@pytest.fixture
def unique() -> str:
    """A short unique name for keys, prefixes and tables of one test."""
    return uuid.uuid4().hex[:10]


StoreFactory = Callable[[], LeaseStore]


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(
    store_kind: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> tuple[str, dict[str, str]]:
    """URL and options for a fresh, empty store of ``store_kind``."""
    if store_kind == "memory":
        return "memory://", {}
    if store_kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return server.url, {"prefix": f"t{unique}:"}
    if store_kind == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return cluster.url, {"prefix": f"t{unique}:"}
    if store_kind == "postgres":
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        return pg.url, {"table_name": f"leases_{unique}"}
    if store_kind == "mysql":
        mariadb: MariadbServer = request.getfixturevalue("mariadb_server")
        return mariadb.url, {"table_name": f"leases_{unique}"}
    if store_kind == "sqlite":
        return f"sqlite:///{tmp_path / 'leases.db'}", {"table_name": f"leases_{unique}"}
    raise AssertionError(store_kind)


@pytest.fixture
def open_test_store(store_url: tuple[str, dict[str, str]]) -> Iterator[StoreFactory]:
    """Opens further handles on the same store (another 'worker process')."""
    url, options = store_url
    opened: list[LeaseStore] = []
    shared: LeaseStore | None = None

    def factory() -> LeaseStore:
        nonlocal shared
        if url == "memory://":
            # one process: every handle is the same store
            if shared is None:
                shared = open_store(url)
                opened.append(shared)
            return shared
        store = open_store(url, **options)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        close_after_notices(store)  # a run's end may take waiters on the notifier


@pytest.fixture
def store(open_test_store: StoreFactory) -> LeaseStore:
    """A fresh, empty store of each kind (parametrized)."""
    return open_test_store()
