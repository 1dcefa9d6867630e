"""Every call of the SQL store is bounded: dead pooled connections, held locks.

A real PostgreSQL and a real MariaDB, each behind tests/proxy.py. ``blackhole_established()`` makes
the connections open now go silent (a firewall or NAT that forgot them)
while new connections pass, as after a failover behind a virtual IP. The
proxy acknowledges every packet, so no TCP timeout can see it: only the
store's own bound on each wait can.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.pool import Pool

from celery_leases import Acquired, Completed, Released, Renewed, RenewRequest, StoreUnavailable
from celery_leases.stores.deadline import bounded
from celery_leases.stores.sql import SqlStore
from celery_leases.stores.sql._engine import PING_AFTER_IDLE
from tests.operations import every_operation
from tests.proxy import Proxy
from tests.servers import MariadbServer, PostgresServer

A = "worker-a"
T = TypeVar("T")

#: a call that hangs is given this long before the test calls it hung
HUNG = 40.0


@pytest.fixture(params=["postgres", pytest.param("mysql", marks=pytest.mark.mysql)])
def database(request: pytest.FixtureRequest) -> PostgresServer | MariadbServer:
    """The session's PostgreSQL or MariaDB server."""
    name = "postgres_server" if request.param == "postgres" else "mariadb_server"
    server: PostgresServer | MariadbServer = request.getfixturevalue(name)
    return server


@pytest.fixture
def proxy(database: PostgresServer | MariadbServer) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", database.port) as proxy:
        yield proxy


@pytest.fixture
def proxied_url(database: PostgresServer | MariadbServer, proxy: Proxy) -> str:
    return database.url.replace(f":{database.port}/", f":{proxy.port}/")


def timed(call: Callable[[], T]) -> tuple[float, T | BaseException]:
    """Run ``call`` on a thread; (seconds it took, its result or error).

    Fails the test if it has not returned after HUNG seconds (the thread is
    left behind, as a hung worker thread would be).
    """
    outcome: list[T | BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:  # handed to the test
            outcome.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HUNG)
    took = time.monotonic() - started
    assert outcome, f"the call still hangs after {took:.0f} s"
    return took, outcome[0]


def test_a_claim_on_a_silently_dead_pooled_connection_recovers_on_a_fresh_one(
    proxied_url: str, proxy: Proxy, unique: str
) -> None:
    # the store's defaults: a 5 s limit on each wait
    store = SqlStore.from_url(proxied_url, table_name=f"leases_{unique}")
    try:
        assert isinstance(store.claim("warm", A, 30), Acquired)  # a pooled connection
        proxy.blackhole_established()
        time.sleep(PING_AFTER_IDLE)  # idle this long, it is pinged before the claim
        took, result = timed(lambda: store.claim("job", A, 30))
        assert isinstance(result, Acquired), result
        # the ping on the dead connection waited out its limit, then a new
        # connection claimed
        assert took < 5.0 + 10.0
        took, result = timed(lambda: store.claim("next", A, 30))
        assert isinstance(result, Acquired)
        assert took < 2.0  # the dead connections are gone from the pool
    finally:
        store.close()


def test_every_operation_returns_in_time_when_its_pooled_connection_goes_silent(
    proxied_url: str, proxy: Proxy, unique: str
) -> None:
    store = SqlStore.from_url(proxied_url, table_name=f"leases_{unique}", timeout=1.0)
    try:
        acquired = store.claim("job", A, 60)
        assert isinstance(acquired, Acquired)
        for name, call in every_operation(store, "job", A, acquired.generation, 60).items():
            proxy.blackhole_established()
            time.sleep(PING_AFTER_IDLE)  # idle this long, it is pinged first
            took, result = timed(call)
            # a ping that times out, a fresh connection, the statement
            assert took < 1.0 + 8.0, name
            assert not isinstance(result, BaseException), (name, result)
    finally:
        store.close()


@pytest.fixture
def unpinged_store(proxied_url: str, unique: str) -> Iterator[SqlStore]:
    """A store on an engine without pool_pre_ping: the statement itself meets
    the dead connection."""
    engine = sa.create_engine(proxied_url, pool_pre_ping=False)
    store = SqlStore(engine, table_name=f"leases_{unique}", timeout=1.0)
    yield store
    engine.dispose()


