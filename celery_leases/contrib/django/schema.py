"""The DDL of the lease and fence tables, as the SQL store and the SQL fences emit it.

The migration runs this text instead of Django's own ``CREATE TABLE``, so a
table made by ``manage.py migrate`` is the table ``SqlStore`` would make
(column types, defaults, the index and its name).
"""

from __future__ import annotations

from collections.abc import Iterator, Set
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing.sql import DEFAULT_FENCE_TABLE, fence_table
from celery_leases.stores.sql import DEFAULT_TABLE_NAME, lease_table
from celery_leases.stores.sql_indexes import INVALID_INDEXES as SQL_INVALID_INDEXES
from celery_leases.stores.sql_indexes import index_statements, indexes_in
from celery_leases.stores.sql_table import (
    DDL_LOCKS,
    add_column_statements,
    check_ddl_lock_taken,
    ddl_lock_name,
)

__all__ = [
    "INVALID_INDEXES",
    "add_column_statements_for",
    "create_statements",
    "ddl_lock_for",
    "ddl_locked",
    "drop_statements",
    "index_statements_for",
]

#: Django's connection vendors (MariaDB's too is "mysql") and their dialects
_DIALECTS = {"postgresql": postgresql.dialect, "sqlite": sqlite.dialect, "mysql": mysql.dialect}


def _dialect(vendor: str) -> Any:
    if vendor not in _DIALECTS:
        raise LeaseConfigurationError(
            f"the celery_leases tables need PostgreSQL, SQLite or MySQL/MariaDB, not {vendor!r}: "
            "point the migration at one with a database router, or leave "
            "celery_leases.contrib.django out of INSTALLED_APPS"
        )
    return _DIALECTS[vendor]()


def _tables() -> list[sa.Table]:
    metadata = sa.MetaData()
    return [lease_table(metadata, DEFAULT_TABLE_NAME), fence_table(metadata, DEFAULT_FENCE_TABLE)]


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


def add_column_statements_for(vendor: str, present: set[str]) -> list[str]:
    """``ALTER TABLE ... ADD COLUMN`` text for each column of the lease table
    that a table made by an earlier version lacks (``present`` are the names
    of the columns it has), as the SQL store adds them to its own table.

    Raises:
        LeaseConfigurationError: the vendor is not PostgreSQL, SQLite or MySQL.
    """
    table = lease_table(sa.MetaData(), DEFAULT_TABLE_NAME)
    return add_column_statements(table, present, _dialect(vendor))


def index_statements_for(
    vendor: str,
    present: Set[str],
    invalid: Set[str] = frozenset(),
) -> tuple[list[str], list[str]]:
    """The statements that give a lease table made by an earlier version
    this version's index (``present`` are the names of the indexes it has,
    ``invalid`` those PostgreSQL marks invalid, see :data:`INVALID_INDEXES`),
    as the SQL store changes its own table's: the builds, then the drops,
    which belong in a transaction after the builds' (see
    :func:`celery_leases.stores.sql.create_table`).

    Raises:
        LeaseConfigurationError: the vendor is not PostgreSQL, SQLite or MySQL.
    """
    table = lease_table(sa.MetaData(), DEFAULT_TABLE_NAME)
    return index_statements(table, present, _dialect(vendor), invalid)


#: PostgreSQL: the names of the lease table's invalid indexes (one ``%s``
#: for the table's name)
INVALID_INDEXES = SQL_INVALID_INDEXES.replace(":table", "%s")


def ddl_lock_for(vendor: str) -> tuple[str | None, str | None, str]:
    """The statements (with one ``%s`` for the name) that take and end the
    lock the SQL store holds while it adds columns to the lease table, and
    the lock's name: a migration doing the same work takes turns with it.
    The taking statement answers 1 once it holds the lock; ``None`` where the
    database needs no lock (SQLite's writes take turns by themselves).

    Raises:
        LeaseConfigurationError: the vendor is not PostgreSQL, SQLite or MySQL.
    """
    _dialect(vendor)
    take, end = DDL_LOCKS[vendor]
    return (
        take and take.replace(":name", "%s"),
        end and end.replace(":name", "%s"),
        ddl_lock_name(DEFAULT_TABLE_NAME),
    )


@contextmanager
def ddl_locked(connection: Any) -> Iterator[Any]:
    """A cursor of a Django ``connection`` that holds, while it is open, the
    lock a SQL store holds while it changes the lease table: a migration
    doing the same work takes turns with it, and neither finds work the
    other is doing still to do.

    Raises:
        LeaseConfigurationError: the vendor is not PostgreSQL, SQLite or
            MySQL, or the lock was not taken within 30 s.
    """
    take, end, name = ddl_lock_for(connection.vendor)
    with connection.cursor() as cursor:
        if take is not None:
            cursor.execute(take, [name])
            check_ddl_lock_taken(cursor.fetchone()[0], DEFAULT_TABLE_NAME)
        try:
            yield cursor
        finally:
            if end is not None:
                cursor.execute(end, [name])


def drop_statements(vendor: str) -> list[str]:
    """``DROP TABLE`` text, the reverse of :func:`create_statements`."""
    dialect = _dialect(vendor)
    return [
        str(sa.schema.DropTable(table).compile(dialect=dialect)).strip()
        for table in reversed(_tables())
    ]
