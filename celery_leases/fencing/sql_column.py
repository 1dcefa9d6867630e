"""The fence column: your own table keeps the generation of each row's last write.

:func:`fenced_update` and :func:`fenced_upsert` write a row only if its
fence column is older than the token, in one statement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql.expression import ColumnElement

from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing import (
    FenceResult,
    FencingToken,
    OnRepeat,
    check_on_repeat,
    check_resource,
    check_token,
    decide,
    stale_token_error,
)
from celery_leases.fencing.sql_dialect import insert_for, is_mysql, lock_or_insert, newer

__all__ = ["DEFAULT_FENCE_COLUMN", "fenced_update", "fenced_upsert"]

DEFAULT_FENCE_COLUMN = "fence_generation"


def _fence_column(table: sa.Table, fence_column: str) -> sa.Column[Any]:
    if fence_column not in table.c:
        raise LeaseConfigurationError(
            f"table {table.name!r} has no fence column {fence_column!r}; add a nullable "
            f"BigInteger column {fence_column!r} or pass fence_column=<its name>"
        )
    return table.c[fence_column]


def _column_may_write(
    column: ColumnElement[Any], generation: int, on_repeat: OnRepeat
) -> ColumnElement[bool]:
    return sa.or_(column.is_(None), newer(column, sa.literal(generation, sa.BigInteger), on_repeat))


def refused_on_column(
    resource: str,
    job_id: str,
    generation: int,
    on_repeat: OnRepeat,
    accepted: int | None,
) -> FenceResult:
    """Result or error for a fence-column write that changed no row."""
    # decide() raises for a stale token and answers False for an accepted repeat
    if accepted is not None and not decide(
        resource, job_id, generation, on_repeat, (job_id, accepted)
    ):
        return FenceResult(
            resource, job_id, generation, applied=False, previous=accepted, rowcount=0
        )
    # decide() said "write", yet the statement did not: the row's generation
    # moved past ours in between (it never moves back)
    raise stale_token_error(resource, job_id, generation, accepted=accepted)


def fenced_update(
    conn: Connection,
    table: sa.Table,
    values: Mapping[str, Any],
    *,
    where: ColumnElement[bool],
    token: FencingToken,
    fence_column: str = DEFAULT_FENCE_COLUMN,
    on_repeat: OnRepeat = "apply",
    resource: str | None = None,
) -> FenceResult:
    """UPDATE the rows ``where`` selects, only where the fence column is older.

    One statement::

        UPDATE table SET <values>, fence_generation = :g
        WHERE <where> AND (fence_generation IS NULL OR fence_generation < :g)

    (``<=`` with ``on_repeat="apply"``). The column keeps only the
    generation, so a repeat is judged by generation alone. ``where``
    should pick one row (a primary key): each row is fenced on its own.

    Args:
        conn: a connection (its transaction is yours).
        table: your table, with a nullable BigInteger fence column.
        values: the columns to set.
        where: which rows; usually the primary key.
        token: the lease (or any ``FencingToken``).
        fence_column: name of the fence column.
        on_repeat: what a repeat of the row's generation does.
        resource: name used in results and errors; defaults to the table's.

    Returns:
        The :class:`FenceResult`; ``applied`` is ``False`` (``rowcount`` 0)
        when no row matched ``where`` or for a repeat accepted as a no-op.

    Raises:
        StaleFencingToken: the matched rows hold a newer generation; nothing
            was written.
    """
    job_id, generation = check_token(token)
    on_repeat = check_on_repeat(on_repeat)
    column = _fence_column(table, fence_column)
    name = check_resource(table.name if resource is None else resource)
    statement = (
        sa.update(table)
        .values({**values, fence_column: generation})
        .where(where, _column_may_write(column, generation, on_repeat))
    )
    rowcount = conn.execute(statement).rowcount
    if rowcount:
        return FenceResult(name, job_id, generation, applied=True, rowcount=rowcount)
    found = conn.execute(
        sa.select(sa.func.count(), sa.func.max(column)).select_from(table).where(where)
    ).one()
    if not found[0]:
        return FenceResult(name, job_id, generation, applied=False, rowcount=0)
    accepted = None if found[1] is None else int(found[1])
    return refused_on_column(name, job_id, generation, on_repeat, accepted)


def fenced_upsert(
    conn: Connection,
    table: sa.Table,
    values: Mapping[str, Any],
    *,
    token: FencingToken,
    fence_column: str = DEFAULT_FENCE_COLUMN,
    on_repeat: OnRepeat = "apply",
    resource: str | None = None,
) -> FenceResult:
    """INSERT a row, or UPDATE it when its fence column is older; one statement.

    ``INSERT ... ON CONFLICT (<primary key>) DO UPDATE SET ... WHERE
    table.fence_generation IS NULL OR table.fence_generation < excluded...``
    (PostgreSQL and SQLite). MySQL locks the row with ``SELECT ... FOR
    UPDATE`` (inserting it when missing), decides, then updates it.
    ``values`` must include the primary key.

    Returns:
        The :class:`FenceResult` (``applied`` is ``False`` for a repeat
        accepted as a no-op).

    Raises:
        StaleFencingToken: the row holds a newer generation; nothing was written.
        LeaseConfigurationError: ``values`` lacks a primary key column.
    """
    job_id, generation = check_token(token)
    on_repeat = check_on_repeat(on_repeat)
    column = _fence_column(table, fence_column)
    name = check_resource(table.name if resource is None else resource)
    keys = list(table.primary_key.columns)
    missing = [key.name for key in keys if key.name not in values]
    if not keys or missing:
        raise LeaseConfigurationError(
            f"fenced_upsert into {table.name!r} needs the primary key in values; "
            f"missing {missing or 'a primary key on the table'}"
        )
    if is_mysql(conn):
        return _upsert_locked(
            conn, table, values, keys, column, name, job_id, generation, on_repeat
        )
    insert = insert_for(conn, table).values({**values, fence_column: generation})
    updates = {k: insert.excluded[k] for k in values if k not in {key.name for key in keys}}
    updates[fence_column] = insert.excluded[fence_column]
    statement = insert.on_conflict_do_update(
        index_elements=keys,
        set_=updates,
        where=_column_may_write(column, generation, on_repeat),
    ).returning(column)
    if conn.execute(statement).first() is not None:
        return FenceResult(name, job_id, generation, applied=True, rowcount=1)
    stored = conn.execute(
        sa.select(column).where(*(key == values[key.name] for key in keys))
    ).scalar_one()
    return refused_on_column(
        name, job_id, generation, on_repeat, None if stored is None else int(stored)
    )


def _upsert_locked(
    conn: Connection,
    table: sa.Table,
    values: Mapping[str, Any],
    keys: list[sa.Column[Any]],
    column: sa.Column[Any],
    name: str,
    job_id: str,
    generation: int,
    on_repeat: OnRepeat,
) -> FenceResult:
    """MySQL: lock the row (or insert it), decide on its fence column, then update it."""
    key = {k.name: values[k.name] for k in keys}
    row = lock_or_insert(conn, table, key, {**values, column.name: generation}, (column,))
    if row is None:
        return FenceResult(name, job_id, generation, applied=True, rowcount=1)
    stored = None if row[0] is None else int(row[0])
    if stored is not None and not decide(name, job_id, generation, on_repeat, (job_id, stored)):
        return FenceResult(name, job_id, generation, applied=False, previous=stored, rowcount=0)
    updates = {k: v for k, v in values.items() if k not in key}
    conn.execute(
        sa.update(table)
        .values({**updates, column.name: generation})
        .where(*(table.c[k] == v for k, v in key.items()))
    )
    return FenceResult(name, job_id, generation, applied=True, rowcount=1)
