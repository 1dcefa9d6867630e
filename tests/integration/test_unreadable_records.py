"""One unreadable record affects only its own job.

A record that celery-leases did not write (a state that does not exist, a
generation that is not a number, missing fields) is planted straight into
Redis, PostgreSQL and SQLite. The healthy leases around it keep working; the
bad job is refused with a clear error until an operator deletes or fixes it,
and the bad record itself is never changed by the store.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases import (
    Acquired,
    LeaseConfigurationError,
    LeaseError,
    LeaseLost,
    LeaseRecordUnreadable,
    LeaseStore,
    Refusal,
    RefusalReason,
    Renewed,
    RenewRequest,
)
from celery_leases.stores.memory import MemoryStore
from celery_leases.stores.redis import RedisStore
from celery_leases.stores.sql import SqlStore

A = "worker-a"
BAD = "bad-job"
GARBAGE = ["state", "generation", "missing-fields"]


def plant(store: LeaseStore, job_id: str, garbage: str) -> None:
    """Spoil the record of ``job_id`` in the store's own storage."""
    if isinstance(store, MemoryStore):
        pytest.skip("the memory store keeps typed records: nothing to spoil")
    if isinstance(store, RedisStore):
        key = store.key(job_id)
        if garbage == "state":
            store._client.hset(key, "state", "garbage")
        elif garbage == "generation":
            store._client.hset(key, "generation", "twelve")
        else:
            store._client.delete(key)
            store._client.hset(key, "state", "held")
        return
    assert isinstance(store, SqlStore)
    values: dict[str, Any]
    if garbage == "state":
        values = {"state": "garbage"}
    elif garbage == "generation" and store.dialect_name == "sqlite":
        values = {"generation": "twelve"}  # SQLite keeps text in an integer column
    else:
        pytest.skip(f"{store.dialect_name} columns cannot hold this ({garbage})")
    table = store.table
    with store.engine.begin() as conn:
        conn.execute(table.update().where(table.c.job_id == job_id).values(**values))


def raw_record(store: LeaseStore, job_id: str) -> object:
    """The record as the storage holds it, to check that nothing changed it."""
    if isinstance(store, RedisStore):
        return store._client.hgetall(store.key(job_id))
    assert isinstance(store, SqlStore)
    table = store.table
    with store.engine.connect() as conn:
        row = conn.execute(sa.select(table).where(table.c.job_id == job_id)).first()
    return None if row is None else tuple(row)


def acquire(store: LeaseStore, job_id: str) -> Acquired:
    result = store.claim(job_id, A, 30)
    assert isinstance(result, Acquired), result
    return result


@pytest.mark.parametrize("garbage", GARBAGE)
def test_renew_many_answers_the_healthy_leases_and_refuses_the_bad_one(
    store: LeaseStore, garbage: str
) -> None:
    healthy = [acquire(store, f"ok-{n}") for n in range(3)]
    bad = acquire(store, BAD)
    plant(store, BAD, garbage)
    requests = [RenewRequest(h.job_id, A, h.generation, 30) for h in healthy]
    requests.insert(1, RenewRequest(BAD, A, bad.generation, 30))
    results = store.renew_many(requests)
    assert [r.job_id for r in results] == ["ok-0", BAD, "ok-1", "ok-2"]
    refused = results.pop(1)
    assert all(isinstance(r, Renewed) for r in results), results
    assert isinstance(refused, Refusal)
    assert refused.reason is RefusalReason.UNREADABLE
    assert (refused.owner, refused.generation) == (A, bad.generation)
    error = refused.error()
    assert isinstance(error, LeaseLost)
    assert error.reason == "unreadable"
    message = str(error)
    assert BAD in message
    assert "unreadable" in message
    assert "inspect" in message
    assert "delete" in message


@pytest.mark.parametrize("garbage", GARBAGE)
def test_every_operation_on_the_bad_job_raises_unreadable_and_changes_nothing(
    store: LeaseStore, garbage: str
) -> None:
    bad = acquire(store, BAD)
    plant(store, BAD, garbage)
    before = raw_record(store, BAD)
    calls = {
        "get": lambda: store.get(BAD),
        "claim": lambda: store.claim(BAD, "worker-b", 30),
        "claim with a send id": lambda: store.claim(BAD, "worker-b", 30, send_id="s"),
        "renew": lambda: store.renew(BAD, A, bad.generation, 30),
        "complete": lambda: store.complete(BAD, A, bad.generation),
        "release": lambda: store.release(BAD, A, bad.generation),
        "force_release": lambda: store.force_release(BAD, by="ops", reason="test"),
    }
    for name, call in calls.items():
        with pytest.raises(LeaseRecordUnreadable) as info:
            call()
        assert isinstance(info.value, LeaseError)
        assert info.value.job_id == BAD, name
        assert "unreadable" in str(info.value), name
        assert BAD in str(info.value), name
    assert raw_record(store, BAD) == before


@pytest.mark.parametrize("garbage", GARBAGE)
def test_records_skip_the_bad_record_with_a_warning(
    store: LeaseStore, garbage: str, caplog: pytest.LogCaptureFixture
) -> None:
    for n in range(3):
        acquire(store, f"ok-{n}")
    acquire(store, BAD)
    plant(store, BAD, garbage)
    with caplog.at_level(logging.WARNING, logger="celery_leases.stores"):
        listed = sorted(r.job_id for r in store.records())
        held = sorted(r.job_id for r in store.records(state="held"))
    assert listed == ["ok-0", "ok-1", "ok-2"]
    assert held == ["ok-0", "ok-1", "ok-2"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings, "the skipped record was not reported"
    assert all(BAD in r.getMessage() for r in warnings)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_purge_leaves_the_bad_record_alone(store: LeaseStore, garbage: str) -> None:
    acquire(store, BAD)
    plant(store, BAD, garbage)
    before = raw_record(store, BAD)
    assert store.purge(60) == 0
    assert raw_record(store, BAD) == before


def test_force_release_of_a_bad_job_is_not_a_configuration_error(store: LeaseStore) -> None:
    acquire(store, BAD)
    plant(store, BAD, "state")
    with pytest.raises(LeaseRecordUnreadable):
        store.force_release(BAD, by="ops", reason="test")
    assert not issubclass(LeaseRecordUnreadable, LeaseConfigurationError)
