"""The Redis store stops waiting for a reply at its caller's deadline.

A run completes and releases inside
:func:`~celery_leases.stores.deadline.bounded`, up to its lease's local
deadline. A real redis-server behind :class:`tests.proxy.Proxy`, which
forwards the completion and keeps its reply (the connection stays open and
silent): the call gives up at the deadline, not at the client's 5 s socket
timeout, and the next call, on a fresh connection, finds what the store
recorded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_leases import Acquired, Completed, StoreUnavailable
from celery_leases.stores.deadline import bounded
from celery_leases.stores.redis import RedisStore
from tests.acceptance.test_store_faults import COMPLETE_SHA
from tests.proxy import Proxy
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

OWNER = "worker-a"
#: the time the caller has left; the client's socket timeout is 5 s
LEFT = 0.5


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", redis_server.port) as running:
        yield running


@pytest.fixture
def store(proxy: Proxy, unique: str) -> Iterator[RedisStore]:
    with RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}/0", prefix=f"bw{unique}:") as opened:
        yield opened


def _claim(store: RedisStore, job_id: str) -> Acquired:
    held = store.claim(job_id, OWNER, 30)
    assert isinstance(held, Acquired), held
    return held


def test_a_completion_whose_reply_is_held_gives_up_at_the_callers_deadline(
    store: RedisStore, proxy: Proxy
) -> None:
    warm = _claim(store, "warm")
    store.complete("warm", OWNER, warm.generation)  # the script is loaded
    held = _claim(store, "job")
    proxy.silence_reply_to(COMPLETE_SHA)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable), bounded(LEFT):
        store.complete("job", OWNER, held.generation)
    took = time.monotonic() - started
    assert proxy.dropped_replies == 1
    assert LEFT <= took < LEFT + 2.0
    # the store applied it: asked again, on a fresh connection, it says so
    assert store.complete("job", OWNER, held.generation) == Completed("job", held.generation)
