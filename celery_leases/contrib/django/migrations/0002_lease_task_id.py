"""The lease table's ``task_id`` column (a table made by 0001 of an earlier version lacks it)."""

from __future__ import annotations

from typing import Any

from django.db import migrations

import celery_leases.contrib.django.models
from celery_leases.contrib.django.schema import add_column_statements_for, ddl_locked
from celery_leases.stores.sql_table import DEFAULT_TABLE_NAME


def _add_missing_columns(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    # under the lock a SQL store takes to add the same columns to the same
    # table, so the two never both find a column missing
    with ddl_locked(connection) as cursor:
        present = {
            column.name
            for column in connection.introspection.get_table_description(cursor, DEFAULT_TABLE_NAME)
        }
        for statement in add_column_statements_for(connection.vendor, present):
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("celery_leases", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            # the column stays when migrating back: the older state ignores it,
            # and the SQL store would add it again
            database_operations=[
                migrations.RunPython(_add_missing_columns, migrations.RunPython.noop)
            ],
            state_operations=[
                migrations.AddField(
                    model_name="lease",
                    name="task_id",
                    field=celery_leases.contrib.django.models.ExactTextField(
                        db_default="", max_length=255
                    ),
                ),
            ],
        )
    ]
