"""Fenced SQL writes on real PostgreSQL, SQLite and MariaDB.

Every test runs on each database. The worked example everywhere: A writes
with generation 7 after B wrote with 8, and the target refuses A.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseLost,
    LeaseRecordUnreadable,
    StaleFencingToken,
)
from celery_leases.fencing import FenceResult, Token
from celery_leases.fencing.http import FenceChecker, fencing_headers
from celery_leases.fencing.sql import (
    SqlFences,
    advance_fence,
    create_fence_table,
    fenced_execute,
    fenced_transaction,
    fenced_update,
    fenced_upsert,
)
from celery_leases.stores.base import Acquired
from celery_leases.stores.sql import SqlStore
from tests.by_path import load_file
from tests.operations import at_once

A = Token("job-1", 7, owner="worker-a")
B = Token("job-1", 8, owner="worker-b")

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture
def engine(sql_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sql_url)
    yield engine
    engine.dispose()


@pytest.fixture
def tables(engine: sa.Engine, unique: str) -> tuple[sa.Table, sa.Table]:
    """(fences, items): a fence table and a user table with a fence column."""
    fences = create_fence_table(engine, f"fences_{unique}")
    metadata = sa.MetaData()
    items = sa.Table(
        f"items_{unique}",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("value", sa.String(64), nullable=False),
        sa.Column("fence_generation", sa.BigInteger, nullable=True),
    )
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(items).values(id=1, value="initial", fence_generation=None))
    return fences, items


def value_of(engine: sa.Engine, items: sa.Table, item_id: int = 1) -> str | None:
    with engine.connect() as conn:
        found = conn.execute(sa.select(items.c.value).where(items.c.id == item_id)).scalar()
    return None if found is None else str(found)


def write(
    engine: sa.Engine,
    tables: tuple[sa.Table, sa.Table],
    token: Token,
    value: str,
    **options: Any,
) -> FenceResult:
    fences, items = tables
    with engine.begin() as conn:
        return fenced_execute(
            conn,
            sa.update(items).where(items.c.id == 1).values(value=value),
            resource="item:1",
            token=token,
            fences=fences,
            **options,
        )


# --- fence table ---------------------------------------------------------------


def test_worked_example_stale_write_is_refused(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    write(engine, tables, B, "from 8")
    with pytest.raises(StaleFencingToken) as refused:
        write(engine, tables, A, "from 7")
    assert refused.value.accepted == 8
    assert refused.value.generation == 7
    assert refused.value.resource == "item:1"
    assert value_of(engine, tables[1]) == "from 8"


def test_first_and_newer_writes_apply_with_rowcount(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    first = write(engine, tables, A, "from 7")
    second = write(engine, tables, B, "from 8")
    assert first.applied
    assert first.rowcount == 1
    assert second.applied
    assert second.rowcount == 1
    assert value_of(engine, tables[1]) == "from 8"


def test_fence_records_newest_job_and_generation(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    write(engine, tables, A, "from 7")
    write(engine, tables, B, "from 8")
    assert SqlFences(engine, tables[0]).accepted("item:1") == Token("job-1", 8)


def test_repeat_applies_by_default(engine: sa.Engine, tables: tuple[sa.Table, sa.Table]) -> None:
    write(engine, tables, A, "first")
    again = write(engine, tables, A, "second")
    assert again.applied
    assert value_of(engine, tables[1]) == "second"


def test_repeat_is_refused_when_asked(engine: sa.Engine, tables: tuple[sa.Table, sa.Table]) -> None:
    write(engine, tables, A, "first", on_repeat="refuse")
    with pytest.raises(StaleFencingToken) as refused:
        write(engine, tables, A, "second", on_repeat="refuse")
    assert refused.value.accepted == 7
    assert value_of(engine, tables[1]) == "first"


def test_accepted_repeat_skips_the_statement(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    write(engine, tables, A, "first", on_repeat="accept")
    again = write(engine, tables, A, "second", on_repeat="accept")
    assert again.applied is False
    assert again.previous == 7
    assert value_of(engine, tables[1]) == "first"


def test_same_generation_of_another_job_is_refused(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    write(engine, tables, Token("job-1", 7), "job 1")
    with pytest.raises(StaleFencingToken):
        write(engine, tables, Token("job-2", 7), "job 2")
    assert value_of(engine, tables[1]) == "job 1"


def test_fence_and_write_roll_back_together(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    """A write that fails leaves the fence where it was: a retry with 7 works."""
    fences, items = tables
    duplicate = sa.insert(items).values(id=1, value="dup")  # primary key clash
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        fenced_execute(conn, duplicate, resource="item:1", token=B, fences=fences)
    assert SqlFences(engine, fences).accepted("item:1") is None
    assert write(engine, tables, A, "from 7").applied


def test_refused_write_keeps_the_transaction_usable(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    fences, items = tables
    write(engine, tables, B, "from 8")
    with engine.begin() as conn:
        with pytest.raises(StaleFencingToken):
            advance_fence(conn, "item:1", A, fences=fences)
        conn.execute(sa.update(items).values(value="other work"))
    assert value_of(engine, items) == "other work"


def test_unfenced_update_lets_the_stale_write_land(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    """The same schedule without a fence: A's late write overwrites B's."""
    _, items = tables
    for value in ("from 8", "from 7"):  # B, then the stale A
        with engine.begin() as conn:
            conn.execute(sa.update(items).where(items.c.id == 1).values(value=value))
    assert value_of(engine, items) == "from 7"


def test_sql_fences_back_a_fence_checker(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    checker = FenceChecker(SqlFences(engine, tables[0]))
    checker.check(fencing_headers(B), resource="report")
    with pytest.raises(StaleFencingToken) as refused:
        checker.check(fencing_headers(A), resource="report")
    assert refused.value.accepted == 8


# --- fence column --------------------------------------------------------------


def column_write(
    engine: sa.Engine, items: sa.Table, token: Token, value: str, **options: Any
) -> FenceResult:
    with engine.begin() as conn:
        return fenced_update(
            conn,
            items,
            {"value": value},
            where=items.c.id == 1,
            token=token,
            **options,
        )


def test_fence_column_refuses_the_worked_example(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    _, items = tables
    assert column_write(engine, items, B, "from 8").applied
    with pytest.raises(StaleFencingToken) as refused:
        column_write(engine, items, A, "from 7")
    assert refused.value.accepted == 8
    assert refused.value.resource == items.name
    assert value_of(engine, items) == "from 8"


def test_fence_column_stores_the_generation(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    _, items = tables
    column_write(engine, items, A, "from 7")
    with engine.connect() as conn:
        stored = conn.execute(sa.select(items.c.fence_generation)).scalar_one()
    assert stored == 7


def test_fence_column_repeat_modes(engine: sa.Engine, tables: tuple[sa.Table, sa.Table]) -> None:
    _, items = tables
    column_write(engine, items, A, "first")
    assert column_write(engine, items, A, "second").applied
    skipped = column_write(engine, items, A, "third", on_repeat="accept")
    assert skipped.applied is False
    with pytest.raises(StaleFencingToken):
        column_write(engine, items, A, "fourth", on_repeat="refuse")
    assert value_of(engine, items) == "second"


def test_fence_column_update_of_no_row_reports_not_applied(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    _, items = tables
    with engine.begin() as conn:
        result = fenced_update(conn, items, {"value": "x"}, where=items.c.id == 99, token=A)
    assert (result.applied, result.rowcount) == (False, 0)


def test_missing_fence_column_is_a_configuration_error(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    _, items = tables
    with pytest.raises(LeaseConfigurationError, match="no fence column"), engine.begin() as conn:
        fenced_update(
            conn, items, {"value": "x"}, where=items.c.id == 1, token=A, fence_column="nope"
        )


def test_fenced_upsert_inserts_updates_and_refuses(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    _, items = tables
    with engine.begin() as conn:
        inserted = fenced_upsert(conn, items, {"id": 2, "value": "from 7"}, token=A)
    with engine.begin() as conn:
        updated = fenced_upsert(conn, items, {"id": 2, "value": "from 8"}, token=B)
    with pytest.raises(StaleFencingToken) as refused, engine.begin() as conn:
        fenced_upsert(conn, items, {"id": 2, "value": "late 7"}, token=A)
    assert inserted.applied
    assert updated.applied
    assert refused.value.accepted == 8
    assert value_of(engine, items, 2) == "from 8"


def test_fenced_upsert_accepted_repeat_is_a_no_op(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    _, items = tables
    with engine.begin() as conn:
        fenced_upsert(conn, items, {"id": 3, "value": "first"}, token=A)
    with engine.begin() as conn:
        again = fenced_upsert(
            conn, items, {"id": 3, "value": "second"}, token=A, on_repeat="accept"
        )
    assert again.applied is False
    assert value_of(engine, items, 3) == "first"


def test_fenced_upsert_needs_the_primary_key(
    engine: sa.Engine, tables: tuple[sa.Table, sa.Table]
) -> None:
    _, items = tables
    with pytest.raises(LeaseConfigurationError, match="primary key"), engine.begin() as conn:
        fenced_upsert(conn, items, {"value": "x"}, token=A)


# --- the docs example ------------------------------------------------------------


def test_docs_sql_example_refuses_the_stale_run(engine: sa.Engine) -> None:
    example = load_file("docs_fenced_sql", EXAMPLES / "fenced_sql_write.py")
    example.metadata.create_all(engine)
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(example.balances).values(account="acct", balance=0))
        example.set_balance(engine, B, "acct", 80)
        with pytest.raises(StaleFencingToken):
            example.set_balance(engine, A, "acct", 70)
        with engine.connect() as conn:
            balance = conn.execute(sa.select(example.balances.c.balance)).scalar_one()
        assert balance == 80
    finally:
        example.metadata.drop_all(engine)


# --- lease check in the same transaction --------------------------------------------


@pytest.fixture
def lease_store(sql_url: str, unique: str) -> Iterator[SqlStore]:
    store = SqlStore.from_url(sql_url, table_name=f"leases_{unique}")
    yield store
    store.close()


@pytest.fixture
def results_table(lease_store: SqlStore, unique: str) -> sa.Table:
    metadata = sa.MetaData()
    table = sa.Table(
        f"results_{unique}",
        metadata,
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(64), nullable=False),
    )
    metadata.create_all(lease_store.engine)
    return table


def claim(store: SqlStore, owner: str, ttl: float = 30.0) -> Token:
    result = store.claim("job-1", owner, ttl)
    assert isinstance(result, Acquired), result
    return Token("job-1", result.generation, owner)


def results(store: SqlStore, table: sa.Table) -> list[str]:
    with store.engine.connect() as conn:
        return [str(v) for v in conn.execute(sa.select(table.c.value)).scalars()]


def test_concurrent_fence_table_creation_does_not_fail(sql_url: str, unique: str) -> None:
    engine = sa.create_engine(sql_url, pool_size=8)
    try:
        outcomes = at_once(8, lambda _: create_fence_table(engine, f"fences_race_{unique}"))
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert errors == []
        assert sa.inspect(engine).has_table(f"fences_race_{unique}")
    finally:
        engine.dispose()


def test_fenced_transaction_commits_while_the_lease_is_current(
    lease_store: SqlStore, results_table: sa.Table
) -> None:
    lease = claim(lease_store, "worker-a")
    with fenced_transaction(lease_store, lease) as conn:
        conn.execute(sa.insert(results_table).values(job_id="job-1", value="a"))
    assert results(lease_store, results_table) == ["a"]


def wait_until_run_out(store: SqlStore, job_id: str) -> None:
    record = store.get(job_id)
    assert record is not None
    deadline = time.monotonic() + 10
    while store.now_ms() <= record.lease_until_ms + 50:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_fenced_transaction_refuses_a_superseded_holder(
    lease_store: SqlStore, results_table: sa.Table
) -> None:
    stale = claim(lease_store, "worker-a", ttl=0.2)
    wait_until_run_out(lease_store, "job-1")
    newer = claim(lease_store, "worker-b")
    with pytest.raises(LeaseLost) as lost, fenced_transaction(lease_store, stale) as conn:
        conn.execute(sa.insert(results_table).values(job_id="job-1", value="stale"))
    assert lost.value.reason == "superseded"
    assert lost.value.generation == stale.generation
    assert str(newer.generation) in str(lost.value)
    assert results(lease_store, results_table) == []


def test_fenced_transaction_refuses_a_run_out_lease_nobody_claimed(
    lease_store: SqlStore, results_table: sa.Table
) -> None:
    lease = claim(lease_store, "worker-a", ttl=0.2)
    wait_until_run_out(lease_store, "job-1")
    with pytest.raises(LeaseLost) as lost, fenced_transaction(lease_store, lease):
        pytest.fail("the body must not run")
    assert lost.value.reason == "expired"


def test_fenced_transaction_refuses_after_completion(lease_store: SqlStore) -> None:
    lease = claim(lease_store, "worker-a")
    lease_store.complete("job-1", "worker-a", lease.generation)
    with pytest.raises(LeaseLost) as lost, fenced_transaction(lease_store, lease):
        pytest.fail("the body must not run")
    assert lost.value.reason == "completed"


def test_fenced_transaction_rolls_back_on_error(
    lease_store: SqlStore, results_table: sa.Table
) -> None:
    lease = claim(lease_store, "worker-a")

    def task_body() -> None:
        with fenced_transaction(lease_store, lease) as conn:
            conn.execute(sa.insert(results_table).values(job_id="job-1", value="a"))
            raise RuntimeError("task failed half-way")

    with pytest.raises(RuntimeError):
        task_body()
    assert results(lease_store, results_table) == []


def test_fenced_transaction_on_an_unreadable_record_says_so(lease_store: SqlStore) -> None:
    lease = claim(lease_store, "worker-a")
    table = lease_store.table
    with lease_store.engine.begin() as conn:
        conn.execute(table.update().where(table.c.job_id == "job-1").values(state="garbage"))
    with (
        pytest.raises(LeaseRecordUnreadable, match="unreadable") as unreadable,
        fenced_transaction(lease_store, lease),
    ):
        pytest.fail("the body must not run")
    assert unreadable.value.job_id == "job-1"
    assert table.name in str(unreadable.value)


def test_fenced_transaction_needs_the_owner(lease_store: SqlStore) -> None:
    with (
        pytest.raises(LeaseConfigurationError, match="owner"),
        fenced_transaction(lease_store, Token("job-1", 7)),
    ):
        pytest.fail("the body must not run")
