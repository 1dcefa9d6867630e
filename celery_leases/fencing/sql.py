"""Fenced writes to SQL tables (PostgreSQL and SQLite, SQLAlchemy Core).

Three forms, from the most general to the strongest:

- **Fence table**: :func:`fence_table` keeps one row per resource with the
  highest generation accepted. :func:`fenced_execute` moves that fence
  forward with one conditional upsert and runs your statement in the same
  transaction, so both commit or neither does.
- **Fence column**: your own table has a generation column;
  :func:`fenced_update` and :func:`fenced_upsert` write a row only if its
  column is older than the token, in one statement.
- **Lease check in the same transaction**: when the lease store is an
  ``SqlStore`` in the same database, :func:`fenced_transaction` locks the
  lease record before your writes; a newer claim cannot be granted until
  your transaction ends, and a stale holder's transaction writes nothing.

Errors of your own database (a failed statement, a lost connection) pass
through unchanged: the connection and its transaction are yours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.expression import ColumnElement

from celery_leases.errors import LeaseConfigurationError, LeaseLost, StoreUnavailable
from celery_leases.fencing import (
    FenceResult,
    FencingToken,
    HolderToken,
    OnRepeat,
    Token,
    check_on_repeat,
    check_resource,
    check_token,
    decide,
    stale_token_error,
)
from celery_leases.stores.base import LeaseRecord, LeaseState, refusal_for

__all__ = [
    "DEFAULT_FENCE_COLUMN",
    "DEFAULT_FENCE_TABLE",
    "SqlFences",
    "SqlLeaseStore",
    "advance_fence",
    "create_fence_table",
    "fence_table",
    "fenced_execute",
    "fenced_transaction",
    "fenced_update",
    "fenced_upsert",
]

DEFAULT_FENCE_TABLE = "celery_leases_fences"
DEFAULT_FENCE_COLUMN = "fence_generation"

# The clock of the lease check, in integer milliseconds like lease_until.
# PostgreSQL: clock_timestamp() is the time of the check itself; now() would
# be the start of the transaction, possibly long before.
POSTGRES_NOW_MS = "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"
# SQLite: julianday('now') minus the Unix epoch as a Julian day, in ms.
SQLITE_NOW_MS = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"


def fence_table(metadata: sa.MetaData, name: str = DEFAULT_FENCE_TABLE) -> sa.Table:
    """Define the fence table on ``metadata``: one row per fenced resource.

    Columns: ``resource`` (primary key), ``job_id`` and ``generation`` of
    the newest write accepted, ``updated_at``.
    """
    return sa.Table(
        name,
        metadata,
        sa.Column("resource", sa.String(255), primary_key=True),
        sa.Column("job_id", sa.String(255), nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )


def create_fence_table(engine: Engine, name: str = DEFAULT_FENCE_TABLE) -> sa.Table:
    """Create the fence table unless it exists.

    Returns:
        The table, on a fresh ``MetaData``.
    """
    table = fence_table(sa.MetaData(), name)
    table.create(engine, checkfirst=True)
    return table


#: the fence table fenced_execute uses when it is given none
_DEFAULT_FENCES = fence_table(sa.MetaData())


def _insert_for(conn: Connection, table: sa.Table) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_update``."""
    name = conn.dialect.name
    if name == "postgresql":
        return pg.insert(table)
    if name == "sqlite":
        return sqlite_dialect.insert(table)
    raise LeaseConfigurationError(
        f"fenced SQL writes need PostgreSQL or SQLite (an upsert with a condition), not {name!r}"
    )


def _newer(
    stored: ColumnElement[Any], incoming: ColumnElement[Any], on_repeat: OnRepeat
) -> ColumnElement[bool]:
    """SQL for "the incoming generation may be written over the stored one"."""
    if on_repeat == "apply":
        return stored <= incoming
    return stored < incoming


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
    writes of two holders to one resource take turns.

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
    insert = _insert_for(conn, table).values(
        resource=resource, job_id=job_id, generation=generation
    )
    stored = table.c.generation
    incoming = insert.excluded.generation
    condition = _newer(stored, incoming, on_repeat)
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
    return sa.or_(
        column.is_(None), _newer(column, sa.literal(generation, sa.BigInteger), on_repeat)
    )


