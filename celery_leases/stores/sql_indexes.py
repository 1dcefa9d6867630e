"""The lease table's secondary index, per database, and its upgrade.

Used by :mod:`celery_leases.stores.sql_table` (the table's definition), by
the store's table creation and by the Django migrations.

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

from collections.abc import Callable, Set
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from celery_leases.errors import LeaseConfigurationError

#: per index (by the end of its name), the dialects that have it
_MADE_IN: dict[str, tuple[str, ...]] = {
    "not_held": ("postgresql",),
    "state_completed_at": ("sqlite", "mysql", "mariadb"),
}

#: per dialect, the ends of the names of indexes an earlier release made
#: that the table must no longer have
_RETIRED: dict[str, tuple[str, ...]] = {"postgresql": ("state_completed_at",)}

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


#: PostgreSQL: the names of a table's invalid indexes (one whose ``CREATE
#: INDEX CONCURRENTLY`` failed, or is still running); the table is bound as
#: ``:table``, its name as SQL writes it
INVALID_INDEXES = (
    "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = CAST(:table AS regclass) AND NOT i.indisvalid"
)


def index_statements(
    table: sa.Table, present: Set[str], dialect: Dialect, invalid: Set[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """What gives a table this release's index: the builds, then the drops.

    The builds are ``CREATE INDEX`` for each index ``dialect`` has that is
    not among the ``present`` index names. The drops are ``DROP INDEX`` for
    each index an earlier release made that is present, unless one of this
    release's is ``invalid`` (its concurrent build failed or is still
    running): the earlier one then stays until it is valid, and neither is
    touched here (:func:`invalid_warning` says what to do). Only
    PostgreSQL's index has changed, so elsewhere both are empty unless the
    index was dropped by hand.
    """
    quote = dialect.identifier_preparer.quote
    ours = indexes_in(table, dialect.name)
    builds = [
        str(sa.schema.CreateIndex(index).compile(dialect=dialect)).strip()
        for index in ours
        if index.name not in present
    ]
    if invalid & {str(index.name) for index in ours}:
        return builds, []
    drops = [
        f"DROP INDEX {quote(name)}"
        for name in sorted(present)
        if _end(table, name) in _RETIRED.get(dialect.name, ())
    ]
    return builds, drops


def invalid_warning(table_name: str, invalid: Set[str], where: str) -> str | None:
    """What to do about this release's indexes that are ``invalid``, or None."""
    ours = sorted(name for name in invalid if name.startswith(f"ix_{table_name}_"))
    if not ours:
        return None
    return (
        f"the index {', '.join(ours)} of the lease table {table_name!r} in {where} is invalid: "
        "a CREATE INDEX CONCURRENTLY failed or is still running. Once none is running, drop "
        "it (DROP INDEX CONCURRENTLY) and build it again (docs/sql.md, The table); until "
        "then the earlier index stays"
    )
