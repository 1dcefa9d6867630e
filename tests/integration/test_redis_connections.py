"""The Redis store's calls on its clients' connection pools: nothing lost,
nothing shared, no reply read as another call's.

The store sends every script through redis-py's ``evalsha`` on the client's
pool, so what a pool's checkout promises (a connection the server closed is
connected again, one left with an unread reply is not used as it is, a
forked child never uses its parent's) is redis-py's. Each test holds one of
those promises for the store against a real redis-server, mostly with a
pool small enough that one lost connection shows; the faults come from the
server itself (``CLIENT KILL``), from :class:`tests.proxy.Proxy`, from a
real ``SIGALRM`` and from a real ``fork``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
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

from celery_leases import Acquired, Completed, StoreUnavailable
from celery_leases.stores.base import Renewed, RenewRequest
from celery_leases.stores.redis import RedisStore
from celery_leases.stores.redis._connections import client_options
from tests.acceptance.harness import REPO_ROOT
from tests.proxy import Proxy
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

OWNER = "worker-a"


class _Interrupted(BaseException):
    """What a signal handler, a green timeout or Ctrl-C raises: not an Exception."""


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


def checkout(pool: redis.ConnectionPool) -> Any:
    """A connection of ``pool``, as a caller of its own would take one
    (redis-py before 5.3 needs a command name, later ones warn of it)."""
    if inspect.signature(pool.get_connection).parameters["command_name"].default is None:
        return pool.get_connection()
    return pool.get_connection("PING")  # pragma: no cover - redis-py before 5.3


def _interrupt_next_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next reply's read raises :class:`_Interrupted` before reading a
    byte, as a signal handler between sending and reading would."""

    def interrupted(*_: Any, **__: Any) -> Any:
        monkeypatch.undo()
        raise _Interrupted

    monkeypatch.setattr(redis.Connection, "read_response", interrupted)


def test_a_connection_the_server_closed_is_replaced_before_the_script_is_sent(
    redis_server: RedisServer, unique: str, raw: redis.Redis
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=1) as store:
        _claim_and_complete(store, "warm-up")
        own_id = store._client.client_id()
        assert raw.client_kill_filter(_id=own_id) == 1
        deadline = time.monotonic() + 10
        while raw.client_list() and any(int(c["id"]) == own_id for c in raw.client_list()):
            assert time.monotonic() < deadline, "the server did not close the connection"
            time.sleep(0.01)
        # the pool's connection is dead: the claim must not be an outage
        held = store.claim("after-kill", OWNER, 30)
        assert isinstance(held, Acquired)
        assert store._client.client_id() != own_id


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
    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise _Interrupted

    with _behind_a_proxy(redis_server, unique) as (proxy, store):
        _claim_and_complete(store, "warm-up")
        before = signal.signal(signal.SIGALRM, interrupt)
        try:
            proxy.delay(1.0)
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # fires while the reply is held back
            with pytest.raises(_Interrupted):
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


def test_an_interrupt_mid_call_loses_no_connection_of_a_pool_of_one(
    redis_server: RedisServer, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=1) as store:
        _claim_and_complete(store, "warm-up")
        _interrupt_next_read(monkeypatch)
        with pytest.raises(_Interrupted):
            store.claim("interrupted", OWNER, 30)
        # the pool's only connection is still the store's to use
        _claim_and_complete(store, "after")
        assert store.get("after") is not None


