"""PostgreSQL: the lease table's index leaves out held records (a table made
by 0001 of an earlier version has one led by ``state`` that fenced updates
could walk instead of the primary key; see
:mod:`celery_leases.stores.sql_indexes`). Elsewhere nothing changes."""

from __future__ import annotations

from typing import Any

from django.db import migrations, transaction

from celery_leases.contrib.django.schema import ddl_locked, index_statements_for
from celery_leases.stores.sql_table import DEFAULT_TABLE_NAME


def _change_index(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    # the build, then the drop, each in a transaction of its own (a DROP
    # INDEX in the build's could deadlock with a transaction waiting for it)
    # and each under the lock a SQL store takes to change the same index,
    # so the two never both build or drop it
    for step in (0, 1):
        with transaction.atomic(using=connection.alias), ddl_locked(connection) as cursor:
            present = set(connection.introspection.get_constraints(cursor, DEFAULT_TABLE_NAME))
            for statement in index_statements_for(connection.vendor, present)[step]:
                schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("celery_leases", "0002_lease_task_id")]
    atomic = False  # its two transactions are its own

    # the index stays when migrating back: no model state names it, and the
    # SQL store would change it again
    operations = [migrations.RunPython(_change_index, migrations.RunPython.noop)]
