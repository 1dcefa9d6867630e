"""The Redis store's kept connections and the client's pool: nothing lost, nothing shared.

``stores/redis_direct.py`` takes its connections from the client's pool and
must give each one back (or keep it counted) whatever happens to a call,
must never use one the pool lent to someone else, and must leave the path
as soon as the client stops being one it knows (a method wrapped later,
redis-py's metrics turned on, retries asked for). Each test here holds one
of those against a real redis-server, mostly with a pool small enough that
one lost connection shows.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import redis

from celery_leases import Acquired
from celery_leases.stores.base import Renewed
from celery_leases.stores.redis import RedisStore
from tests.integration.test_redis_direct import (
    OWNER,
    _behind_a_proxy,
    _claim_and_complete,
    _counting,
)
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


class _Interrupted(BaseException):
    """What a signal handler, a green timeout or Ctrl-C raises: not an Exception."""


def test_an_interrupt_mid_call_loses_no_connection_of_a_pool_of_one(
    redis_server: RedisServer, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=1) as store:
        _claim_and_complete(store, "warm-up")
        (kept,) = store._direct._free

        def interrupted(*_: Any, **__: Any) -> Any:
            monkeypatch.undo()
            raise _Interrupted

        monkeypatch.setattr(kept, "read_response", interrupted)
        with pytest.raises(_Interrupted):
            store.claim("interrupted", OWNER, 30)
        # the pool's only connection is still the store's to use
        _claim_and_complete(store, "after")
        assert store.get("after") is not None


def test_a_forked_child_keeps_one_connection_between_its_calls(
    redis_server: RedisServer, unique: str
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=1) as store:
        _claim_and_complete(store, "warm-up")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                os.close(read)
                for n in range(3):
                    _claim_and_complete(store, f"child-{n}")
                ids = {store._direct.command("CLIENT", "ID") for _ in range(3)}
                os.write(write, str(len(ids)).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            distinct = pipe.read()
        _, status = os.waitpid(pid, 0)
        # a child that dropped its kept connection on every call would have
        # run out of its pool of one at the second call
        assert os.waitstatus_to_exitcode(status) == 0
        assert distinct == "1"


def test_a_connection_given_back_is_not_used_while_the_pool_lends_it(
    redis_server: RedisServer, unique: str
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=2) as store:
        _claim_and_complete(store, "warm-up")
        assert store.get("warm-up") is not None  # a read: the kept connection goes back
        pool = store._client.connection_pool
        lent = pool.get_connection()  # as a thread of the worker reading a record would
        try:
            lent.send_command("CLIENT", "ID")
            lent_id = lent.read_response()
            _claim_and_complete(store, "while-lent")
            assert store._direct.command("CLIENT", "ID") != lent_id
        finally:
            pool.release(lent)


@pytest.mark.parametrize("name", ["send_packed_command", "read_response"])
def test_a_connection_method_wrapped_later_sends_every_script_through_it(
    redis_server: RedisServer, unique: str, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    seen: list[str] = []
    real = getattr(redis.Connection, name)

    @functools.wraps(real)
    def traced(*args: Any, **kwargs: Any) -> Any:
        seen.append(name)
        return real(*args, **kwargs)

    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:") as store:
        _claim_and_complete(store, "before")  # the path ran and knows the methods
        monkeypatch.setattr(redis.Connection, name, traced)
        _claim_and_complete(store, "traced")
        assert not store._direct.usable
        assert len(seen) >= 2


def test_redis_py_metrics_turned_on_send_scripts_through_redis_py(
    redis_server: RedisServer, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis.observability import recorder
    from redis.observability.config import OTelConfig
    from redis.observability.providers import (
        get_observability_instance,
        reset_observability_instance,
    )

    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:") as store:
        _claim_and_complete(store, "before")
        assert store._direct.usable
        get_observability_instance().init(OTelConfig())
        try:
            calls = _counting(store._client.connection_pool, monkeypatch)
            assert not store._direct.usable
            _claim_and_complete(store, "metered")
            assert calls["get_connection"] == 2  # each script checked one out
        finally:
            reset_observability_instance()
            recorder.reset_collector()
        assert store._direct.usable


def test_retries_asked_for_without_a_retry_object_are_made(
    redis_server: RedisServer, unique: str
) -> None:
    # redis-py makes Retry(NoBackoff(), 1) of retry_on_error when no retry is given
    with _behind_a_proxy(
        redis_server, unique, retry=None, retry_on_error=[redis.ConnectionError]
    ) as (proxy, store):
        held = store.claim("job", OWNER, 30)
        assert isinstance(held, Acquired), held
        proxy.drop_next_reply()  # applied, its reply lost: redis-py sends it again
        renewed = store.renew("job", OWNER, held.generation, 30)
        assert isinstance(renewed, Renewed), renewed