def _refused_on_column(
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
    return _refused_on_column(name, job_id, generation, on_repeat, accepted)


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
    (PostgreSQL and SQLite). ``values`` must include the primary key.

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
    insert = _insert_for(conn, table).values({**values, fence_column: generation})
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
    return _refused_on_column(
        name, job_id, generation, on_repeat, None if stored is None else int(stored)
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


# --- the lease check in the same transaction ---------------------------------


def _now_ms(conn: Connection) -> ColumnElement[int]:
    if conn.dialect.name == "postgresql":
        return sa.literal_column(POSTGRES_NOW_MS, sa.BigInteger)
    if conn.dialect.name == "sqlite":
        return sa.literal_column(SQLITE_NOW_MS, sa.BigInteger)
    raise LeaseConfigurationError(
        f"fenced_transaction needs PostgreSQL or SQLite, not {conn.dialect.name!r}"
    )


def _check_holder(lease: HolderToken) -> tuple[str, str, int]:
    job_id, generation = check_token(lease)
    owner = getattr(lease, "owner", None)
    if not isinstance(owner, str) or not owner:
        raise LeaseConfigurationError(
            f"fenced_transaction needs the lease's owner (got {owner!r}); pass the "
            "task's self.lease, or a Token with owner=",
            job_id=job_id,
            generation=generation,
        )
    return job_id, owner, generation


def _lease_lost(
    conn: Connection, lease_table: sa.Table, job_id: str, owner: str, generation: int
) -> LeaseLost:
    """Describe why the lease check found no current lease."""
    row = conn.execute(sa.select(lease_table).where(lease_table.c.job_id == job_id)).first()
    if row is None:
        return refusal_for(None, job_id, owner, generation).error("fenced transaction")
    record = LeaseRecord(
        job_id=row.job_id,
        owner=row.owner,
        generation=int(row.generation),
        lease_until_ms=int(row.lease_until),
        state=LeaseState(row.state),
    )
    if (
        record.owner == owner
        and record.generation == generation
        and (record.state is LeaseState.HELD)
    ):
        return LeaseLost(
            f"fenced transaction of job {job_id!r} with generation {generation} was "
            f"refused: the lease ran out by the database's clock (lease_until "
            f"{record.lease_until_ms} ms) and nobody renewed it; nothing was written. "
            "Renew the lease before writing, or let the task stop.",
            job_id=job_id,
            owner=owner,
            generation=generation,
            reason="expired",
        )
    return refusal_for(record, job_id, owner, generation).error("fenced transaction")


class SqlLeaseStore(Protocol):
    """What :func:`fenced_transaction` needs of the lease store: an ``SqlStore``."""

    @property
    def engine(self) -> Engine: ...

    @property
    def table(self) -> sa.Table: ...


@contextlib.contextmanager
def fenced_transaction(store: SqlLeaseStore, lease: HolderToken) -> Iterator[Connection]:
    """A transaction whose writes commit only while ``lease`` is current.

    Use it when your tables live in the same database as the ``SqlStore``::

        with fenced_transaction(store, self.lease) as conn:
            conn.execute(update(accounts).values(...).where(...))

    It begins a transaction and first checks, by the database's clock, that
    the lease record is held by exactly this owner and generation and has
    not run out. The check locks the record: ``SELECT ... FOR UPDATE`` on
    PostgreSQL; on SQLite the store's ``BEGIN IMMEDIATE`` already holds the
    database's write lock. A claim must take that lock too, so the two
    serialize::

        A: BEGIN; check (lease 7 current, row locked)   B: claim ... waits
        A: writes; COMMIT                               B: claim granted, 8

        B: claim granted, 8
        A: BEGIN; check finds owner B / generation 8 -> LeaseLost, rollback

    The lease must also be unexpired at the check, although a run-out lease
    that nobody claimed is not yet superseded: its worker is past its own
    deadline and must stop producing effects, and a write made then would
    land at a time when no one holds the job (I2 says at most one unexpired
    holder; the writer is always that one). The check is made once, at the
    start; the lock then holds off any claim until the commit, so a lease
    that runs out *during* the transaction is safe, but it delays the next
    claim of this job: keep the transaction short.

    Args:
        store: the ``SqlStore`` (anything with ``engine`` and ``table``).
        lease: the task's lease (``job_id``, ``owner``, ``generation``).

    Yields:
        The connection, inside the transaction. Leaving the block normally
        commits; an exception rolls back.

    Raises:
        LeaseLost: the lease is not current (superseded, released, completed
            or run out); nothing was written. ``reason`` says which.
        StoreUnavailable: the lease check itself failed.
    """
    job_id, owner, generation = _check_holder(lease)
    leases = store.table
    c = leases.c
    with store.engine.connect() as conn:
        check = (
            sa.select(c.generation)
            .where(
                c.job_id == job_id,
                c.owner == owner,
                c.generation == generation,
                c.state == LeaseState.HELD.value,
                c.lease_until > _now_ms(conn),
            )
            # compiled to nothing on SQLite, where BEGIN IMMEDIATE locks instead
            .with_for_update()
        )
        with conn.begin():
            try:
                current = conn.execute(check).first()
            except (exc.DBAPIError, exc.TimeoutError) as error:
                raise StoreUnavailable(
                    f"the lease check of job {job_id!r} (generation {generation}) in "
                    f"table {leases.name!r} failed: {getattr(error, 'orig', None) or error}; "
                    "nothing was written",
                    job_id=job_id,
                    owner=owner,
                    generation=generation,
                ) from error
            if current is None:
                raise _lease_lost(conn, leases, job_id, owner, generation)
            yield conn
