"""The exact millisecond a lease runs out, on every store, by a clock the test sets.

A lease is live while the store's clock is below ``lease_until`` and has run
out at ``lease_until`` exactly. Each store runs on a clock the test sets to
the millisecond: the memory store on a ``ManualClock``; redis-server,
PostgreSQL and the SQLite process on ``tests/store_clock.c`` (see
``tests/store_clock.py``). One millisecond before the end another claim is
held off and the holder renews, completes, releases and writes fenced; at
the end another claim takes the job and the holder is refused everything.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import sqlalchemy as sa

from celery_leases import LeaseLost, LeaseStore, MemoryStore, open_store
from celery_leases.fencing.sql_transaction import fenced_transaction
from celery_leases.stores.base import (
    Acquired,
    Completed,
    HeldElsewhere,
    Refusal,
    RefusalReason,
    Released,
    Renewed,
    RenewRequest,
)
from celery_leases.stores.memory import ManualClock
from tests.servers import PostgresServer, RedisServer
from tests.store_clock import StoreClock, sqlite_store_under

A, B = "host-a:1:aaaa", "host-b:2:bbbb"
TTL = 30.0
TTL_MS = 30_000


class Clock(Protocol):
    now_ms: int


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def clocked(
    request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> Iterator[tuple[Any, Clock]]:
    """A fresh store of each kind and the clock it reads, set by the test."""
    kind = request.param
    if kind == "memory":
        manual = ManualClock()
        yield MemoryStore(clock=manual), manual
        return
    clock: StoreClock = request.getfixturevalue("store_clock")
    clock.now_ms += 10_000  # past every lease an earlier test left
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'leases.db'}"
        with sqlite_store_under(clock, url, table_name=f"leases_{unique}") as store:
            yield store, clock
        return
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("clocked_redis_server")
        store = open_store(server.url, prefix=f"t{unique}:")
    else:
        pg: PostgresServer = request.getfixturevalue("clocked_postgres_server")
        store = open_store(pg.url, table_name=f"leases_{unique}")
    try:
        yield store, clock
    finally:
        store.close()


def _claimed(store: LeaseStore, clock: Clock, job_id: str) -> Acquired:
    acquired = store.claim(job_id, A, TTL)
    assert isinstance(acquired, Acquired), acquired
    assert acquired.store_now_ms == clock.now_ms
    assert acquired.lease_until_ms == clock.now_ms + TTL_MS
    return acquired


def test_one_millisecond_before_the_end_the_lease_is_live(
    clocked: tuple[LeaseStore, Clock],
) -> None:
    store, clock = clocked
    held = {job: _claimed(store, clock, job) for job in ("renewed", "batched", "done", "freed")}
    end = held["renewed"].lease_until_ms
    clock.now_ms = end - 1

    for job, lease in held.items():
        other = store.claim(job, B, TTL)
        assert isinstance(other, HeldElsewhere), other
        assert (other.holder, other.generation, other.remaining) == (A, lease.generation, 0.001)
        record = store.get(job)
        assert record is not None
        assert record.is_live(store.now_ms())

    renewed = store.renew("renewed", A, held["renewed"].generation, TTL)
    assert renewed == Renewed("renewed", held["renewed"].generation, end - 1 + TTL_MS, end - 1)
    [batched] = store.renew_many([RenewRequest("batched", A, held["batched"].generation, TTL)])
    assert isinstance(batched, Renewed)
    assert batched.lease_until_ms == end - 1 + TTL_MS
    assert store.complete("done", A, held["done"].generation) == Completed(
        "done", held["done"].generation
    )
    assert store.release("freed", A, held["freed"].generation) == Released(
        "freed", held["freed"].generation
    )


def test_at_the_end_exactly_the_lease_has_run_out(clocked: tuple[LeaseStore, Clock]) -> None:
    store, clock = clocked
    held = {job: _claimed(store, clock, job) for job in ("renewed", "batched", "done", "freed")}
    end = held["renewed"].lease_until_ms
    clock.now_ms = end
    record = store.get("renewed")
    assert record is not None
    assert not record.is_live(store.now_ms())

    for job, lease in held.items():
        taken = store.claim(job, B, TTL)
        assert isinstance(taken, Acquired), taken
        assert taken.generation > lease.generation
        assert (taken.store_now_ms, taken.takeovers) == (end, 1)

    def refused(result: object) -> None:
        assert isinstance(result, Refusal), result
        assert result.reason is RefusalReason.SUPERSEDED
        assert result.current_owner == B

    refused(store.renew("renewed", A, held["renewed"].generation, TTL))
    [batched] = store.renew_many([RenewRequest("batched", A, held["batched"].generation, TTL)])
    refused(batched)
    refused(store.complete("done", A, held["done"].generation))
    refused(store.release("freed", A, held["freed"].generation))


def test_a_lease_nobody_took_at_its_end_is_still_renewed_by_its_holder(
    clocked: tuple[LeaseStore, Clock],
) -> None:
    # run out, but no other generation exists (the protocol's renew rule)
    store, clock = clocked
    lease = _claimed(store, clock, "job")
    clock.now_ms = lease.lease_until_ms
    renewed = store.renew("job", A, lease.generation, TTL)
    assert isinstance(renewed, Renewed)
    assert renewed.store_now_ms == lease.lease_until_ms
    other = store.claim("job", B, TTL)
    assert isinstance(other, HeldElsewhere), other


def test_a_fenced_transaction_commits_until_the_last_millisecond(
    clocked: tuple[LeaseStore, Clock],
) -> None:
    store, clock = clocked
    if not hasattr(store, "fenced_write") and not hasattr(store, "engine"):
        pytest.skip("a fenced transaction runs on a SQL store's own database")
    lease = _claimed(store, clock, "job")
    clock.now_ms = lease.lease_until_ms - 1
    assert _fenced_write(store, lease) == "written"
    clock.now_ms = lease.lease_until_ms
    assert _fenced_write(store, lease) == "expired"


def _fenced_write(store: Any, lease: Acquired) -> str:
    if hasattr(store, "fenced_write"):  # SQLite, in the process on the test clock
        return str(store.fenced_write(lease.job_id, lease.owner, lease.generation))
    try:
        with fenced_transaction(store, lease) as conn:
            conn.execute(sa.text("SELECT 1"))
            return "written"
    except LeaseLost as lost:
        return str(lost.reason)
