"""The DDL of the lease, queued-mark, waiter and fence tables, as the SQL store emits it.

The migration runs this text instead of Django's own ``CREATE TABLE``, so a
table made by ``manage.py migrate`` is the table ``SqlStore`` would make
(column types, defaults, the index and its name).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing.sql import DEFAULT_FENCE_TABLE, fence_table
from celery_leases.stores.sql import (
    DEFAULT_TABLE_NAME,
    dialect_named,
    indexes_in,
    lease_table,
    queued_table,
    waiters_table,
)

__all__ = ["create_statements", "drop_statements"]


def _dialect(vendor: str) -> Any:
    """SQLAlchemy's dialect of a Django connection's vendor (MariaDB's too is "mysql")."""
    try:
        return dialect_named(vendor, "the celery_leases tables").compiler()
    except LeaseConfigurationError as exc:
        raise LeaseConfigurationError(
            f"{exc}; point the migration at one with a database router, or leave "
            "celery_leases.contrib.django out of INSTALLED_APPS"
        ) from None


def _tables() -> list[sa.Table]:
    metadata = sa.MetaData()
    leases = lease_table(metadata, DEFAULT_TABLE_NAME)
    return [
        leases,
        queued_table(metadata, leases),
        waiters_table(metadata, leases),
        fence_table(metadata, DEFAULT_FENCE_TABLE),
    ]


def create_statements(vendor: str) -> list[str]:
    """``CREATE TABLE`` and ``CREATE INDEX`` text for a Django connection's vendor.

    Raises:
        LeaseConfigurationError: the vendor is not PostgreSQL, SQLite or MySQL.
    """
    dialect = _dialect(vendor)
    statements = []
    for table in _tables():
        statements.append(str(sa.schema.CreateTable(table).compile(dialect=dialect)).strip())
        statements.extend(
            str(sa.schema.CreateIndex(index).compile(dialect=dialect)).strip()
            for index in indexes_in(table, dialect.name)
        )
    return statements


def drop_statements(vendor: str) -> list[str]:
    """``DROP TABLE`` text, the reverse of :func:`create_statements`."""
    dialect = _dialect(vendor)
    return [
        str(sa.schema.DropTable(table).compile(dialect=dialect)).strip()
        for table in reversed(_tables())
    ]
