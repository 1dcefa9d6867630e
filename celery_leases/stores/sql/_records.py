"""What the SQL lease store does besides a run's own calls: reading records,
purging them, and the calls a fenced write makes in its own transaction.

:class:`SqlRecords` is a base class of :class:`~celery_leases.stores.sql.SqlStore`;
it runs on the store's reading engine, its statements and its
:class:`~celery_leases.stores.sql._operations.Operations`, and bounds and
wraps every call with the store's ``_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, RowMapping
from sqlalchemy.sql.expression import ColumnElement

from celery_leases.errors import LeaseRecordUnreadable
from celery_leases.stores.base import (
    CompleteResult,
    LeaseRecord,
    LeaseState,
    RenewResult,
    ttl_to_ms,
)
from celery_leases.stores.sql._operations import Operations
from celery_leases.stores.sql._statements import Statements, held_by

__all__ = ["RECORDS_PAGE_SIZE", "SqlRecords"]

#: rows per page when iterating over records
RECORDS_PAGE_SIZE = 500

T = TypeVar("T")


class SqlRecords:
    """Records, purging and in-transaction calls of the SQL store (a base class of it)."""

    table: sa.Table
    _reader: Engine
    _statements: Statements
    _operations: Operations

    if TYPE_CHECKING:

        def _call(
            self,
            operation: str,
            work: Callable[[], T],
            *,
            again: bool = False,
            job_id: str | None = None,
            owner: str | None = None,
            generation: int | None = None,
        ) -> T: ...

        def _in_write(self, step: Callable[..., T], *arguments: Any) -> T: ...

    # -- in the caller's transaction (fenced targets, exactly_once) ------------

    def lease_is_current_clause(
        self, job_id: str, owner: str, generation: int
    ) -> ColumnElement[bool]:
        """A boolean SQL clause: ``owner`` holds ``job_id`` with ``generation``.

        An ``EXISTS`` over the lease table, for use in the WHERE clause of a
        write in the same transaction. True only while the record is held
        (not released, not completed) by exactly that owner and generation.
        It does not look at ``lease_until``: how time is judged is up to the
        caller.
        """
        return sa.exists().where(held_by(self.table, job_id, owner, generation))

    def lock_in(self, conn: Connection, job_id: str, owner: str, generation: int) -> bool:
        """Lock the record in ``conn``'s open transaction while ``owner``
        holds ``job_id`` with ``generation`` and the lease has not run out
        (by the database's clock); False when it does not.

        ``conn`` is the caller's, on this store's database; its driver
        errors pass through. The lock lasts until that transaction ends.
        """
        return self._operations.lock(conn, _fence(job_id, owner, generation))

    def renew_in(
        self, conn: Connection, job_id: str, owner: str, generation: int, ttl: float
    ) -> RenewResult:
        """The renewal, run in ``conn``'s open transaction, which holds the
        record's lock (as :meth:`complete_in`)."""
        parameters = _fence(job_id, owner, generation, p_ttl_ms=ttl_to_ms(ttl))
        return self._operations.renew(conn, parameters)

    def complete_in(
        self, conn: Connection, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        """The fenced completion, run in ``conn``'s open transaction: it
        commits (or rolls back) with that transaction.

        ``conn`` is the caller's, on this store's database; its driver
        errors pass through.
        """
        parameters = _fence(job_id, owner, generation, p_outcome=outcome)
        return self._operations.complete(conn, parameters)

    # -- reads and the purge -------------------------------------------------

    def _now_ms(self) -> int:
        def work() -> int:
            with self._reader.connect() as conn:
                return int(conn.execute(self._statements.now).scalar_one())

        return self._call("now_ms", work, again=True)

    def _get(self, job_id: str) -> LeaseRecord | None:
        def work() -> LeaseRecord | None:
            with self._reader.connect() as conn:
                return self._operations.select_record(conn, job_id)

        return self._call("get", work, again=True, job_id=job_id)

    def _records(self, state: LeaseState | None) -> Iterator[LeaseRecord | LeaseRecordUnreadable]:
        """Pages of RECORDS_PAGE_SIZE rows by job_id, each its own query."""
        t = self.table
        after: str | None = None
        while True:
            query = sa.select(t).order_by(t.c.job_id).limit(RECORDS_PAGE_SIZE)
            if state is not None:
                query = query.where(t.c.state == state.value)
            if after is not None:
                query = query.where(t.c.job_id > after)

            def work(query: Any = query) -> list[RowMapping]:
                with self._reader.connect() as conn:
                    return [row._mapping for row in conn.execute(query)]

            rows = self._call("records", work, again=True)
            for row in rows:
                yield self._operations.readable(row)
            if len(rows) < RECORDS_PAGE_SIZE:
                return
            after = rows[-1]["job_id"]

    def _purge(self, older_than_ms: int) -> int:
        def work() -> int:
            return self._in_write(self._operations.purge, older_than_ms)

        # deleting what is old enough twice deletes it once
        return self._call("purge", work, again=True)


def _fence(job_id: str, owner: str, generation: int, **more: Any) -> dict[str, Any]:
    """The bind parameters of a statement fenced on ``owner`` and ``generation``."""
    return {"p_job_id": job_id, "p_owner": owner, "p_generation": generation, **more}
