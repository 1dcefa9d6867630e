"""The migration makes the tables the SQL store and the SQL fences make; django:// opens them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from django.core.management import call_command
from django.db import connection

from celery_leases.contrib.django.models import Lease
from celery_leases.contrib.django.store import connection_arguments
from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing.sql import create_fence_table
from celery_leases.stores import LeaseStore, open_store
from celery_leases.stores.sql import SqlStore, create_table

pytestmark = pytest.mark.django_db(transaction=True)


def describe(engine: sa.Engine | None = None) -> dict[str, Any]:
    """Columns (type, nullable, default, key) and indexes of the four tables.

    Without an engine: of the test database.
    """
    if engine is None:
        engine = django_engine()
        try:
            return describe(engine)
        finally:
            engine.dispose()
    inspector = sa.inspect(engine)
    found: dict[str, Any] = {}
    for table in (
        "celery_leases",
        "celery_leases_queued",
        "celery_leases_waiters",
        "celery_leases_fences",
    ):
        found[table] = {
            "columns": [
                (c["name"], str(c["type"]), c["nullable"], c["default"])
                for c in inspector.get_columns(table)
            ],
            "primary_key": inspector.get_pk_constraint(table)["constrained_columns"],
            "indexes": sorted(
                (
                    i["name"],
                    tuple(i["column_names"]),
                    bool(i["unique"]),
                    # PostgreSQL's partial index: which records it leaves out
                    i.get("dialect_options", {}).get("postgresql_where"),
                )
                for i in inspector.get_indexes(table)
            ),
        }
    return found


def django_engine(**arguments: Any) -> sa.Engine:
    """An engine connecting as Django does to the test database; ``arguments``
    change the connection's."""
    url, given = connection_arguments()
    return sa.create_engine(url, connect_args={**given, **arguments})


@pytest.fixture
def fresh_engine(tmp_path: Path) -> Iterator[sa.Engine]:
    """An empty database of the same kind as the test database."""
    if connection.vendor == "sqlite":
        engine = sa.create_engine(f"sqlite:///{tmp_path / 'fresh.sqlite3'}")
        yield engine
        engine.dispose()
        return
    name = f"fresh_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {name}")
    engine = django_engine(**{"dbname" if connection.vendor == "postgresql" else "database": name})
    yield engine
    engine.dispose()
    with connection.cursor() as cursor:
        cursor.execute(f"DROP DATABASE {name}")


def test_the_migrated_tables_are_the_tables_the_sql_store_makes(fresh_engine: sa.Engine) -> None:
    create_table(fresh_engine)
    create_fence_table(fresh_engine)
    assert describe() == describe(fresh_engine)


def test_the_sql_store_takes_the_migrated_table_as_it_is(django_store: LeaseStore) -> None:
    before = describe()
    # create_table=True checks the table and takes it as it is
    url, arguments = connection_arguments()
    store = SqlStore.from_url(url.render_as_string(), connect_args=arguments)
    try:
        claimed = store.claim("job-1", "owner-1", 30, task_name="orders.tasks.charge")
        assert store.complete("job-1", "owner-1", claimed.generation, outcome=b"42")  # type: ignore[union-attr]
    finally:
        store.close()
    assert describe() == before
    lease = Lease.objects.get(pk="job-1")
    assert lease.record() == django_store.get("job-1")
    assert (lease.state, bytes(lease.outcome)) == ("completed", b"42")


def test_the_model_reads_the_task_id_the_store_keeps(django_store: LeaseStore) -> None:
    django_store.claim("job-4", "owner-4", 30, send_id="send-4", task_id="celery-task-4")
    lease = Lease.objects.get(task_id="celery-task-4")
    assert lease.record() == django_store.get("job-4")
    assert (lease.job_id, lease.record().task_id) == ("job-4", "celery-task-4")


def test_the_models_match_their_migrations() -> None:
    # makemigrations --check exits non-zero when a model has changes that no
    # migration makes
    call_command("makemigrations", "celery_leases", "--check", "--dry-run", verbosity=0)


def test_a_django_url_opens_the_database_of_its_alias(django_store: LeaseStore) -> None:
    url, _ = connection_arguments("default")
    if connection.vendor == "sqlite":
        # an absolute path: the four slashes a hand-written URL needs
        assert str(url).startswith("sqlite:////")
        assert url.database == str(connection.settings_dict["NAME"])
    else:
        driver = {"postgresql": "postgresql+psycopg", "mysql": "mysql+pymysql"}[connection.vendor]
        assert (url.drivername, url.database) == (driver, connection.settings_dict["NAME"])
    acquired = django_store.claim("job-2", "owner-2", 30)
    assert Lease.objects.get(pk="job-2").generation == acquired.generation  # type: ignore[union-attr]


def test_a_django_url_naming_no_database_alias_is_refused() -> None:
    with pytest.raises(LeaseConfigurationError, match="'reporting', which is not in DATABASES"):
        open_store("django://reporting")


def test_the_store_does_not_make_the_table_the_migration_owns(django_store: LeaseStore) -> None:
    call_command("migrate", "celery_leases", "zero", verbosity=0)
    try:
        store = open_store("django://default")
        try:
            with pytest.raises(LeaseConfigurationError):
                store.get("job-3")
        finally:
            store.close()
        assert "celery_leases" not in connection.introspection.table_names()
    finally:
        call_command("migrate", "celery_leases", verbosity=0)
