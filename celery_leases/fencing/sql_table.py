"""The fence table: one row per fenced resource with the newest generation accepted.

:func:`advance_fence` moves a resource's fence forward with one conditional
upsert; :func:`fenced_execute` does that and runs your statement in the
same transaction; :class:`SqlFences` keeps the fences of an HTTP service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.base import Executable

from celery_leases.fencing import (
    FenceResult,
    FencingToken,
    OnRepeat,
    Token,
    check_on_repeat,
    check_resource,
    check_token,
    decide,
    stale_token_error,
)
from celery_leases.fencing.sql_dialect import insert_for, is_mysql, lock_or_insert, newer
from celery_leases.stores.sql import dialect_named, key_text

__all__ = [
    "DEFAULT_FENCE_TABLE",
    "SqlFences",
    "advance_fence",
    "create_fence_table",
    "fence_table",
    "fenced_execute",
]

DEFAULT_FENCE_TABLE = "celery_leases_fences"


def fence_table(metadata: sa.MetaData, name: str = DEFAULT_FENCE_TABLE) -> sa.Table:
    """Define the fence table on ``metadata``: one row per fenced resource.

    Columns: ``resource`` (primary key), ``job_id`` and ``generation`` of
    the newest write accepted, ``updated_at``.
    """
    return sa.Table(
        name,
        metadata,
        # compared byte for byte also in MySQL, whose collations ignore case
        sa.Column("resource", key_text(), primary_key=True),
        sa.Column("job_id", key_text(), nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


def create_fence_table(engine: Engine, name: str = DEFAULT_FENCE_TABLE) -> sa.Table:
    """Create the fence table unless it exists; safe to race.

    Processes creating it at once take turns on the SQL store's DDL lock
    (PostgreSQL, MySQL); on SQLite, one that finds the table made by another
    between its look and its ``CREATE TABLE`` looks again.

    Returns:
        The table, on a fresh ``MetaData``.
    """
    table = fence_table(sa.MetaData(), name)
    dialect = dialect_named(engine.dialect.name, "the fence table")
    try:
        with engine.begin() as conn:
            dialect.lock_for_ddl(conn, name)
            try:
                table.create(conn, checkfirst=True)
            finally:
                dialect.unlock_for_ddl(conn, name)
    except exc.OperationalError:
        if not sa.inspect(engine).has_table(name):
            raise
    return table


#: the fence table fenced_execute uses when it is given none
_DEFAULT_FENCES = fence_table(sa.MetaData())


def advance_fence(
    conn: Connection,
    resource: str,
    token: FencingToken,
    *,
    fences: sa.Table | None = None,
    on_repeat: OnRepeat = "apply",
) -> FenceResult:
    """Move the fence of ``resource`` to ``token`` inside ``conn``'s transaction.

    One statement decides::

        INSERT INTO fences (resource, job_id, generation) VALUES (...)
        ON CONFLICT (resource) DO UPDATE SET job_id = excluded.job_id, ...
        WHERE fences.generation < excluded.generation       -- or <= for "apply"
        RETURNING generation

    A row that is not updated is still locked (PostgreSQL) or under the
    database's write lock (SQLite) until the transaction ends, so the
    writes of two holders to one resource take turns. MySQL locks the row
    with ``SELECT ... FOR UPDATE`` (inserting it when missing), decides,
    then updates it.

    Args:
        conn: a connection in the transaction that also does the write.
        resource: the fenced resource's name.
        token: the lease (or any ``FencingToken``).
        fences: the fence table; the default is ``celery_leases_fences``.
        on_repeat: what a repeat of the accepted generation does.

    Returns:
        The :class:`FenceResult`; ``applied`` is ``False`` for a repeat
        accepted as a no-op.

    Raises:
        StaleFencingToken: the token is older than the accepted one (or a
            refused repeat); the fence did not move.
    """
    resource = check_resource(resource)
    job_id, generation = check_token(token)
    on_repeat = check_on_repeat(on_repeat)
    table = _DEFAULT_FENCES if fences is None else fences
    if is_mysql(conn):
        return _advance_locked(conn, table, resource, job_id, generation, on_repeat)
    insert = insert_for(conn, table).values(resource=resource, job_id=job_id, generation=generation)
    stored = table.c.generation
    incoming = insert.excluded.generation
    condition = newer(stored, incoming, on_repeat)
    if on_repeat == "apply":
        # an equal generation of *another* job is never a repeat
        condition = sa.or_(
            stored < incoming,
            sa.and_(stored == incoming, table.c.job_id == insert.excluded.job_id),
        )
    statement = insert.on_conflict_do_update(
        index_elements=[table.c.resource],
        set_={
            "job_id": insert.excluded.job_id,
            "generation": incoming,
            "updated_at": sa.func.now(),
        },
        where=condition,
    ).returning(table.c.generation)
    if conn.execute(statement).first() is not None:
        return FenceResult(resource, job_id, generation, applied=True)
    # Not written: the row exists with a generation at least as new, and we
    # hold its lock, so reading it now tells stale from repeat.
    row = conn.execute(
        sa.select(table.c.job_id, table.c.generation).where(table.c.resource == resource)
    ).one()
    accepted = (str(row.job_id), int(row.generation))
    if decide(resource, job_id, generation, on_repeat, accepted):
        # cannot happen while the row is locked; refuse rather than guess
        raise stale_token_error(
            resource, job_id, generation, accepted=accepted[1], accepted_job=accepted[0]
        )
    return FenceResult(resource, job_id, generation, applied=False, previous=accepted[1])


def _advance_locked(
    conn: Connection,
    table: sa.Table,
    resource: str,
    job_id: str,
    generation: int,
    on_repeat: OnRepeat,
) -> FenceResult:
    """MySQL: lock the fence's row (or insert it), decide, then move it."""
    values = {"resource": resource, "job_id": job_id, "generation": generation}
    row = lock_or_insert(
        conn, table, {"resource": resource}, values, (table.c.job_id, table.c.generation)
    )
    if row is None:
        return FenceResult(resource, job_id, generation, applied=True)
    accepted = (str(row.job_id), int(row.generation))
    if not decide(resource, job_id, generation, on_repeat, accepted):
        return FenceResult(resource, job_id, generation, applied=False, previous=accepted[1])
    conn.execute(
        sa.update(table)
        .values(job_id=job_id, generation=generation, updated_at=sa.func.now())
        .where(table.c.resource == resource)
    )
    return FenceResult(resource, job_id, generation, applied=True)


