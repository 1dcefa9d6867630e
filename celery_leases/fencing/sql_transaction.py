"""The lease check in the same transaction as your writes (an ``SqlStore`` database).

:func:`fenced_transaction` locks the lease record before your writes, so a
newer claim waits for your commit and a stale holder's transaction writes
nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection, Engine

from celery_leases.errors import LeaseConfigurationError, LeaseLost, StoreUnavailable
from celery_leases.fencing import HolderToken, check_token
from celery_leases.fencing.sql_dialect import now_ms
from celery_leases.stores.base import LeaseState, refusal_for
from celery_leases.stores.sql import record_of

__all__ = ["SqlLeaseStore", "fenced_transaction"]


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


def lease_lost_error(
    conn: Connection, lease_table: sa.Table, job_id: str, owner: str, generation: int
) -> LeaseLost:
    """Describe why the lease check found no current lease.

    Raises:
        LeaseRecordUnreadable: the record of ``job_id`` cannot be read.
    """
    row = conn.execute(sa.select(lease_table).where(lease_table.c.job_id == job_id)).first()
    if row is None:
        return refusal_for(None, job_id, owner, generation).error("fenced transaction")
    record = record_of(row._mapping, f"table {lease_table.name!r}")
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
    PostgreSQL and MySQL; on SQLite the store's ``BEGIN IMMEDIATE`` already holds the
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
                c.lease_until > now_ms(conn),
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
                raise lease_lost_error(conn, leases, job_id, owner, generation)
            yield conn
