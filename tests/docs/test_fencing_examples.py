"""The tasks of docs/examples/fencing_tasks.py, which the fencing guide shows,
run in a worker of this process on SQLite and a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases import LeaseStore, StaleFencingToken
from celery_leases.fencing import Token
from celery_leases.fencing.sql import fenced_execute
from tests.by_path import load_file
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
WAIT = 30.0


def load(name: str) -> ModuleType:
    """A module of docs/examples, loaded from its file."""
    return load_file(name, EXAMPLES / f"{name}.py")


@pytest.fixture(scope="module")
def example(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
) -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        db = tmp_path_factory.mktemp("fencing") / "app.db"
        patch.setenv("FENCING_DB", f"sqlite:///{db}")
        patch.setenv("FENCING_REDIS", redis_server.url)
        module = load("fencing_tasks")
    yield module
    module.store.close()
    module.redis_client.close()
    module.engine.dispose()


@pytest.fixture
def leases_app(example: ModuleType) -> Any:
    return example.app


@pytest.fixture
def lease_store_url(example: ModuleType) -> str:
    # the lease store is the SQLite database of the tables (fenced_transaction)
    return str(example.DB_URL)


@pytest.mark.usefixtures("leases_worker")
def test_fence_table_write_and_a_stale_one(example: ModuleType, lease_store: LeaseStore) -> None:
    with example.engine.begin() as conn:
        conn.execute(sa.insert(example.balances).values(account="acme", balance=0))
    result = example.set_balance.delay("acme", 120)
    result.get(timeout=WAIT)
    record = lease_store.get(result.id)
    assert record is not None
    with example.engine.connect() as conn:
        assert conn.execute(sa.select(example.balances.c.balance)).scalar_one() == 120
    stale = Token(result.id, record.generation - 1)
    with pytest.raises(StaleFencingToken), example.engine.begin() as conn:
        fenced_execute(
            conn,
            sa.update(example.balances).values(balance=-1),
            resource="balance:acme",
            token=stale,
            fences=example.fences,
        )


@pytest.mark.usefixtures("leases_worker")
def test_fence_column_upsert_then_update(example: ModuleType, lease_store: LeaseStore) -> None:
    result = example.write_report.delay(7, "total: 3")
    result.get(timeout=WAIT)
    record = lease_store.get(result.id)
    assert record is not None
    with example.engine.connect() as conn:
        row = conn.execute(sa.select(example.reports).where(example.reports.c.id == 7)).one()
    assert (row.body, row.fence_generation) == ("TOTAL: 3", record.generation)


@pytest.mark.usefixtures("leases_worker")
def test_fenced_transaction_writes_while_the_lease_is_current(example: ModuleType) -> None:
    result = example.record_total.delay(42)
    result.get(timeout=WAIT)
    with example.engine.connect() as conn:
        assert (
            conn.execute(
                sa.select(example.results.c.total).where(example.results.c.job_id == result.id)
            ).scalar_one()
            == 42
        )


@pytest.mark.usefixtures("leases_worker")
def test_redis_fence_writes_the_key_and_its_fence(
    example: ModuleType, lease_store: LeaseStore
) -> None:
    result = example.export_report.delay(5, "body")
    result.get(timeout=WAIT)
    record = lease_store.get(result.id)
    assert record is not None
    assert example.redis_client.get("report:5") == b"body"
    accepted = example.fence.accepted("report:5")
    assert accepted is not None
    assert accepted.generation == record.generation