def test_a_reply_left_unread_by_an_interrupt_is_never_read_as_the_next_calls(
    redis_server: RedisServer, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _behind_a_proxy(redis_server, unique, max_connections=1) as (proxy, store):
        assert isinstance(store.claim("held", "worker-b", 30), Acquired)
        proxy.delay(0.5)  # the reply comes after the next call's checkout
        _interrupt_next_read(monkeypatch)
        with pytest.raises(_Interrupted):
            store.claim("held", OWNER, 30)  # its reply says "held elsewhere"
        proxy.heal()
        _claimed_on_its_own_reply(store, "free")


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
    parent_id = store._client.client_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(read)
            _claim_and_complete(store, "in-the-child")
            child_id = store._client.client_id()
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
    assert store._client.client_id() == parent_id
    _claim_and_complete(store, "in-the-parent")


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


# --- clients the store did not make, and options of redis-py's own -----------------


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
def test_a_store_with_options_of_redis_pys_own_claims_and_completes(
    redis_server: RedisServer, unique: str, options: dict[str, Any]
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", **options) as store:
        _claim_and_complete(store, "job")


def test_a_retry_policy_given_in_the_options_is_followed(
    redis_server: RedisServer, unique: str
) -> None:
    # redis-py 5.0 retries only the errors named in retry_on_error
    with _behind_a_proxy(
        redis_server, unique, retry=Retry(NoBackoff(), 2), retry_on_error=[redis.ConnectionError]
    ) as (proxy, store):
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
        _claim_and_complete(store, "untraced")
        tracing(redis.Connection, "send_command")
        _claim_and_complete(store, "connection-traced")
        assert seen.count("send_command") == 2


def test_a_store_from_a_url_speaks_resp2(redis_server: RedisServer, unique: str) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:") as store:
        _claim_and_complete(store, "job")
        info = store._client.execute_command("CLIENT", "INFO").decode().split()
        assert "resp=2" in info


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
store.close()
print(json.dumps(results))
"""


def test_a_store_claims_with_green_sockets_and_threads_left_alone(
    redis_server: RedisServer, unique: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _EVENTLET_SOCKETS_ONLY, redis_server.url,
         f"e{unique}:"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [
        "Acquired", "Acquired", "Acquired",
    ]  # fmt: skip


def test_a_second_script_flush_right_after_the_load_is_an_outage_not_a_configuration_error(
    store: RedisStore, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    _claim_and_complete(store, "warm-up")
    raw.script_flush()
    real = store._client.script_load

    def flushed_again(script: Any) -> Any:
        sha = real(script)
        raw.script_flush()  # another flush lands between the load and the call
        return sha

    monkeypatch.setattr(store._client, "script_load", flushed_again)
    with pytest.raises(StoreUnavailable, match="NoScriptError"):
        store.claim("flushed-twice", OWNER, 30)
    monkeypatch.undo()
    _claimed_on_its_own_reply(store, "after")


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
                ids = {store._client.client_id() for _ in range(3)}
                os.write(write, str(len(ids)).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            distinct = pipe.read()
        _, status = os.waitpid(pid, 0)
        # a child that dropped its connection on every call would have
        # run out of its pool of one at the second call
        assert os.waitstatus_to_exitcode(status) == 0
        assert distinct == "1"


def test_a_connection_is_not_used_while_the_pool_lends_it(
    redis_server: RedisServer, unique: str
) -> None:
    with RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", max_connections=2) as store:
        _claim_and_complete(store, "warm-up")
        assert store.get("warm-up") is not None
        pool = store._client.connection_pool
        lent = checkout(pool)  # as a thread of the worker reading a record would
        try:
            lent.send_command("CLIENT", "ID")
            lent_id = lent.read_response()
            _claim_and_complete(store, "while-lent")
            assert store._client.client_id() != lent_id
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
        _claim_and_complete(store, "before")
        monkeypatch.setattr(redis.Connection, name, traced)
        _claim_and_complete(store, "traced")
        assert len(seen) >= 2


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


# --- the pools a store makes ----------------------------------------------------------


def _connections_named(raw: redis.Redis, name: str) -> int:
    return sum(1 for client in raw.client_list() if client.get("name") == name)


@pytest.mark.parametrize("given", [False, True], ids=["from-url", "over-a-client"])
def test_closing_a_store_closes_the_connections_of_the_pools_it_made(
    redis_server: RedisServer, unique: str, raw: redis.Redis, given: bool
) -> None:
    name = f"closing-{unique}-{given}"
    options = {**client_options({}), "client_name": name}
    yours = (
        redis.Redis(connection_pool=redis.ConnectionPool.from_url(redis_server.url, **options))
        if given
        else None
    )
    store = (
        RedisStore(yours, prefix=f"d{unique}:", check_config=False)
        if yours is not None
        else RedisStore.from_url(redis_server.url, prefix=f"d{unique}:", **options)
    )
    held = store.claim("job", OWNER, 30)
    assert isinstance(held, Acquired), held
    (renewed,) = store.renew_many([RenewRequest("job", OWNER, held.generation, 30)])
    assert isinstance(renewed, Renewed), renewed
    assert _connections_named(raw, name) == 2  # the task pool's and the renewal pool's
    store.close()
    left = 1 if yours is not None else 0  # your client's pool is yours to close
    deadline = time.monotonic() + 10
    while _connections_named(raw, name) != left:
        assert time.monotonic() < deadline, raw.client_list()
        time.sleep(0.01)
    if yours is not None:
        assert yours.ping()
        yours.connection_pool.disconnect()


# --- the renewal pool under monkey-patching: redis-py's private names -------------------

#: in a process patched by gevent or eventlet: the renewal pool's locks and a
#: connection's socket, then a command on the renewal client
_RENEWAL_POOL_UNDER_PATCHING = """
import json, sys
library, url = sys.argv[1], sys.argv[2]
if library == "gevent":
    from gevent import monkey
    monkey.patch_all()
else:
    import eventlet
    eventlet.monkey_patch()
import redis
from celery_leases import unpatched
from celery_leases.stores.redis._connections import renewal_client
client = redis.Redis.from_url(url)
renew = renewal_client(client, 2)
pool = renew.connection_pool
locks = {name: type(value).__module__ for name, value in vars(pool).items()
         if hasattr(value, "acquire")}
connection = pool.make_connection()
connection.connect()
os_socket = type(connection._sock) is unpatched.socket_module().socket
connection.disconnect()
print(json.dumps({"locks": locks, "os_socket": os_socket, "ping": renew.ping()}))
"""


@pytest.mark.parametrize("library", ["gevent", "eventlet"])
def test_the_renewal_pool_under_patching_has_os_locks_and_os_sockets(
    redis_server: RedisServer, library: str
) -> None:
    """Pins the private names of redis-py that ``redis_connections`` relies on
    (no public API sets a pool's locks or a connection's socket): the pool's
    locks are ``_lock`` and ``_fork_lock``, and ``Connection.connect`` makes
    its socket with ``_connect``. A redis-py that renames or adds one fails
    here: a lock left to the patched ``threading`` or a socket made by the
    patched ``socket`` module would wait in the hub."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _RENEWAL_POOL_UNDER_PATCHING, library,
         redis_server.url],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["locks"], "the pool has no lock of its own any more"
    assert set(found["locks"].values()) == {"_thread"}, found["locks"]
    assert found["os_socket"] is True
    assert found["ping"] is True
