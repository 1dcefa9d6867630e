"""Bringing a lease table an earlier release made up to this one: the
columns it lacks and this release's index.

Used by :mod:`celery_leases.stores.sql_engine` (the table's creation and the
store's checks at open) and the Django tests.
"""

from __future__ import annotations

from collections.abc import Set

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_leases.stores.sql_indexes import INVALID_INDEXES, index_statements
from celery_leases.stores.sql_table import add_column_statements


def _missing_columns(conn: Connection, table: sa.Table) -> list[str]:
    """``ALTER TABLE ... ADD COLUMN`` for each column an older table lacks.

    Raises:
        sqlalchemy.exc.NoSuchTableError: there is no such table.
    """
    present = {c["name"] for c in sa.inspect(conn).get_columns(table.name)}
    return add_column_statements(table, present, conn.dialect)


def invalid_indexes(conn: Connection, table: sa.Table) -> set[str]:
    """PostgreSQL: the names of the table's invalid indexes (elsewhere none)."""
    if conn.dialect.name != "postgresql":
        return set()
    quoted = conn.dialect.identifier_preparer.format_table(table)
    return set(conn.execute(sa.text(INVALID_INDEXES), {"table": quoted}).scalars())


def _changed_indexes(
    conn: Connection, table: sa.Table, invalid: Set[str]
) -> tuple[list[str], list[str]]:
    """The builds and the drops that give an older table this release's
    index, given its ``invalid`` indexes.

    Raises:
        sqlalchemy.exc.NoSuchTableError: there is no such table.
    """
    present = {str(i["name"]) for i in sa.inspect(conn).get_indexes(table.name)}
    return index_statements(table, present, conn.dialect, invalid)


def upgrade_statements(conn: Connection, table: sa.Table) -> tuple[list[str], list[str], set[str]]:
    """What a table made by an older release lacks: the statements that add
    its columns, those that change its index (builds, then drops), and the
    names of its invalid indexes (:func:`invalid_indexes`).

    Raises:
        sqlalchemy.exc.NoSuchTableError: there is no such table.
    """
    missing = _missing_columns(conn, table)  # first: it finds a missing table
    invalid = invalid_indexes(conn, table)
    builds, drops = _changed_indexes(conn, table, invalid)
    return missing, builds + drops, invalid


def add_missing_columns(conn: Connection, table: sa.Table) -> None:
    """Add each column an older table lacks."""
    for statement in _missing_columns(conn, table):
        conn.execute(sa.text(statement))


def build_indexes(conn: Connection, table: sa.Table) -> bool:
    """Build each index of this release that the table lacks, with no
    statement time limit (PostgreSQL: it may take long on a large table);
    true when an index of an earlier release is left to drop.
    """
    builds, drops = _changed_indexes(conn, table, invalid_indexes(conn, table))
    if builds and conn.dialect.name == "postgresql":
        conn.execute(sa.text("SET LOCAL statement_timeout = 0"))
    for statement in builds:
        conn.execute(sa.text(statement))
    return bool(drops)


def drop_retired_indexes(conn: Connection, table: sa.Table) -> None:
    """Drop each index of an earlier release that the table still has."""
    for statement in _changed_indexes(conn, table, invalid_indexes(conn, table))[1]:
        conn.execute(sa.text(statement))
