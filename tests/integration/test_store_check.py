"""The worker's start check asks a real store once, bounded by a timeout."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from celery_leases import LeaseConfigurationError, LeaseSettings
from celery_leases.worker import check_store
from tests.conftest import serve
from tests.servers import PostgresServer, RedisServer

SERVER_PASSWORD = "server-side-pw-2718"  # a throwaway test server's password
WRONG_PASSWORD = "wrong-client-pw-3141"  # the wrong one, sent on purpose


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server this test may freeze."""
    yield from serve(RedisServer)


@pytest.fixture
def protected_redis() -> Iterator[RedisServer]:
    yield from serve(lambda: RedisServer("--requirepass", SERVER_PASSWORD))


def test_a_reachable_redis_store_passes(redis_server: RedisServer, unique: str) -> None:
    settings = LeaseSettings(store_url=redis_server.url, store_options={"prefix": f"c{unique}:"})
    assert check_store(settings) is None


def test_a_reachable_postgres_store_passes(postgres_server: PostgresServer, unique: str) -> None:
    settings = LeaseSettings(
        store_url=postgres_server.url, store_options={"table_name": f"check_{unique}"}
    )
    assert check_store(settings) is None


def test_a_store_that_never_answers_gives_a_warning_after_the_timeout(
    own_redis: RedisServer,
) -> None:
    # a frozen server accepts the connection but never replies, and without
    # socket timeouts the client would wait for ever
    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)
    settings = LeaseSettings(store_url=own_redis.url, store_options={"socket_timeout": None})
    try:
        warning = check_store(settings, timeout=1.0)
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    assert warning is not None
    assert "did not answer within 1 s" in warning
    assert "deferred until it can" in warning


def test_a_right_password_passes(protected_redis: RedisServer) -> None:
    url = f"redis://:{SERVER_PASSWORD}@127.0.0.1:{protected_redis.port}/0"
    assert check_store(LeaseSettings(store_url=url)) is None


def test_a_wrong_password_is_refused_without_showing_it(protected_redis: RedisServer) -> None:
    url = f"redis://:{WRONG_PASSWORD}@127.0.0.1:{protected_redis.port}/0"
    with pytest.raises(LeaseConfigurationError, match="the lease store cannot be used") as caught:
        check_store(LeaseSettings(store_url=url))
    assert WRONG_PASSWORD not in str(caught.value)
    assert SERVER_PASSWORD not in str(caught.value)
