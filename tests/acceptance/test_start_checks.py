"""The worker asks the lease store once at start: real ``celery worker`` processes.

An unreachable store only warns (claims are deferred until it is back); a
store that refuses the worker for good stops it at start, with a message
that names what to change and never shows a password.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.conftest import Cluster
from tests.conftest import serve
from tests.servers import RedisServer, free_port

#: the password the server wants, and the wrong one the worker sends
SERVER_PASSWORD = "server-side-pw-4711"  # a throwaway test server's password
WRONG_PASSWORD = "wrong-client-pw-0815"  # the wrong one, sent on purpose

#: seconds a worker may take to start, or to fail at start, on a busy machine
START_TIMEOUT = 60.0


@pytest.fixture
def protected_redis() -> Iterator[RedisServer]:
    """A redis-server of its own that wants a password."""
    yield from serve(lambda: RedisServer("--requirepass", SERVER_PASSWORD))


def _fails_at_start(
    cluster: Cluster, name: str, *, extra_args: tuple[str, ...] = (), **changes: object
) -> tuple[int, str]:
    """Start a worker that must exit before it is ready; its exit code and log."""
    worker = cluster.worker(name, start=False, extra_args=extra_args, **changes)
    with pytest.raises(AssertionError, match="exited before logging"):
        worker.start(ready_timeout=START_TIMEOUT)
    return worker.wait_exit(timeout=30), worker.log()


def test_a_worker_starts_with_a_warning_when_the_store_is_unreachable(cluster: Cluster) -> None:
    # nothing listens on the port: the Redis store connects only when asked
    closed = f"redis://127.0.0.1:{free_port()}/0"
    worker = cluster.worker("unreachable", store=closed, store_options={})
    worker.wait_for_log(r"lease store cannot be reached now", timeout=10)
    assert "leased tasks are deferred until it can" in worker.log()
    assert worker.alive()


def test_a_store_that_cannot_be_used_stops_the_worker_at_start(
    cluster: Cluster, tmp_path: Path
) -> None:
    missing = f"sqlite:///{tmp_path / 'missing' / 'leases.db'}"
    code, log = _fails_at_start(cluster, "unusable", store=missing, store_options={})
    assert code == 1
    assert "Error: the lease store cannot be used" in log
    assert "does not exist" in log
    assert "Change leases_store or leases_store_options" in log


@pytest.fixture
def wrong_password_url(protected_redis: RedisServer) -> str:
    """A store URL with the wrong password for ``protected_redis``."""
    return f"redis://:{WRONG_PASSWORD}@127.0.0.1:{protected_redis.port}/0"


def test_a_wrong_redis_password_stops_the_worker_without_showing_it(
    cluster: Cluster, wrong_password_url: str
) -> None:
    code, log = _fails_at_start(cluster, "wrongpw", store=wrong_password_url, store_options={})
    assert code == 1
    assert WRONG_PASSWORD not in log
    assert SERVER_PASSWORD not in log
    # one line says what to change, at the end of the output; no traceback
    assert "Traceback" not in log
    (printed,) = [line for line in log.splitlines() if line.startswith("Error: ")]
    assert "the lease store cannot be used" in printed
    assert "check the user and password in the store URL" in printed
    assert "celery-leases: the worker cannot start: the lease store cannot be used" in log


def test_the_details_of_a_refused_start_are_logged_at_debug_level(
    cluster: Cluster, wrong_password_url: str
) -> None:
    debug = ("--loglevel", "DEBUG")
    _, log = _fails_at_start(
        cluster, "wrongpwdebug", store=wrong_password_url, store_options={}, extra_args=debug
    )
    assert "the lease setup check failed" in log
    assert "Traceback" in log
    assert "AuthenticationError" in log
    assert WRONG_PASSWORD not in log


def test_the_banner_shows_the_lease_store_masked_and_the_ttl(
    cluster: Cluster, protected_redis: RedisServer
) -> None:
    url = f"redis://:{SERVER_PASSWORD}@127.0.0.1:{protected_redis.port}/0"
    worker = cluster.worker("banner", store=url, store_options={}, ttl=10)
    banner = worker.out_path.read_text()
    assert "[leases]" in banner
    assert f".> store:       redis://:***@127.0.0.1:{protected_redis.port}/0" in banner
    # ttl/3, rounded for people
    assert ".> ttl:         10 s, renewed every 3.33 s (a task's" in banner
    assert SERVER_PASSWORD not in worker.log()