def fenced_execute(
    conn: Connection,
    statement: Executable,
    *,
    resource: str,
    token: FencingToken,
    fences: sa.Table | None = None,
    on_repeat: OnRepeat = "apply",
    parameters: Mapping[str, Any] | None = None,
) -> FenceResult:
    """Run ``statement`` only if ``token`` may write ``resource``.

    Moves the fence first (see :func:`advance_fence`), then runs the
    statement on the same connection. Call it inside a transaction
    (``with engine.begin() as conn:``): the fence and the write then commit
    together, or neither does.

    Args:
        conn: a connection in a transaction.
        statement: your INSERT, UPDATE or DELETE.
        resource: the fenced resource's name (for example ``"account:42"``).
        token: the lease (or any ``FencingToken``).
        fences: the fence table; the default is ``celery_leases_fences``.
        on_repeat: what a repeat of the accepted generation does;
            ``"accept"`` skips the statement and reports ``applied=False``.
        parameters: bound parameters for ``statement``.

    Returns:
        The :class:`FenceResult` with the statement's ``rowcount``.

    Raises:
        StaleFencingToken: the token is stale; the statement did not run.
    """
    result = advance_fence(conn, resource, token, fences=fences, on_repeat=on_repeat)
    if not result.applied:
        return result
    cursor = conn.execute(statement, parameters)
    return FenceResult(
        result.resource, result.job_id, result.generation, applied=True, rowcount=cursor.rowcount
    )


class SqlFences:
    """Fences in a fence table, one short transaction per advance.

    A :class:`~celery_leases.fencing.FenceStorage` for a
    :class:`~celery_leases.fencing.http.FenceChecker` shared by several
    processes of a service.

    Args:
        engine: PostgreSQL or SQLite.
        table: the fence table (see :func:`create_fence_table`).
    """

    def __init__(self, engine: Engine, table: sa.Table | None = None) -> None:
        self.engine = engine
        self.table = _DEFAULT_FENCES if table is None else table

    def advance(
        self, resource: str, token: FencingToken, *, on_repeat: OnRepeat = "apply"
    ) -> FenceResult:
        """Move the fence of ``resource`` to ``token`` and commit.

        Raises:
            StaleFencingToken: the token is stale.
        """
        with self.engine.begin() as conn:
            return advance_fence(conn, resource, token, fences=self.table, on_repeat=on_repeat)

    def accepted(self, resource: str) -> Token | None:
        """The token last accepted for ``resource`` (without owner), or ``None``."""
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(self.table.c.job_id, self.table.c.generation).where(
                    self.table.c.resource == resource
                )
            ).first()
        return None if row is None else Token(str(row.job_id), int(row.generation))
