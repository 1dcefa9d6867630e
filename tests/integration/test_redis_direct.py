"""The Redis store's scripts on the connections it keeps (``stores/redis_direct.py``).

Everything runs against a real redis-server; the faults come from the server
itself (``CLIENT KILL``), from :class:`tests.proxy.Proxy`, from a real
``SIGALRM`` and from a real ``fork``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
import redis
import redis.commands.core
from redis.backoff import NoBackoff
from redis.credentials import UsernamePasswordCredentialProvider
from redis.retry import Retry
from redis.sentinel import Sentinel

from celery_leases import Acquired, Completed, StoreUnavailable
from celery_leases.stores.base import RenewRequest
from celery_leases.stores.redis import RedisStore
from celery_leases.stores.redis_connections import client_options
from celery_leases.stores.redis_direct import DirectCalls
from tests.acceptance.harness import REPO_ROOT
from tests.proxy import Proxy
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

OWNER = "worker-a"


class _OwnConnection(redis.Connection):
    """A connection class of a user's own (a socket wrapper, say), methods unchanged."""


@pytest.fixture
def store(redis_server: RedisServer, unique: str) -> Iterator[RedisStore]:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:") as opened:
        yield opened


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _claim_and_complete(store: RedisStore, job_id: str) -> int:
    held = store.claim(job_id, OWNER, 30)
    assert isinstance(held, Acquired), held
    assert store.complete(job_id, OWNER, held.generation) == Completed(job_id, held.generation)
    return held.generation


@contextlib.contextmanager
def _behind_a_proxy(
    server: RedisServer, unique: str, **options: Any
) -> Iterator[tuple[Proxy, RedisStore]]:
    """A store opened from a URL whose connections pass a :class:`Proxy`."""
    with (
        Proxy("127.0.0.1", server.port) as proxy,
        RedisStore.from_url(
            f"redis://127.0.0.1:{proxy.port}/0", prefix=f"d{unique}:", **options
        ) as store,
    ):
        yield proxy, store


def _claimed_on_its_own_reply(store: RedisStore, job_id: str) -> None:
    """A claim of a new job is acquired, with the generation its record holds."""
    held = store.claim(job_id, OWNER, 30)
    assert isinstance(held, Acquired), held
    record = store.get(job_id)
    assert record is not None
    assert record.generation == held.generation


