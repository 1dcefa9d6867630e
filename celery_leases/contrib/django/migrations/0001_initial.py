"""The lease table, the tables of queued marks and waiters, and the fence table (the SQL DDL)."""

from __future__ import annotations

from typing import Any

import django.db.models.functions.datetime
from django.db import migrations, models

import celery_leases.contrib.django.models
from celery_leases.contrib.django.schema import create_statements, drop_statements


def _create(apps: Any, schema_editor: Any) -> None:
    for statement in create_statements(schema_editor.connection.vendor):
        schema_editor.execute(statement)


def _drop(apps: Any, schema_editor: Any) -> None:
    for statement in drop_statements(schema_editor.connection.vendor):
        schema_editor.execute(statement)


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(_create, _drop)],
            state_operations=[
                migrations.CreateModel(
                    name="Lease",
                    fields=[
                        (
                            "job_id",
                            celery_leases.contrib.django.models.ExactTextField(
                                max_length=255, primary_key=True, serialize=False
                            ),
                        ),
                        (
                            "owner",
                            celery_leases.contrib.django.models.ExactTextField(
                                db_default="", max_length=255
                            ),
                        ),
                        ("generation", models.BigIntegerField()),
                        ("lease_until", models.BigIntegerField()),
                        (
                            "state",
                            models.CharField(
                                choices=[
                                    ("held", "held"),
                                    ("released", "released"),
                                    ("completed", "completed"),
                                ],
                                max_length=16,
                            ),
                        ),
                        ("task_name", models.CharField(db_default="", max_length=255)),
                        ("claimed_at", models.BigIntegerField(null=True)),
                        ("renewed_at", models.BigIntegerField(null=True)),
                        ("completed_at", models.BigIntegerField(null=True)),
                        ("renew_count", models.IntegerField(db_default=0)),
                        ("takeovers", models.IntegerField(db_default=0)),
                        (
                            "send_id",
                            celery_leases.contrib.django.models.ExactTextField(
                                db_default="", max_length=255
                            ),
                        ),
                        ("outcome", models.BinaryField(null=True)),
                        ("released_at", models.BigIntegerField(null=True)),
                        ("released_by", models.CharField(db_default="", max_length=255)),
                        ("release_reason", models.TextField(db_default="")),
                        (
                            "task_id",
                            celery_leases.contrib.django.models.ExactTextField(
                                db_default="", max_length=255
                            ),
                        ),
                    ],
                    options={"verbose_name": "lease", "db_table": "celery_leases"},
                ),
                migrations.CreateModel(
                    name="QueuedMark",
                    fields=[
                        (
                            "job_id",
                            celery_leases.contrib.django.models.ExactTextField(
                                max_length=255, primary_key=True, serialize=False
                            ),
                        ),
                        (
                            "task_id",
                            celery_leases.contrib.django.models.ExactTextField(max_length=255),
                        ),
                        ("queued_at", models.BigIntegerField()),
                        ("queued_until", models.BigIntegerField()),
                    ],
                    options={"verbose_name": "queued mark", "db_table": "celery_leases_queued"},
                ),
                migrations.CreateModel(
                    name="Waiter",
                    fields=[
                        (
                            "pk",
                            models.CompositePrimaryKey(
                                "job_id",
                                "send_id",
                                blank=True,
                                editable=False,
                                primary_key=True,
                                serialize=False,
                            ),
                        ),
                        (
                            "job_id",
                            celery_leases.contrib.django.models.ExactTextField(max_length=255),
                        ),
                        (
                            "send_id",
                            celery_leases.contrib.django.models.ExactTextField(max_length=255),
                        ),
                        (
                            "task_id",
                            celery_leases.contrib.django.models.ExactTextField(max_length=255),
                        ),
                        ("waiting_since", models.BigIntegerField()),
                        ("waiting_until", models.BigIntegerField()),
                        ("payload", models.BinaryField()),
                    ],
                    options={"verbose_name": "waiter", "db_table": "celery_leases_waiters"},
                ),
                migrations.CreateModel(
                    name="Fence",
                    fields=[
                        (
                            "resource",
                            celery_leases.contrib.django.models.ExactTextField(
                                max_length=255, primary_key=True, serialize=False
                            ),
                        ),
                        (
                            "job_id",
                            celery_leases.contrib.django.models.ExactTextField(max_length=255),
                        ),
                        ("generation", models.BigIntegerField()),
                        (
                            "updated_at",
                            models.DateTimeField(
                                db_default=django.db.models.functions.datetime.Now()
                            ),
                        ),
                    ],
                    options={"verbose_name": "fence", "db_table": "celery_leases_fences"},
                ),
            ],
        )
    ]
