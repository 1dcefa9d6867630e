"""The fenced completion as two statements of your own transaction.

Used by :mod:`celery_leases.exactly_once`, which opens the transaction and
knows the run; this module knows only SQL and the lease record. The first
statement locks the lease record while it is current, the last one is the
store's own fenced completion; both run on the caller's connection, so the
completion commits with the caller's writes or not at all::

    BEGIN
      lock the record (owner, generation, held, lease_until > now)
      ... the task's writes ...
      complete (owner, generation, held) -> completed, outcome kept
    COMMIT

The lock makes a claim by another worker wait for the commit (it then finds
the job completed) or, when the record was taken over before the lock, the
lock matches nothing and the transaction writes nothing. While the lock is
held the lease is renewed in the same transaction (a renewal from another
connection would wait for the lock), and :class:`IdleLimit` bounds how long
the transaction may stay idle, so that a paused process does not hold the
lock for longer than its lease where the database can end it.
"""

from __future__ import annotations

import math
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection

from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseError,
    LeaseLost,
    StoreUnavailable,
)
from celery_leases.fencing.sql_transaction import lease_lost_error
from celery_leases.stores.base import (
    CompleteResult,
    LeaseRecord,
    LeaseState,
    Refusal,
    RenewResult,
)
from celery_leases.stores.sql import IDLE_LIMITS, mysql_error_number, permanent

__all__ = [
    "IdleLimit",
    "OnceStore",
    "complete_in_transaction",
    "lock_in_transaction",
    "renew_in_transaction",
]


