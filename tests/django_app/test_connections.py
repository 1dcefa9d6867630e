"""The ``django://`` store connects as Django does: the same server, database,
user, schema path and encryption, whatever the ``DATABASES`` entry holds.

tests/integration/test_django.py runs these tests on PostgreSQL with a
socket folder as ``HOST``, a ``search_path`` in ``OPTIONS["options"]``, a
``service`` and ``sslmode``/``sslrootcert``; elsewhere they run on the
shop's own entry.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from orders.models import Order

from celery_leases.contrib.django.models import Lease
from celery_leases.errors import LeaseConfigurationError
from celery_leases.stores import LeaseStore, open_store
from celery_leases.stores.base import LeaseState
from celery_leases.stores.sql import SqlStore
from tests.django_app.conftest import url_of_this_database
from tests.django_app.test_exactly_once import held_by_this_process, ship_here, shipments

pytestmark = pytest.mark.django_db(transaction=True)

#: what a connection sees: where it is, as whom, which lease table its name
#: finds, and whether it is encrypted
SEEN = {
    "postgresql": "SELECT current_database(), current_user, current_setting('search_path'), "
    "inet_server_addr()::text, to_regclass('celery_leases')::oid::text, "
    "(SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid())",
    "mysql": "SELECT DATABASE(), CURRENT_USER(), @@port, "
    "(SELECT VARIABLE_VALUE FROM information_schema.SESSION_STATUS "
    "WHERE VARIABLE_NAME = 'Ssl_cipher')",
    "sqlite": "SELECT file FROM pragma_database_list WHERE name = 'main'",
}


def seen_by_django() -> tuple[Any, ...]:
    with connection.cursor() as cursor:
        cursor.execute(SEEN[connection.vendor])
        row = cursor.fetchone()
    assert row is not None
    return tuple(row)


def seen_by(store: LeaseStore) -> tuple[Any, ...]:
    assert isinstance(store, SqlStore)
    with store.engine.connect() as connection_of_store:
        return tuple(connection_of_store.exec_driver_sql(SEEN[connection.vendor]).one())


def test_the_django_store_connects_where_django_does(django_store: LeaseStore) -> None:
    assert seen_by(django_store) == seen_by_django()


def test_the_django_store_finds_the_migrated_table(django_store: LeaseStore) -> None:
    claimed = django_store.claim("job-c1", "owner-1", 30)
    assert Lease.objects.get(pk="job-c1").generation == claimed.generation  # type: ignore[union-attr]


def test_an_exactly_once_block_completes_on_the_django_store(django_store: LeaseStore) -> None:
    task = held_by_this_process(django_store)
    ship_here(task, Order.objects.create())
    assert shipments(task.lease.job_id) == [1]
    assert django_store.get(task.lease.job_id).state is LeaseState.COMPLETED  # type: ignore[union-attr]


def test_an_exactly_once_block_takes_a_url_of_where_django_connects() -> None:
    store = open_store(
        url_of_this_database().render_as_string(hide_password=False), create_table=False
    )
    try:
        assert seen_by(store) == seen_by_django()
        task = held_by_this_process(store)
        ship_here(task, Order.objects.create())
        assert shipments(task.lease.job_id) == [1]
    finally:
        store.close()


def test_a_database_of_the_same_name_elsewhere_is_refused() -> None:
    """Same server, same database name, another schema: another lease table."""
    if connection.vendor != "postgresql":
        return  # MySQL's and SQLite's tables have no schema path
    with connection.cursor() as cursor:
        cursor.execute("CREATE SCHEMA IF NOT EXISTS elsewhere")
    url = url_of_this_database()
    # the store makes its own lease table in the first schema of its path
    store = open_store(
        url.update_query_dict({"options": "-c search_path=elsewhere"}).render_as_string(
            hide_password=False
        ),
        create_table=True,
    )
    try:
        task = held_by_this_process(store)
        with pytest.raises(LeaseConfigurationError, match="needs the lease store on the database"):
            ship_here(task, Order.objects.create())
    finally:
        store.close()
        with connection.cursor() as cursor:
            cursor.execute("DROP SCHEMA elsewhere CASCADE")
