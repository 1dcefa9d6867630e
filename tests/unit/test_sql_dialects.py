"""One dialect table for the SQL store, the fenced SQL targets and the Django app."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from celery_leases import LeaseConfigurationError
from celery_leases.fencing.sql_dialect import insert_for, now_ms
from celery_leases.stores.sql import (
    MYSQL_NOW_MS,
    MYSQL_ROW_EXISTED,
    POSTGRES_NOW_MS,
    SQLITE_NOW_MS,
    dialect_named,
    lease_table,
    lock_on_duplicate,
)


@pytest.mark.parametrize(
    ("name", "clock"),
    [
        ("postgresql", POSTGRES_NOW_MS),
        ("sqlite", SQLITE_NOW_MS),
        ("mysql", MYSQL_NOW_MS),
        ("mariadb", MYSQL_NOW_MS),
    ],
)
def test_each_database_has_its_clock(name: str, clock: str) -> None:
    dialect = dialect_named(name, "the test")
    assert str(dialect.now_ms()) == clock
    # the DDL of the Django app compiles with the same entry
    assert dialect.compiler().name in (name, "mysql")


def test_a_database_of_another_kind_is_named_with_what_needs_it() -> None:
    with pytest.raises(LeaseConfigurationError, match=r"^fenced SQL writes: .*MySQL.*'oracle'"):
        dialect_named("oracle", "fenced SQL writes")


def test_the_fenced_targets_read_the_store_s_table() -> None:
    engine = sa.create_engine("sqlite://")
    table = lease_table(sa.MetaData(), "leases")
    with engine.connect() as conn:
        assert str(now_ms(conn)) == SQLITE_NOW_MS
        assert "ON CONFLICT" in str(
            insert_for(conn, table)
            .values(job_id="a")
            .on_conflict_do_nothing()
            .compile(dialect=conn.dialect)
        )
    engine.dispose()


def test_mysql_s_upsert_that_locks_sets_the_marker_and_changes_nothing() -> None:
    table = lease_table(sa.MetaData(), "leases")
    statement = lock_on_duplicate(mysql.insert(table).values(job_id="a"), table.c.job_id)
    sql = str(statement.compile(dialect=mysql.dialect()))
    assert "ON DUPLICATE KEY UPDATE job_id = IF(LAST_INSERT_ID(" in sql
    assert statement.compile(dialect=mysql.dialect()).params["LAST_INSERT_ID_1"] == (
        MYSQL_ROW_EXISTED
    )
