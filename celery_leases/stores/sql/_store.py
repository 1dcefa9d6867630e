"""The SQL lease store: :class:`SqlStore` (see the package's docstring)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from celery_leases.stores.base import (
    ClaimResult,
    CompleteResult,
    LeaseRecord,
    LeaseStore,
    QueuedMark,
    ReleaseResult,
    RenewRequest,
    RenewResult,
    Waiter,
)
from celery_leases.stores.deadline import store_waits, time_left
from celery_leases.stores.sql._engine import (
    check_table,
    check_timeout,
    create_table,
    dialect_for,
    masked_url,
    open_engine,
    store_url,
)
from celery_leases.stores.sql._errors import DRIVER_ERRORS, lost_connection, store_error
from celery_leases.stores.sql._mysql_operations import MysqlOperations, MysqlStatements
from celery_leases.stores.sql._operations import Operations
from celery_leases.stores.sql._pool import Checkouts
from celery_leases.stores.sql._queued import QueuedMarks
from celery_leases.stores.sql._records import SqlRecords
from celery_leases.stores.sql._sqlite import SQLITE_BUSY_TIMEOUT
from celery_leases.stores.sql._statements import Statements
from celery_leases.stores.sql._table import DEFAULT_TABLE_NAME, MYSQL, lease_table
from celery_leases.stores.sql._waiters import Waiters

__all__ = ["DEFAULT_TIMEOUT", "SqlStore"]

#: seconds a PostgreSQL store waits at most for a connection, a reply or a
#: lock (each), by default
DEFAULT_TIMEOUT = 5.0

T = TypeVar("T")


def _timeout(dialect_name: str, timeout: float | None) -> float:
    """The store's ``timeout``: as given, else the default for the database."""
    if timeout is None:
        return SQLITE_BUSY_TIMEOUT if dialect_name == "sqlite" else DEFAULT_TIMEOUT
    return check_timeout(timeout)


# --- the store ---------------------------------------------------------------