def test_a_completion_whose_connection_went_silent_is_tried_again_on_a_fresh_one(
    unpinged_store: SqlStore, proxy: Proxy
) -> None:
    store = unpinged_store
    acquired = store.claim("job", A, 60)
    assert isinstance(acquired, Acquired)
    proxy.blackhole_established()
    took, result = timed(lambda: store.complete("job", A, acquired.generation))
    assert isinstance(result, Completed), result
    assert took < 1.0 + 6.0


def test_a_renewal_whose_connection_went_silent_is_tried_again_on_a_fresh_one(
    unpinged_store: SqlStore, proxy: Proxy
) -> None:
    store = unpinged_store
    acquired = store.claim("job", A, 60)
    assert isinstance(acquired, Acquired)
    proxy.blackhole_established()
    request = RenewRequest("job", A, acquired.generation, 60)
    took, result = timed(lambda: store.renew_many([request]))
    assert not isinstance(result, BaseException), result
    assert [type(r) for r in result] == [Renewed]
    assert took < 1.0 + 6.0


def test_a_claim_whose_connection_went_silent_is_not_sent_again(
    unpinged_store: SqlStore, proxy: Proxy
) -> None:
    # the claim may have been applied: a second one would find itself the
    # holder. It is unavailable, and the next call gets a fresh connection.
    store = unpinged_store
    assert isinstance(store.claim("warm", A, 60), Acquired)
    proxy.blackhole_established()
    took, result = timed(lambda: store.claim("job", A, 60))
    assert isinstance(result, StoreUnavailable), result
    assert "no reply from the database within 1.5 s" in str(result)
    assert took < 1.0 + 3.0
    took, result = timed(lambda: store.claim("other", A, 60))
    assert isinstance(result, Acquired), result


def test_a_release_whose_connection_went_silent_is_not_sent_again(
    unpinged_store: SqlStore, proxy: Proxy
) -> None:
    store = unpinged_store
    acquired = store.claim("job", A, 60)
    assert isinstance(acquired, Acquired)
    proxy.blackhole_established()
    took, result = timed(lambda: store.release("job", A, acquired.generation))
    assert isinstance(result, StoreUnavailable), result
    assert took < 1.0 + 3.0


def test_a_renewal_gives_up_at_its_callers_deadline(
    proxied_url: str, proxy: Proxy, unique: str
) -> None:
    # the store's limit is 5 s a wait; the heartbeat's deadline is sooner
    store = SqlStore.from_url(proxied_url, table_name=f"leases_{unique}")
    try:
        acquired = store.claim("job", A, 60)
        assert isinstance(acquired, Acquired)
        proxy.blackhole_established()
        request = RenewRequest("job", A, acquired.generation, 60)

        def renew_within_half_a_second() -> object:
            with bounded(0.5):
                return store.renew_many([request])

        took, result = timed(renew_within_half_a_second)
        assert isinstance(result, StoreUnavailable), result
        # the deadline, plus at most one connection attempt that fits before it
        assert took < 0.5 + 2.5
    finally:
        store.close()


def test_a_statement_waiting_on_a_row_lock_ends_at_the_servers_limit(
    database: PostgresServer | MariadbServer, unique: str
) -> None:
    store = SqlStore.from_url(database.url, table_name=f"leases_{unique}", timeout=1.0)
    blocker = sa.create_engine(database.url)
    try:
        acquired = store.claim("job", A, 60)
        assert isinstance(acquired, Acquired)
        with blocker.begin() as conn:
            # another transaction holds the record's row lock
            conn.execute(sa.text(f"SELECT 1 FROM leases_{unique} WHERE job_id = 'job' FOR UPDATE"))  # noqa: S608  (a test table name)
            took, result = timed(lambda: store.renew("job", A, acquired.generation, 60))
            assert isinstance(result, StoreUnavailable), result
            # the lock and statement limits are equal: either may end it
            # (PostgreSQL's lock_timeout, statement_timeout; MariaDB's
            # innodb_lock_wait_timeout, max_statement_time)
            limits = ("lock timeout", "statement timeout", "Lock wait timeout", "max_statement")
            assert any(limit in str(result) for limit in limits), result
            assert took < 1.0 + 3.0
        # the lock is gone and the same store carries on
        assert isinstance(store.release("job", A, acquired.generation), Released)
    finally:
        store.close()
        blocker.dispose()


# --- a frozen server: every wait ends by the caller's deadline ------------------

#: how late past its deadline a call may return on a loaded machine (the
#: waits end on time; a new MariaDB connection first spends CPU: PyMySQL
#: builds a TLS context for it, about 30 ms)
LATE = 1.0


