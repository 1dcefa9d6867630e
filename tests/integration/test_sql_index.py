"""The SQL lease table's secondary index: what each database gets, that
PostgreSQL's fenced statements find their record by the primary key, and
that a table lacking a column or the index is refused (real PostgreSQL,
SQLite and MariaDB)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import asyncpg

from celery_leases import Acquired, Completed, LeaseConfigurationError
from celery_leases.stores.sql import SqlStore, create_table, lease_table
from tests.servers import PostgresServer

A = "worker-a"


@pytest.fixture
def table_name(unique: str) -> str:
    return f"leases_{unique}"


@pytest.fixture
def postgres_store(postgres_server: PostgresServer, table_name: str) -> Iterator[SqlStore]:
    store = SqlStore.from_url(postgres_server.url, table_name=table_name)
    yield store
    with store.engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {table_name}")
    store.close()


def _indexes(engine: sa.Engine, table_name: str) -> dict[str, dict[str, object]]:
    return {str(i["name"]): dict(i) for i in sa.inspect(engine).get_indexes(table_name)}


def test_each_database_gets_its_index(sql_url: str, table_name: str) -> None:
    store = SqlStore.from_url(sql_url, table_name=table_name)
    try:
        indexes = _indexes(store.engine, table_name)
    finally:
        store.close()
    if sql_url.startswith("postgresql"):
        # the held records left out, so no fenced statement can walk it
        assert set(indexes) == {f"ix_{table_name}_not_held"}
        index = indexes[f"ix_{table_name}_not_held"]
        where = index["dialect_options"]["postgresql_where"]  # type: ignore[index]
        assert "<> 'held'" in where
    else:
        assert set(indexes) == {f"ix_{table_name}_state_completed_at"}
        index = indexes[f"ix_{table_name}_state_completed_at"]
    assert index["column_names"] == ["state", "completed_at"]


#: the fenced statements, which find their record by job id and state 'held'
FENCED = ("complete", "renew", "release", "lock")


def _generic_plan(conn: sa.Connection, store: SqlStore, name: str) -> str:
    """The plan PostgreSQL keeps for a statement the driver prepared (a
    generic plan, made without the parameters' values). The statement is
    written with ``$1`` placeholders, as PREPARE needs them."""
    compiled = getattr(store._statements, name).compile(dialect=asyncpg.dialect())
    values = {
        "p_job_id": "'job-7'",
        "p_owner": f"'{A}'",
        "p_generation": "1",
        "p_ttl_ms": "30000",
        "p_outcome": "NULL",
    }
    arguments = ", ".join(values[key] for key in compiled.positiontup or ())
    conn.exec_driver_sql(f"PREPARE fenced_{name} AS {compiled}")
    plan = conn.exec_driver_sql(f"EXPLAIN EXECUTE fenced_{name}({arguments})").scalars().all()
    return "\n".join(plan)


def test_postgres_fenced_statements_find_their_record_by_the_primary_key(
    postgres_store: SqlStore, table_name: str
) -> None:
    # a table whose statistics say no record is held: the moment at which a
    # generic plan walked an index led by state (every held entry, live or
    # dead) instead of the primary key
    for number in range(300):
        acquired = postgres_store.claim(f"done-{number}", A, 30)
        assert isinstance(acquired, Acquired)
        completed = postgres_store.complete(f"done-{number}", A, acquired.generation)
        assert isinstance(completed, Completed)
    with postgres_store.engine.connect() as conn:
        conn.exec_driver_sql(f"ANALYZE {table_name}")
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        for name in FENCED:
            plan = _generic_plan(conn, postgres_store, name)
            assert f"Index Scan using {table_name}_pkey on {table_name}" in plan, (name, plan)
            assert "ix_" not in plan, (name, plan)
            assert "Seq Scan" not in plan, (name, plan)
        conn.rollback()


def _drop_index(conn: sa.Connection, table_name: str, index: str) -> None:
    on = f" ON {table_name}" if conn.dialect.name in ("mysql", "mariadb") else ""
    conn.exec_driver_sql(f"DROP INDEX {index}{on}")


@pytest.mark.parametrize("lacks", ["column", "index"])
def test_a_table_that_is_not_this_releases_is_refused_and_left_as_it_is(
    sql_url: str, table_name: str, lacks: str
) -> None:
    engine = sa.create_engine(sql_url)
    try:
        create_table(engine, table_name)
        (index,) = _indexes(engine, table_name)
        with engine.begin() as conn:
            if lacks == "column":
                conn.exec_driver_sql(f"ALTER TABLE {table_name} DROP COLUMN task_id")
            else:
                _drop_index(conn, table_name, index)
        columns = [c["name"] for c in sa.inspect(engine).get_columns(table_name)]
        indexes = set(_indexes(engine, table_name))
        missing = "column task_id" if lacks == "column" else f"index {index}"
        starts = {
            "create_table": lambda: create_table(engine, table_name),
            "a store that creates its table": lambda: SqlStore(
                engine, table_name=table_name, create_table=True
            ).close(),
            "a store that does not": lambda: SqlStore(
                engine, table_name=table_name, create_table=False
            ).close(),
        }
        for start_name, start in starts.items():
            with pytest.raises(LeaseConfigurationError) as refused:
                start()
            message = str(refused.value)
            assert f"the table {table_name!r}" in message, start_name
            assert f"is not this release's lease table: it lacks the {missing}." in message
            assert "DROP TABLE" in message
            assert "celery leases init-db" in message
        # nothing was changed
        assert [c["name"] for c in sa.inspect(engine).get_columns(table_name)] == columns
        assert set(_indexes(engine, table_name)) == indexes
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table_name}")
        engine.dispose()


def test_a_table_for_an_unknown_database_is_refused() -> None:
    with pytest.raises(LeaseConfigurationError, match="'postgres'"):
        lease_table(sa.MetaData(), "leases", dialect="postgres")


@pytest.mark.parametrize(
    ("dialect", "index"), [("postgresql", "not_held"), ("sqlite", "state_completed_at")]
)
def test_a_table_for_one_database_carries_its_index_only(dialect: str, index: str) -> None:
    # what Alembic's autogenerate compares a database with
    table = lease_table(sa.MetaData(), "leases", dialect=dialect)
    assert [i.name for i in table.indexes] == [f"ix_leases_{index}"]


def test_a_store_start_on_a_complete_table_does_not_wait_for_the_ddl_lock(
    postgres_store: SqlStore, table_name: str
) -> None:
    # another process creating a table holds this lock; a worker's store
    # start on a table that exists must not wait for it (its lock_timeout
    # of 1 s would end the start with StoreUnavailable)
    url = postgres_store.engine.url.render_as_string(hide_password=False)
    with postgres_store.engine.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))"),
            {"name": f"celery_leases:{table_name}"},
        )
        store = SqlStore.from_url(url, table_name=table_name, timeout=1.0)
        try:
            assert isinstance(store.claim("job-1", A, 30), Acquired)
        finally:
            store.close()
