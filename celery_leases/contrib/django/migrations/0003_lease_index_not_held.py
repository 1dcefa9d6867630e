"""PostgreSQL: the lease table's index leaves out held records (a table made
by 0001 of an earlier version has one led by ``state`` that fenced updates
could walk instead of the primary key; see
:mod:`celery_leases.stores.sql_indexes`). Elsewhere nothing changes."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from django.db import migrations, transaction

from celery_leases.contrib.django.schema import (
    INVALID_INDEXES,
    ddl_locked,
    index_statements_for,
)
from celery_leases.stores.sql_indexes import invalid_warning
from celery_leases.stores.sql_table import DEFAULT_TABLE_NAME

logger = logging.getLogger("celery_leases.contrib.django")


def _change_index(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    # the build, then the drop, each in a transaction of its own where DDL
    # can be (a DROP INDEX in the build's could deadlock with a transaction
    # waiting for it; MySQL commits each DDL statement at once) and each
    # under the lock a SQL store takes to change the same index, so the two
    # never both build or drop it
    for step in (0, 1):
        in_transaction = (
            transaction.atomic(using=connection.alias)
            if connection.features.can_rollback_ddl
            else contextlib.nullcontext()
        )
        with in_transaction, ddl_locked(connection) as cursor:
            present = set(connection.introspection.get_constraints(cursor, DEFAULT_TABLE_NAME))
            invalid: set[str] = set()
            if connection.vendor == "postgresql":
                cursor.execute(INVALID_INDEXES, [DEFAULT_TABLE_NAME])
                invalid = {name for (name,) in cursor.fetchall()}
            statements = index_statements_for(connection.vendor, present, invalid)[step]
            if statements and connection.vendor == "postgresql":
                cursor.execute("SET LOCAL statement_timeout = 0")
            for statement in statements:
                schema_editor.execute(statement)
            warning = invalid_warning(
                DEFAULT_TABLE_NAME, invalid, f"Django's database {connection.alias!r}"
            )
            if step == 0 and warning is not None:
                logger.warning("%s", warning)


class Migration(migrations.Migration):
    dependencies = [("celery_leases", "0002_lease_task_id")]
    atomic = False  # its two transactions are its own

    # the index stays when migrating back: no model state names it, and the
    # SQL store would change it again
    operations = [migrations.RunPython(_change_index, migrations.RunPython.noop)]