def _server_pids(server: PostgresServer | MariadbServer) -> list[int]:
    """The processes of ``server``: MariaDB's one, PostgreSQL's postmaster and its children."""
    if isinstance(server, MariadbServer):
        assert server.proc is not None
        return [server.proc.pid]
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            if int(stat.rpartition(")")[2].split()[1]) == postmaster:
                children.append(int(entry.name))
    return [postmaster, *children]


@contextlib.contextmanager
def frozen(server: PostgresServer | MariadbServer) -> Iterator[None]:
    """``server`` stopped with SIGSTOP inside: its port accepts connections
    (the kernel does) and nothing answers. Resumed with SIGCONT after."""
    stopped: list[int] = []
    try:
        for pid in _server_pids(server):
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


#: the deadlines of the reading threads: 15 hold every connection of the
#: pool, then 5 more wait for one
HOLDERS, WAITERS = [2.0] * 15, [0.5, 0.5, 0.5, 1.0, 1.0]


def test_twenty_threads_reading_a_frozen_server_each_return_by_their_deadline(
    database: PostgresServer | MariadbServer, unique: str
) -> None:
    # a pool of 15, all connected before the freeze as in a running worker;
    # 15 reads hold its connections, 5 more wait for one, and every wait
    # ends by the thread's own deadline (the store's limit, 3 s, is later)
    store = SqlStore.from_url(
        database.url, table_name=f"leases_{unique}", timeout=3.0, pool_size=15, max_overflow=0
    )
    deadlines = HOLDERS + WAITERS
    took: list[float | None] = [None] * len(deadlines)
    results: list[object] = [None] * len(deadlines)
    readers: set[int] = set()
    checked_out: list[int] = []
    holding = threading.Event()

    def count(*_: object) -> None:
        if threading.get_ident() in readers:
            checked_out.append(1)
            if len(checked_out) == len(HOLDERS):
                holding.set()

    def read(n: int) -> None:
        readers.add(threading.get_ident())
        began = time.monotonic()
        try:
            with bounded(deadlines[n]):
                results[n] = store.get("job")
        except BaseException as error:  # handed to the test
            results[n] = error
        took[n] = time.monotonic() - began

    threads = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(20)]
    event.listen(Pool, "checkout", count)  # every pool's: the store's own
    try:
        assert isinstance(store.claim("job", A, 60), Acquired)
        with contextlib.ExitStack() as connections:
            for _ in range(15):
                connections.enter_context(store.engine.connect())
        with frozen(database):
            for thread in threads[: len(HOLDERS)]:
                thread.start()
            assert holding.wait(HUNG), "the holders never took the pool's connections"
            for thread in threads[len(HOLDERS) :]:
                thread.start()
            for thread in threads:
                thread.join(HUNG)
        odd = [result for result in results if not isinstance(result, StoreUnavailable)]
        assert not odd, [(type(result), str(result)[:300]) for result in odd]
        late = [
            (deadline, seconds)
            for deadline, seconds in zip(deadlines, took, strict=True)
            if seconds is None or seconds > deadline + LATE
        ]
        assert not late, f"(deadline, seconds taken) of the late calls: {late}"
        # resumed, the same store carries on
        record = store.get("job")
        assert record is not None
        assert record.owner == A
    finally:
        event.remove(Pool, "checkout", count)
        store.close()


def test_a_renewal_given_one_second_on_a_fresh_connection_returns_in_about_one_second(
    database: PostgresServer | MariadbServer, unique: str
) -> None:
    # the store's limit on each wait is 3 s; the caller's deadline is sooner
    table = f"leases_{unique}"
    claimer = SqlStore.from_url(database.url, table_name=table)
    store = SqlStore.from_url(database.url, table_name=table, create_table=False, timeout=3.0)
    try:
        acquired = claimer.claim("job", A, 60)
        assert isinstance(acquired, Acquired)
        store.engine.dispose()  # the renewal connects

        def renew_within_one_second() -> object:
            with bounded(1.0):
                return store.renew("job", A, acquired.generation, 60)

        with frozen(database):
            took, result = timed(renew_within_one_second)
        assert isinstance(result, StoreUnavailable), result
        assert took < 1.0 + LATE
        assert isinstance(store.renew("job", A, acquired.generation, 60), Renewed)
    finally:
        store.close()
        claimer.close()