def _counting(pool: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often ``pool`` is asked for a connection and given one back."""
    calls = {"get_connection": 0, "release": 0}
    for name in calls:
        real = getattr(pool, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(pool, name, spy)
    return calls


def test_claims_and_completions_go_out_without_a_pool_checkout(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _claim_and_complete(store, "warm-up")  # loads the scripts, takes one connection
    calls = _counting(store._client.connection_pool, monkeypatch)
    for n in range(20):
        _claim_and_complete(store, f"job-{n}")
    assert calls == {"get_connection": 0, "release": 0}


def test_a_connection_the_server_closed_is_replaced_before_the_script_is_sent(
    store: RedisStore, raw: redis.Redis
) -> None:
    _claim_and_complete(store, "warm-up")
    own_id = store._direct.command("CLIENT", "ID")
    assert raw.client_kill_filter(_id=own_id) == 1
    deadline = time.monotonic() + 10
    while raw.client_list() and any(int(c["id"]) == own_id for c in raw.client_list()):
        assert time.monotonic() < deadline, "the server did not close the connection"
        time.sleep(0.01)
    # the kept connection is dead: the claim must not be an outage
    held = store.claim("after-kill", OWNER, 30)
    assert isinstance(held, Acquired)
    assert store._direct.command("CLIENT", "ID") != own_id


def test_a_late_reply_is_never_read_as_the_next_commands(
    redis_server: RedisServer, unique: str
) -> None:
    with _behind_a_proxy(redis_server, unique, socket_timeout=0.5) as (proxy, store):
        _claim_and_complete(store, "warm-up")
        proxy.delay(1.5)  # the reply comes after the client gave up
        with pytest.raises(StoreUnavailable):
            store.claim("slow", OWNER, 30)
        time.sleep(2.0)  # the late reply has reached the client's socket by now
        proxy.heal()
        _claimed_on_its_own_reply(store, "next")


def test_an_interrupted_read_leaves_its_connection_unused(
    redis_server: RedisServer, unique: str
) -> None:
    class Interrupted(BaseException):
        pass

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise Interrupted

    with _behind_a_proxy(redis_server, unique) as (proxy, store):
        _claim_and_complete(store, "warm-up")
        before = signal.signal(signal.SIGALRM, interrupt)
        try:
            proxy.delay(1.0)
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # fires while the reply is held back
            with pytest.raises(Interrupted):
                store.claim("interrupted", OWNER, 30)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        time.sleep(1.5)  # the held reply arrives on the interrupted connection
        proxy.heal()
        again = store.claim("interrupted", OWNER, 30)
        # the interrupted claim was applied by the server; a fresh reply says
        # so, a stale one would have said Acquired
        assert not isinstance(again, Acquired)
        _claimed_on_its_own_reply(store, "other")


def test_an_interrupt_between_sending_and_reading_leaves_the_reply_unread(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Interrupted(BaseException):
        pass

    assert isinstance(store.claim("held", "worker-b", 30), Acquired)
    _claim_and_complete(store, "warm-up")
    (kept,) = store._direct._free

    def interrupted(*_: Any, **__: Any) -> Any:
        monkeypatch.undo()
        raise Interrupted  # as a signal handler would, before any byte is read

    monkeypatch.setattr(kept, "read_response", interrupted)
    with pytest.raises(Interrupted):
        store.claim("held", OWNER, 30)  # its reply would say "held elsewhere"
    assert isinstance(store.claim("free", OWNER, 30), Acquired)


def test_a_pool_of_one_serves_reads_between_scripts(redis_server: RedisServer, unique: str) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=1) as store:
        for n in range(3):
            _claim_and_complete(store, f"job-{n}")
            assert store.get(f"job-{n}") is not None
            assert len(list(store.records())) == n + 1
        assert store.now_ms() > 0


def test_a_wrapped_execute_command_sees_every_script(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    real = redis.Redis.execute_command

    @functools.wraps(real)
    def traced(self: redis.Redis, *args: Any, **options: Any) -> Any:
        seen.append(str(args[0]))
        return real(self, *args, **options)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)
    _claim_and_complete(store, "traced")
    assert seen.count("EVALSHA") == 2


def test_a_replaced_execute_command_sees_every_script(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    real = redis.Redis.execute_command

    def patched(self: redis.Redis, *args: Any, **options: Any) -> Any:
        seen.append(str(args[0]))
        return real(self, *args, **options)

    monkeypatch.setattr(redis.Redis, "execute_command", patched)
    _claim_and_complete(store, "patched")
    monkeypatch.undo()
    on_the_instance: list[str] = []

    def instance_patch(*args: Any, **options: Any) -> Any:
        on_the_instance.append(str(args[0]))
        return real(store._client, *args, **options)

    monkeypatch.setattr(store._client, "execute_command", instance_patch)
    _claim_and_complete(store, "patched-instance")
    assert seen.count("EVALSHA") == 2
    assert on_the_instance.count("EVALSHA") == 2


def test_a_forked_child_never_uses_its_parents_connections(store: RedisStore) -> None:
    _claim_and_complete(store, "warm-up")
    parent_id = store._direct.command("CLIENT", "ID")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(read)
            _claim_and_complete(store, "in-the-child")
            child_id = store._direct.command("CLIENT", "ID")
            os.write(write, str(child_id).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        child_id = int(pipe.read() or "0")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_id not in (0, parent_id)
    assert store._direct.command("CLIENT", "ID") == parent_id
    _claim_and_complete(store, "in-the-parent")


@pytest.mark.parametrize(
    "make",
    [
        # each with the options the store gives its own client, so the one
        # difference that sends it through redis-py is the one named
        pytest.param(
            lambda: redis.Redis.from_url("rediss://127.0.0.1:1/0", **client_options({})),
            id="tls",
        ),
        pytest.param(
            lambda: Sentinel([("127.0.0.1", 1)]).master_for(  # type: ignore[no-untyped-call]
                "leases", **client_options({})
            ),
            id="sentinel",
        ),
        pytest.param(
            lambda: redis.Redis(
                connection_pool=redis.BlockingConnectionPool.from_url(
                    "redis://127.0.0.1:1/0", **client_options({})
                )
            ),
            id="blocking-pool",
        ),
        pytest.param(
            lambda: redis.Redis.from_url(
                "redis://127.0.0.1:1/0", connection_class=_OwnConnection, **client_options({})
            ),
            id="connection-class-of-its-own",
        ),
    ],
)
def test_other_clients_send_through_redis_py(make: Any) -> None:
    client = make()
    try:
        assert not DirectCalls(client).usable
    finally:
        client.close()


def test_a_single_connection_client_sends_through_redis_py(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, single_connection_client=True)
    try:
        assert not DirectCalls(client).usable
    finally:
        client.close()


def test_a_plain_client_of_tcp_or_unix_sockets_goes_direct() -> None:
    for url in ("redis://127.0.0.1:1/0", "unix:///tmp/no-such-redis.sock"):
        client = redis.Redis.from_url(url, **client_options({}))
        try:
            assert DirectCalls(client).usable, url
        finally:
            client.close()


def test_calls_while_the_server_is_down_lose_no_connection_of_the_pool(
    redis_server: RedisServer, unique: str
) -> None:
    with _behind_a_proxy(redis_server, unique, max_connections=1) as (proxy, store):
        _claim_and_complete(store, "warm-up")
        proxy.refuse()  # closes the kept connection and every new one
        for n in range(5):
            with pytest.raises(StoreUnavailable) as caught:
                store.claim(f"down-{n}", OWNER, 30)
            assert "every connection" not in str(caught.value)
        proxy.heal()
        _claimed_on_its_own_reply(store, "back")
        assert store.get("back") is not None


# --- clients the store did not make, and options it does not know ------------------


def test_a_client_given_to_the_store_is_shared_as_redis_py_shares_it(
    redis_server: RedisServer, unique: str
) -> None:
    client = redis.Redis.from_url(redis_server.url, max_connections=1, **client_options({}))
    try:
        first = RedisStore(client, prefix=f"a{unique}:", check_config=False)
        second = RedisStore(client, prefix=f"b{unique}:", check_config=False, renew_client=client)
        held = second.claim("job", OWNER, 30)
        assert isinstance(held, Acquired)
        _claim_and_complete(first, "job")
        assert client.set(f"a{unique}:your-key", 1)  # your own command between two scripts
        (renewed,) = second.renew_many([RenewRequest("job", OWNER, held.generation, 30)])
        assert type(renewed).__name__ == "Renewed", renewed
        first.close()
        assert client.ping()  # closing a store leaves your pool as it was
    finally:
        client.close()


def test_a_store_used_again_after_close_finds_its_pool_whole(
    redis_server: RedisServer, unique: str
) -> None:
    store = RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=1)
    _claim_and_complete(store, "before-close")
    store.close()
    _claim_and_complete(store, "after-close")
    store.close()


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"retry": Retry(NoBackoff(), 2)}, id="retries"),
        pytest.param({"protocol": 3}, id="resp3"),
        pytest.param(
            {"credential_provider": UsernamePasswordCredentialProvider("default", "")},
            id="credential-provider",
        ),
    ],
)
def test_options_whose_meaning_needs_redis_py_keep_its_path(
    redis_server: RedisServer, unique: str, options: dict[str, Any]
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", **options) as store:
        assert not store._direct.usable
        _claim_and_complete(store, "job")


def test_a_retry_policy_given_in_the_options_is_followed(
    redis_server: RedisServer, unique: str
) -> None:
    with _behind_a_proxy(redis_server, unique, retry=Retry(NoBackoff(), 2)) as (proxy, store):
        held = store.claim("job", OWNER, 30)
        assert isinstance(held, Acquired)
        proxy.drop_next_reply()  # the renewal is applied, its reply lost: sent again
        renewed = store.renew("job", OWNER, held.generation, 30)
        assert type(renewed).__name__ == "Renewed", renewed


def test_a_tracer_of_command_methods_or_connections_sees_every_script(
    redis_server: RedisServer, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []

    def tracing(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        @functools.wraps(real)
        def traced(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, traced)

    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=1) as store:
        _claim_and_complete(store, "before")  # a connection is kept now
        tracing(redis.commands.core.CoreCommands, "evalsha")
        _claim_and_complete(store, "evalsha-traced")
        assert seen.count("evalsha") == 2
        monkeypatch.undo()
        _claim_and_complete(store, "untraced")  # direct again: keeps a connection
        tracing(redis.Connection, "send_command")
        _claim_and_complete(store, "connection-traced")
        assert seen.count("send_command") == 2


def test_a_store_from_a_url_speaks_resp2_and_goes_direct(
    redis_server: RedisServer, unique: str
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:") as store:
        _claim_and_complete(store, "job")
        info = store._direct.command("CLIENT", "INFO").decode().split()
        assert "resp=2" in info
        assert store._direct.usable


def test_the_protocol_redis_py_picks_goes_direct_only_when_it_is_resp2(
    redis_server: RedisServer, unique: str
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", protocol=None) as store:
        _claim_and_complete(store, "job")
        info = store._client.execute_command("CLIENT", "INFO").decode().split()
        assert store._direct.usable == ("resp=2" in info)


#: claims in a process whose sockets and select are eventlet's, its threads not
_EVENTLET_SOCKETS_ONLY = """
import json, sys
import eventlet
eventlet.monkey_patch(thread=False)
from celery_leases.stores.redis import RedisStore
store = RedisStore.from_url(sys.argv[1], prefix=sys.argv[2], check_config=False)
results = []
for n in range(3):
    try:
        results.append(type(store.claim(f"job-{n}", "owner", 30)).__name__)
    except BaseException as exc:
        results.append(f"{type(exc).__name__}: {exc}")
results.append(store._direct.usable)
store.close()
print(json.dumps(results))
"""


def test_green_sockets_without_green_threads_keep_redis_pys_path(
    redis_server: RedisServer, unique: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _EVENTLET_SOCKETS_ONLY, redis_server.url,
         f"e{unique}:"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [
        "Acquired", "Acquired", "Acquired", False,
    ]  # fmt: skip


def test_a_second_script_flush_right_after_the_load_is_an_outage_not_a_configuration_error(
    store: RedisStore, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    _claim_and_complete(store, "warm-up")
    raw.script_flush()
    real = DirectCalls.command

    def flushed_again(self: DirectCalls, *args: Any) -> Any:
        reply = real(self, *args)
        if args[:2] == ("SCRIPT", "LOAD"):
            raw.script_flush()  # another flush lands between the load and the call
        return reply

    monkeypatch.setattr(DirectCalls, "command", flushed_again)
    with pytest.raises(StoreUnavailable, match="NoScriptError"):
        store.claim("flushed-twice", OWNER, 30)
    monkeypatch.undo()
    _claimed_on_its_own_reply(store, "after")