class OnceStore(Protocol):
    """What a transaction that completes needs of the lease store: an ``SqlStore``."""

    @property
    def table(self) -> sa.Table: ...

    @property
    def dialect_name(self) -> str: ...

    def lock_in(self, conn: Connection, job_id: str, owner: str, generation: int) -> bool: ...

    def renew_in(
        self, conn: Connection, job_id: str, owner: str, generation: int, ttl: float
    ) -> RenewResult: ...

    def complete_in(
        self, conn: Connection, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult: ...

    def get(self, job_id: str) -> LeaseRecord | None: ...


def check_same_dialect(conn: Connection, store: OnceStore) -> None:
    """Raise LeaseConfigurationError if ``conn`` is not on the store's kind of database."""
    if conn.dialect.name != store.dialect_name:
        raise LeaseConfigurationError(
            f"the transaction's connection is on {conn.dialect.name!r} but the lease store "
            f"(table {store.table.name!r}) is on {store.dialect_name!r}: the completion can "
            "only commit with your writes in the lease store's own database"
        )


def lock_in_transaction(
    conn: Connection, store: OnceStore, job_id: str, owner: str, generation: int
) -> None:
    """Lock the lease record as the first statement of ``conn``'s transaction.

    Raises:
        LeaseLost: the lease is not current (superseded, released, completed
            or run out by the database's clock); ``reason`` says which.
        LeaseConfigurationError: ``conn`` is not on the lease store's
            database (the table is missing there, or its record is not the
            one the store holds), or its role has no rights on the lease
            table.
        StoreUnavailable: the statement failed (an outage, a timeout).
    """
    check_same_dialect(conn, store)
    try:
        if store.lock_in(conn, job_id, owner, generation):
            _check_in_transaction(conn)
            return
        lost = lease_lost_error(conn, store.table, job_id, owner, generation)
    except exc.DBAPIError as error:
        raise _statement_error(error, store, "lock", job_id, owner, generation) from error
    _check_same_record(store, lost, job_id, owner, generation)
    raise lost


def renew_in_transaction(
    conn: Connection, store: OnceStore, job_id: str, owner: str, generation: int, ttl: float
) -> RenewResult:
    """Renew the lease in ``conn``'s transaction, which holds the record's lock.

    Raises:
        StoreUnavailable: the statement failed.
    """
    try:
        return store.renew_in(conn, job_id, owner, generation, ttl)
    except exc.DBAPIError as error:
        raise _statement_error(error, store, "renewal", job_id, owner, generation) from error


class IdleLimit:
    """How long ``conn``'s transaction may stay idle before the database
    ends its session (and with it the transaction and its locks).

    A process paused inside the transaction (SIGSTOP, a VM frozen, swapped
    out) sends nothing; past the limit the server ends the session, so the
    record's lock is held for no longer than the lease. PostgreSQL bounds
    it for the transaction only (``idle_in_transaction_session_timeout``);
    MySQL and MariaDB for the session (``wait_timeout``), which
    :meth:`restore` sets back before the transaction ends. SQLite cannot
    bound it (:attr:`bounded` is False): a paused process keeps the write
    lock of the whole database until it runs again.
    """

    def __init__(self, conn: Connection, dialect_name: str) -> None:
        self._conn = conn
        self._statements = IDLE_LIMITS.get(dialect_name)
        self._saved: object = None

    @property
    def bounded(self) -> bool:
        """Whether the database can end a transaction idle too long."""
        return self._statements is not None

    def set(self, seconds: float) -> None:
        """Let the transaction stay idle at most ``seconds`` from its next idle moment.

        Raises:
            StoreUnavailable: the statement failed.
        """
        if self._statements is None:
            return
        set_sql, read_sql = self._statements
        try:
            if read_sql is not None and self._saved is None:
                self._saved = self._conn.execute(sa.text(read_sql)).scalar()
            self._conn.execute(sa.text(set_sql), _limit_parameters(set_sql, seconds))
        except exc.SQLAlchemyError as error:
            # a DBAPIError, or SQLAlchemy's refusal to run on a connection
            # it invalidated (PendingRollbackError): the session is gone
            raise StoreUnavailable(
                f"could not bound the idle time of the task's transaction: "
                f"{getattr(error, 'orig', None) or error}"
            ) from error

    def restore(self) -> None:
        """Set a session-wide limit back to what it was (MySQL, MariaDB).

        Raises:
            StoreUnavailable: the statement failed.
        """
        if self._statements is None or self._saved is None:
            return
        saved, self._saved = self._saved, None
        try:
            self._conn.execute(sa.text(self._statements[0]), {"seconds": saved})
        except exc.SQLAlchemyError as error:  # as in set()
            raise StoreUnavailable(
                f"could not set the session's idle limit back: "
                f"{getattr(error, 'orig', None) or error}"
            ) from error


def _limit_parameters(set_sql: str, seconds: float) -> dict[str, int]:
    """The bound parameter of an IDLE_LIMITS statement: ``:ms`` or whole ``:seconds``."""
    if ":ms" in set_sql:
        return {"ms": max(1, math.ceil(seconds * 1000))}
    return {"seconds": max(1, math.ceil(seconds))}


def complete_in_transaction(
    conn: Connection,
    store: OnceStore,
    job_id: str,
    owner: str,
    generation: int,
    outcome: bytes | None,
) -> None:
    """The fenced completion as the last statement before the commit.

    Raises:
        LeaseLost: the store refused it (the record changed since the lock,
            which the lock rules out unless it was released by an operator).
        LeaseConfigurationError: ``conn``'s role has no rights on the lease table.
        StoreUnavailable: the statement failed (an outage, a timeout).
    """
    try:
        result = store.complete_in(conn, job_id, owner, generation, outcome)
    except exc.DBAPIError as error:
        raise _statement_error(error, store, "complete", job_id, owner, generation) from error
    if isinstance(result, Refusal):
        raise result.error("complete in the task's transaction")


def _check_in_transaction(conn: Connection) -> None:
    """Raise LeaseConfigurationError if the driver committed the lock at once
    (an autocommit connection): the writes would then commit one by one."""
    raw = conn.connection.dbapi_connection
    in_transaction = getattr(raw, "in_transaction", None)  # sqlite3
    if not isinstance(in_transaction, bool):
        status = getattr(getattr(raw, "info", None), "transaction_status", None)  # psycopg 3
        get_autocommit = getattr(raw, "get_autocommit", None)  # PyMySQL, mysqlclient
        if status is not None:
            in_transaction = int(status) != 0  # 0 is IDLE: no transaction open
        elif callable(get_autocommit):
            in_transaction = not get_autocommit()
        else:
            in_transaction = getattr(raw, "autocommit", False) is not True
    if not in_transaction:
        raise LeaseConfigurationError(
            "the transaction's connection commits each statement at once (autocommit), so "
            "your writes and the completion would not commit together; use a connection "
            "without isolation_level='AUTOCOMMIT'"
        )


def _check_same_record(
    store: OnceStore, lost: LeaseLost, job_id: str, owner: str, generation: int
) -> None:
    """A lock that matched nothing where the store says this lease is current
    ran on another database that merely has a table of that name."""
    try:
        record = store.get(job_id)
    except StoreUnavailable:
        return  # cannot tell: the lease is refused either way
    if record is None or record.state is not LeaseState.HELD:
        return
    if (record.owner, record.generation) == (owner, generation) and lost.reason != "expired":
        raise LeaseConfigurationError(
            f"the transaction's connection does not reach the lease store's record of job "
            f"{job_id!r}: its table {store.table.name!r} is in another database. The "
            "completion commits with your writes only in the lease store's own database; "
            "pass a connection or session on the store's database",
            job_id=job_id,
            owner=owner,
            generation=generation,
        )


def _statement_error(
    error: exc.DBAPIError,
    store: OnceStore,
    step: str,
    job_id: str,
    owner: str,
    generation: int,
) -> LeaseError:
    detail = getattr(error, "orig", None) or error
    if _missing_table(error):
        return LeaseConfigurationError(
            f"the lease table {store.table.name!r} is not in the database of the "
            f"transaction's connection ({detail}): the completion commits with your writes "
            "only in the lease store's own database",
            job_id=job_id,
            owner=owner,
            generation=generation,
        )
    if permanent(error):
        # no rights on the lease table (the role of the task's connection
        # is not the store's), or a statement the database refuses: trying
        # again cannot help, so the run must not be published again
        return LeaseConfigurationError(
            f"the database refused the {step} of job {job_id!r} (generation {generation}) "
            f"on the lease table {store.table.name!r} in the task's transaction: {detail}. "
            "The connection given to exactly_once needs the rights the lease store has on "
            "that table (SELECT and UPDATE); the transaction is rolled back, nothing was "
            "written",
            job_id=job_id,
            owner=owner,
            generation=generation,
        )
    return StoreUnavailable(
        f"the {step} of job {job_id!r} (generation {generation}) in the task's transaction "
        f"failed: {detail}; the transaction is rolled back, nothing was written",
        job_id=job_id,
        owner=owner,
        generation=generation,
    )


def _missing_table(error: exc.DBAPIError) -> bool:
    orig = error.orig
    # PostgreSQL's undefined_table, MySQL's ER_NO_SUCH_TABLE, SQLite's message
    if getattr(orig, "sqlstate", None) == "42P01":
        return True
    if mysql_error_number(orig) == 1146:
        return True
    return "no such table" in str(orig)