class SqlStore(SqlRecords, LeaseStore):
    """Lease store in one table of a PostgreSQL or SQLite database.

    Args:
        engine: a SQLAlchemy engine for PostgreSQL (psycopg 3) or SQLite
            (a file, standard ``sqlite3`` driver). For SQLite the store
            installs connection hooks on it (WAL, busy timeout, BEGIN
            IMMEDIATE); for PostgreSQL a hook that bounds each connection's
            waits (connect timeout, keepalives, ``tcp_user_timeout``, and a
            limit on each wait for a reply inside the store's calls). Either
            way it empties the engine's pool once.
        table_name: the lease table's name.
        create_table: create the table (and index) if it is missing. Either
            way a table that is not this release's lease table (one that
            lacks a column or the index) is refused.
        timeout: the longest wait (seconds) for one step of a call: a new
            connection, a reply, a lock; SQLite's busy timeout. Default
            :data:`DEFAULT_TIMEOUT` for PostgreSQL and
            ``SQLITE_BUSY_TIMEOUT`` (10 s) for SQLite.

    Raises:
        LeaseConfigurationError: unsupported database or driver, SQLite too
            old, in-memory SQLite, a bad table name or timeout, a table
            that is not this release's lease table.
        StoreUnavailable: creating the table failed.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        table_name: str = DEFAULT_TABLE_NAME,
        create_table: bool = True,
        timeout: float | None = None,
    ) -> None:
        self._init(engine, table_name, create_table, timeout, server_limits=False)

    def _init(
        self,
        engine: Engine,
        table_name: str,
        make_table: bool,
        timeout: float | None,
        server_limits: bool,
        checkouts: Checkouts | None = None,
    ) -> None:
        self.timeout = _timeout(engine.dialect.name, timeout)
        self.engine = engine
        self.url = masked_url(engine)
        self._dialect = dialect_for(engine, self.timeout, server_limits=server_limits)
        self.dialect_name = self._dialect.name
        self.table = lease_table(sa.MetaData(), table_name)
        self._where = (self.url, self.table.name)
        self._owns_engine = False
        self._checkouts = checkouts
        self._autocommit_writes = self._dialect.write_options.get("isolation_level") == "AUTOCOMMIT"
        self._writer = engine.execution_options(**self._dialect.write_options)
        self._reader = engine.execution_options(**self._dialect.read_options)
        self._statements = Statements.build(self.table, self._dialect)
        self._queued_marks = QueuedMarks(self.table, self._dialect)
        self._waiters_table = Waiters(self.table, self._dialect)
        self._operations = (
            MysqlOperations(
                self._statements, self.url, MysqlStatements.build(self.table, self._dialect)
            )
            if self._dialect is MYSQL
            else Operations(self._statements, self.url)
        )
        with store_waits(self.timeout):
            if make_table:
                create_table(engine, table_name)
            else:
                check_table(engine, self.table)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        table_name: str = DEFAULT_TABLE_NAME,
        create_table: bool = True,
        timeout: float | None = None,
        **engine_options: Any,
    ) -> SqlStore:
        """Open a store from a URL; the store disposes its engine on close.

        ``postgresql://`` means psycopg 3 (``postgresql+psycopg://``), the
        driver the ``postgres`` extra installs. For PostgreSQL the store also
        sets ``statement_timeout`` and ``lock_timeout`` to ``timeout`` on its
        connections, unless the URL's ``options`` set them. Extra keyword
        arguments go to :func:`sqlalchemy.create_engine`.

        Raises:
            LeaseConfigurationError: the URL cannot be parsed or is unsupported.
        """
        parsed = store_url(url)
        timeout = _timeout(parsed.get_backend_name(), timeout)
        engine, checkouts = open_engine(parsed, engine_options, timeout)
        store = cls.__new__(cls)
        try:
            store._init(engine, table_name, create_table, timeout, True, checkouts)
        except BaseException:
            engine.dispose()
            raise
        store._owns_engine = True
        return store

    def close(self) -> None:
        """Dispose the engine's connections if this store created it."""
        if self._owns_engine:
            self.engine.dispose()

    def __repr__(self) -> str:
        return f"SqlStore({self.url!r}, table_name={self.table.name!r})"

    def _slot(self) -> contextlib.AbstractContextManager[None]:
        """A slot of the store's pool (see :mod:`~celery_leases.stores.sql._pool`)."""
        checkouts = self._checkouts
        return contextlib.nullcontext() if checkouts is None else checkouts.slot()

    def _call(
        self,
        operation: str,
        work: Callable[[], T],
        *,
        again: bool = False,
        job_id: str | None = None,
        owner: str | None = None,
        generation: int | None = None,
    ) -> T:
        """Run one operation with every wait bounded; wrap driver errors.

        Args:
            again: the operation may run twice (a read, or an effect judged
                by the record): after a dead connection it is tried once
                more, on a fresh one, if the caller's deadline allows.
        """
        with store_waits(self.timeout):
            try:
                with self._slot():
                    try:
                        return work()
                    except DRIVER_ERRORS as error:
                        left = time_left()
                        if not (again and lost_connection(error) and (left is None or left > 0)):
                            raise
                    return work()
            except DRIVER_ERRORS as error:
                raise store_error(
                    error, *self._where, operation, job_id, owner, generation
                ) from error

    # -- hooks --------------------------------------------------------------

    def _claim(
        self,
        job_id: str,
        owner: str,
        ttl_ms: int,
        task_name: str,
        send_id: str | None,
        task_id: str,
    ) -> ClaimResult:
        """One statement when the claim takes the record; when it does not,
        one more that decides under the record's lock (PostgreSQL), or a
        read in the same ``BEGIN IMMEDIATE`` transaction (SQLite). Either
        way the answer is Acquired, HeldElsewhere or AlreadyCompleted
        however many workers claim at once. Never tried again after a dead
        connection: a claim applied once would find itself the holder.
        """
        parameters = {
            "p_job_id": job_id,
            "p_owner": owner,
            "p_ttl_ms": ttl_ms,
            "p_task_name": task_name,
            "p_send_id": send_id or "",
            "p_new_send": send_id is not None,
            "p_task_id": task_id,
        }
        operations = self._operations

        def work() -> ClaimResult:
            if isinstance(operations, MysqlOperations):
                # a transaction each, as many as a race on a new row needs
                return operations.claim_in_turns(self._writer, parameters)
            if self._statements.decide is not None:
                return self._in_write(operations.claim_locking, parameters)
            return self._in_write(operations.claim_in_transaction, parameters, send_id)

        return self._call("claim", work, job_id=job_id, owner=owner)

    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        parameters = {
            "p_job_id": job_id,
            "p_owner": owner,
            "p_generation": generation,
            "p_ttl_ms": ttl_ms,
        }
        return self._write(
            "renew", self._operations.renew, parameters, again=True, owner=owner, gen=generation
        )

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        def work() -> list[RenewResult]:
            return self._in_write(self._operations.renew_many, requests)

        return self._call("renew_many", work, again=True)

    def _complete(
        self, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        parameters = {
            "p_job_id": job_id,
            "p_owner": owner,
            "p_generation": generation,
            "p_outcome": outcome,
        }
        # tried again after a lost reply: the base class judges the refusal
        # "completed by this owner and generation" to be this completion
        return self._write(
            "complete", self._operations.complete, parameters, again=True, owner=owner,
            gen=generation,
        )  # fmt: skip

    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        parameters = {"p_job_id": job_id, "p_owner": owner, "p_generation": generation}
        # never tried again: a release applied once clears the owner, so a
        # second try could not tell its own release from another's
        return self._write(
            "release", self._operations.release, parameters, owner=owner, gen=generation
        )

    def _force_release(self, job_id: str, by: str, reason: str) -> LeaseRecord | None:
        parameters = {"p_job_id": job_id, "p_by": by, "p_reason": reason}
        # never tried again: each run raises the generation
        return self._write("force_release", self._operations.force_release, parameters)

    def _write(
        self,
        operation: str,
        step: Callable[[Connection, dict[str, Any]], T],
        parameters: dict[str, Any],
        *,
        again: bool = False,
        owner: str | None = None,
        gen: int | None = None,
    ) -> T:
        def work() -> T:
            return self._in_write(step, parameters)

        job_id = parameters["p_job_id"]
        return self._call(operation, work, again=again, job_id=job_id, owner=owner, generation=gen)

    def _in_write(self, step: Callable[..., T], *arguments: Any) -> T:
        """``step(conn, *arguments)`` on a writing connection, committed
        before its result leaves: in autocommit (PostgreSQL) each statement
        commits itself, so no transaction is begun around them (its COMMIT
        would be one more driver call); elsewhere in one transaction."""
        with self._writer.connect() as conn:
            if self._autocommit_writes:
                return step(conn, *arguments)
            with conn.begin():
                return step(conn, *arguments)

    # -- queued marks (module sql_queued) ------------------------------------

    def _mark_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark:
        marks = self._queued_marks

        def work() -> QueuedMark:
            if not marks.exists(self.engine):
                raise marks.missing(self.url, job_id)
            return marks.mark(self._in_write, job_id, task_id, ttl_ms)

        # never tried again after a dead connection: the mark may be placed,
        # and the caller cannot tell it from another sender's
        return self._call("mark_queued", work, job_id=job_id)

    def _extend_queued(self, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark | None:
        marks = self._queued_marks

        def work() -> QueuedMark | None:
            if not marks.exists(self.engine):
                return None
            return self._in_write(marks.extend, job_id, task_id, ttl_ms)

        return self._call("extend_queued", work, again=True, job_id=job_id)

    def _unmark_queued(self, job_id: str, task_id: str) -> bool:
        marks = self._queued_marks

        def work() -> bool:
            if not marks.exists(self.engine):
                return False
            return self._in_write(marks.unmark, job_id, task_id)

        return self._call("unmark_queued", work, again=True, job_id=job_id)

    def _queued(self, job_id: str) -> QueuedMark | None:
        marks = self._queued_marks

        def work() -> QueuedMark | None:
            if not marks.exists(self.engine):
                return None
            with self._reader.connect() as conn:
                return marks.live(conn, job_id)

        return self._call("queued", work, again=True, job_id=job_id)

    # -- waiters (module sql_waiters) -------------------------------------------

    def _add_waiter(
        self, job_id: str, send_id: str, task_id: str, payload: bytes, ttl_ms: int
    ) -> bool:
        waiters = self._waiters_table

        def work() -> bool:
            if not waiters.exists(self.engine):
                raise waiters.missing(self.url, job_id)
            return self._in_write(waiters.add, job_id, send_id, task_id, payload, ttl_ms)

        # a registration applied twice is one registration
        return self._call("add_waiter", work, again=True, job_id=job_id)

    def _take_waiters(self, job_id: str) -> list[Waiter]:
        waiters = self._waiters_table

        def work() -> list[Waiter]:
            if not waiters.exists(self.engine):
                return []
            return self._in_write(waiters.taken, job_id)

        # never tried again: a take applied once has deleted what it returns
        return self._call("take_waiters", work, job_id=job_id)

    def _waiters(self, job_id: str) -> list[Waiter]:
        waiters = self._waiters_table

        def work() -> list[Waiter]:
            if not waiters.exists(self.engine):
                return []
            with self._reader.connect() as conn:
                return waiters.live(conn, job_id)

        return self._call("waiters", work, again=True, job_id=job_id)

    def _purge(self, older_than_ms: int) -> int:
        purged = super()._purge(older_than_ms)
        waiters = self._waiters_table

        def work() -> None:
            if waiters.exists(self.engine):
                self._in_write(waiters.purge)

        self._call("purge", work, again=True)
        return purged
