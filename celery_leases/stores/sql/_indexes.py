"""The lease table's secondary index, per database.

Used by :mod:`celery_leases.stores.sql._table` (the table's definition and
its check) and by the Django migration.

The index serves ``purge`` (completed and released records by age) and the
operators' ``records(state=...)``. In PostgreSQL it leaves out the held
records: a fenced statement finds its record by ``job_id`` *and*
``state = 'held'``, and when the statistics say few records are held (most
of the time, since trivial tasks finish at once) the planner's generic plan
for it walked an index led by ``state`` instead of the primary key. That
walk reads every held entry and every dead one an update left behind,
hundreds per call on a busy table. An index without the held records cannot
answer ``state = 'held'``, so the planner has only the primary key; and a
claim, which writes a held record, has one index fewer to update.

MySQL (its optimizer takes a lookup of the whole primary key first) and
SQLite (which counts a unique lookup as one row) keep the full index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from celery_leases.errors import LeaseConfigurationError

#: per index (by the end of its name), the dialects that have it
_MADE_IN: dict[str, tuple[str, ...]] = {
    "not_held": ("postgresql",),
    "state_completed_at": ("sqlite", "mysql", "mariadb"),
}

_HELD = "held"


def _made_in(end: str) -> Callable[..., bool]:
    """The test ``ddl_if`` runs before it makes the index named with ``end``."""

    def made(
        ddl: Any,
        target: Any,
        bind: Any,
        tables: Any = None,
        state: Any = None,
        *,
        dialect: Dialect,
        compiler: Any = None,
        checkfirst: bool = False,
    ) -> bool:
        return dialect.name in _MADE_IN[end]

    return made


def lease_indexes(table_name: str, dialect: str | None = None) -> list[sa.Index]:
    """The lease table's indexes: those of ``dialect`` (a SQLAlchemy dialect
    name) only, or all, each made only in its dialects."""
    indexes = {
        "not_held": sa.Index(
            f"ix_{table_name}_not_held",
            "state",
            "completed_at",
            postgresql_where=sa.text(f"state <> '{_HELD}'"),
        ),
        "state_completed_at": sa.Index(
            f"ix_{table_name}_state_completed_at", "state", "completed_at"
        ),
    }
    if dialect is not None:
        known = {name for names in _MADE_IN.values() for name in names}
        if dialect not in known:
            raise LeaseConfigurationError(
                f"the lease table has an index for {', '.join(sorted(known))}, not {dialect!r}"
            )
        return [index for end, index in indexes.items() if dialect in _MADE_IN[end]]
    return [index.ddl_if(callable_=_made_in(end)) for end, index in indexes.items()]


def _end(table: sa.Table, index_name: str) -> str:
    return index_name.removeprefix(f"ix_{table.name}_")


def indexes_in(table: sa.Table, dialect_name: str) -> list[sa.Index]:
    """The indexes of ``table`` that ``dialect_name`` has, by name."""
    return sorted(
        (
            index
            for index in table.indexes
            if dialect_name in _MADE_IN.get(_end(table, str(index.name)), ())
        ),
        key=lambda index: str(index.name),
    )
