"""The SQL lease store: PostgreSQL or SQLite through SQLAlchemy Core.

One table holds one row per job (see :func:`lease_table`). Every operation
is one statement that reads the database's clock itself, so a worker's
clock is never compared with a lease. What differs between the two
databases (the clock, the upsert, how a JSON batch becomes rows, how
transactions begin) lives in ``_Dialect`` (module ``sql_table``) and nowhere
else; the statements are built in ``sql_statements``.

PostgreSQL runs each statement in driver-level autocommit: an operation is
one statement, so it is its own transaction and costs one round trip.
SQLite runs each write in ``BEGIN IMMEDIATE``: the write lock is taken
before anything is read, so many processes wait on the busy timeout
instead of failing with ``database is locked``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine, RowMapping
from sqlalchemy.sql.expression import ColumnElement

from celery_leases.errors import (
    LeaseConfigurationError,
    LeaseRecordUnreadable,
    StoreUnavailable,
)
from celery_leases.redact import mask, secrets_of
from celery_leases.stores.base import (
    Acquired,
    AlreadyCompleted,
    ClaimResult,
    Completed,
    CompleteResult,
    HeldElsewhere,
    LeaseRecord,
    LeaseState,
    LeaseStore,
    Released,
    ReleaseResult,
    Renewed,
    RenewRequest,
    RenewResult,
    refusal_for,
    ttl_to_ms,
    unreadable_refusal,
)
from celery_leases.stores.sql_statements import _held_by, _Statements
from celery_leases.stores.sql_table import (
    _POSTGRES,
    _READ_ONLY_OPTION,
    _SQLITE,
    DEFAULT_TABLE_NAME,
    POSTGRES_NOW_MS,
    SQLITE_NOW_MS,
    _add_missing_columns,
    _Dialect,
    _record,
    lease_table,
)

__all__ = [
    "DEFAULT_TABLE_NAME",
    "POSTGRES_NOW_MS",
    "SQLITE_NOW_MS",
    "SqlStore",
    "create_table",
    "lease_table",
]

#: seconds a SQLite connection waits for another writer before giving up
SQLITE_BUSY_TIMEOUT = 10.0

#: RETURNING arrived in SQLite 3.35 (UPDATE ... FROM in 3.33)
MIN_SQLITE_VERSION = (3, 35, 0)

#: rows per page when iterating over records
RECORDS_PAGE_SIZE = 500

#: claim attempts when the holder turned out to be gone by the time we looked
CLAIM_ATTEMPTS = 3


#: engines of open stores; a forked child must not reuse their connections
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_connections_after_fork() -> None:
    # A Celery prefork child inherits the parent's pooled connections; two
    # processes talking over one socket (or one SQLite handle) corrupt each
    # other. The child drops them without closing them (they are the parent's).
    for engine in list(_ENGINES):
        engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_connections_after_fork)


def create_table(engine: Engine, table_name: str = DEFAULT_TABLE_NAME) -> sa.Table:
    """Create the lease table and its index unless they exist; safe to race.

    A table made by an older release gets the columns it lacks.

    Returns:
        The table, bound to a fresh ``MetaData``.

    Raises:
        StoreUnavailable: the database could not be reached.
        LeaseConfigurationError: the database is not PostgreSQL or SQLite.
    """
    dialect = _dialect_for(engine)
    table = lease_table(sa.MetaData(), table_name)
    try:
        with engine.begin() as conn:
            dialect.lock_for_ddl(conn, table_name)
            table.metadata.create_all(conn, checkfirst=True)
            _add_missing_columns(conn, table)
    except (exc.DBAPIError, exc.TimeoutError) as error:
        about = f"could not create the lease table {table_name!r} in {_masked_url(engine)}"
        if _permanent(error):
            raise LeaseConfigurationError(f"{about}: {_reason(error)}. {_FIX}") from error
        raise StoreUnavailable(f"{about}: {_reason(error)}") from error
    return table


# SqlStore's create_table flag shadows the function's name inside __init__
_create_table = create_table


def _sqlite_on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    # Let SQLAlchemy emit BEGIN itself (see _sqlite_on_begin): the driver's
    # own BEGIN is deferred and is skipped before SELECT.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {round(SQLITE_BUSY_TIMEOUT * 1000)}")
        # WAL: readers never block the writer and the writer never blocks readers.
        cursor.execute("PRAGMA journal_mode = WAL")
    finally:
        cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    # A deferred transaction that reads, then writes must upgrade its lock;
    # if another process wrote in between, SQLite answers SQLITE_BUSY at once,
    # without waiting on the busy timeout. BEGIN IMMEDIATE takes the write
    # lock first (waiting on the timeout), so that cannot happen.
    if conn.get_execution_options().get(_READ_ONLY_OPTION):
        conn.exec_driver_sql("BEGIN")
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _prepare_sqlite_engine(engine: Engine) -> None:
    if event.contains(engine, "begin", _sqlite_on_begin):
        return
    if engine.driver != "pysqlite":
        raise LeaseConfigurationError(
            f"the SQLite lease store needs the standard sqlite3 driver "
            f"(sqlite:///path), not {engine.driver!r}"
        )
    if engine.url.database in (None, "", ":memory:") or "mode=memory" in str(engine.url):
        raise LeaseConfigurationError(
            "an in-memory SQLite database is private to one connection, so workers "
            "cannot share it; use a file (sqlite:///path/to/leases.db) or memory://"
        )
    _check_sqlite_version(sqlite3.sqlite_version_info)
    folder = Path(str(engine.url.database)).parent
    if not folder.is_dir():
        raise LeaseConfigurationError(
            f"the folder {folder} of the SQLite lease database does not exist; create it "
            "first (every worker must open the same file)"
        )
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    # connections made before the hooks existed would lack them
    engine.dispose()


def _check_sqlite_version(version: tuple[int, ...]) -> None:
    if tuple(version) < MIN_SQLITE_VERSION:
        have = ".".join(map(str, version))
        need = ".".join(map(str, MIN_SQLITE_VERSION))
        raise LeaseConfigurationError(
            f"the SQLite lease store needs SQLite {need} or newer (for RETURNING); "
            f"this Python links SQLite {have}. Use a newer Python build, or PostgreSQL."
        )


def _dialect_for(engine: Engine) -> _Dialect:
    if engine.dialect.name == "postgresql":
        return _POSTGRES
    if engine.dialect.name == "sqlite":
        _prepare_sqlite_engine(engine)
        return _SQLITE
    raise LeaseConfigurationError(
        f"the SQL lease store supports PostgreSQL and SQLite, not {engine.dialect.name!r} "
        f"({_masked_url(engine)})"
    )


def _masked_url(engine: Engine) -> str:
    return mask(engine.url.render_as_string(hide_password=False))


#: SQLSTATEs of an operational error that is a configuration, not an outage:
#: class 28 (invalid authorization), no such database, insufficient privilege
_PERMANENT_SQLSTATES = ("3D000", "42501")

#: what drivers say when they give no SQLSTATE (a failed connection attempt)
_PERMANENT_MESSAGES = (
    "password authentication failed",
    "no password supplied",
    "no pg_hba.conf entry",
    "does not exist",
    "permission denied",
    "no such table",
    "no such column",
    "has no column named",
    "readonly database",
)

_FIX = (
    "This is not an outage and trying again will not help: check the user, "
    "password, database and rights in the store URL, and the lease table."
)


def _permanent(error: BaseException) -> bool:
    """Whether a driver error is a refusal that trying again cannot change.

    Connection refused or reset, timeouts, a database shutting down or a
    SQLite file locked past the busy timeout are unavailability; credentials,
    rights, a missing database or table and a value the database refuses
    are configuration.
    """
    if isinstance(
        error, (exc.DataError, exc.ProgrammingError, exc.IntegrityError, exc.NotSupportedError)
    ):
        return True
    if not isinstance(error, exc.OperationalError):
        return False
    orig = getattr(error, "orig", None)
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate.startswith("28") or sqlstate in _PERMANENT_SQLSTATES
    text = str(orig if orig is not None else error).lower()
    return any(message in text for message in _PERMANENT_MESSAGES)


def _reason(error: BaseException) -> str:
    orig = getattr(error, "orig", None)
    text = str(orig if orig is not None else error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# --- the store ---------------------------------------------------------------


class SqlStore(LeaseStore):
    """Lease store in one table of a PostgreSQL or SQLite database.

    Args:
        engine: a SQLAlchemy engine for PostgreSQL (psycopg 3) or SQLite
            (a file, standard ``sqlite3`` driver). For SQLite the store
            installs connection hooks on it (WAL, busy timeout, BEGIN
            IMMEDIATE) and empties its pool once.
        table_name: the lease table's name.
        create_table: create the table (and index) if it is missing.

    Raises:
        LeaseConfigurationError: unsupported database or driver, SQLite too
            old, in-memory SQLite, or a bad table name.
        StoreUnavailable: creating the table failed.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        table_name: str = DEFAULT_TABLE_NAME,
        create_table: bool = True,
    ) -> None:
        self.engine = engine
        self.url = _masked_url(engine)
        self._dialect = _dialect_for(engine)
        self.dialect_name = self._dialect.name
        self.table = lease_table(sa.MetaData(), table_name)
        self._owns_engine = False
        _ENGINES.add(engine)
        self._writer = engine.execution_options(**self._dialect.write_options)
        self._reader = engine.execution_options(**self._dialect.read_options)
        self._statements = _Statements.build(self.table, self._dialect)
        if create_table:
            _create_table(engine, table_name)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        table_name: str = DEFAULT_TABLE_NAME,
        create_table: bool = True,
        **engine_options: Any,
    ) -> SqlStore:
        """Open a store from a URL; the store disposes its engine on close.

        ``postgresql://`` means psycopg 3 (``postgresql+psycopg://``), the
        driver the ``postgres`` extra installs. Extra keyword arguments go to
        :func:`sqlalchemy.create_engine`.

        Raises:
            LeaseConfigurationError: the URL cannot be parsed or is unsupported.
        """
        try:
            parsed = sa.make_url(url)
        except (exc.ArgumentError, ValueError) as error:
            raise LeaseConfigurationError(
                f"cannot parse the SQL URL {mask(url)!r}: "
                f"{mask(str(error), secrets=secrets_of(url))}"
            ) from None  # the parser's error quotes the URL, password and all
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        if parsed.get_backend_name() == "postgresql":
            engine_options.setdefault("pool_pre_ping", True)
        try:
            engine = sa.create_engine(parsed, **engine_options)
        except (ImportError, exc.NoSuchModuleError) as error:
            raise LeaseConfigurationError(
                f"the driver of {mask(parsed.render_as_string(hide_password=False))} is not "
                f"installed ({error}): pip install 'celery-leases[postgres]' for PostgreSQL"
            ) from error
        try:
            store = cls(engine, table_name=table_name, create_table=create_table)
        except BaseException:
            engine.dispose()
            raise
        store._owns_engine = True
        return store

    def close(self) -> None:
        """Dispose the engine's connections if this store created the engine."""
        if self._owns_engine:
            self.engine.dispose()

    def __repr__(self) -> str:
        return f"SqlStore({self.url!r}, table_name={self.table.name!r})"

    # -- helpers ------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(
        self,
        operation: str,
        job_id: str | None = None,
        owner: str | None = None,
        generation: int | None = None,
    ) -> Iterator[None]:
        """Wrap driver errors of one operation: StoreUnavailable for an outage,
        LeaseConfigurationError for a refusal that trying again cannot change."""
        about = f" of job {job_id!r}" if job_id is not None else ""
        try:
            yield
        except (exc.DBAPIError, exc.TimeoutError) as error:
            if _permanent(error):
                raise LeaseConfigurationError(
                    f"SQL lease store {self.url} (table {self.table.name!r}) refused "
                    f"{operation}{about}: {_reason(error)}. {_FIX}",
                    job_id=job_id,
                    owner=owner,
                    generation=generation,
                ) from error
            raise StoreUnavailable(
                f"SQL lease store {self.url} (table {self.table.name!r}) failed "
                f"during {operation}{about}: {_reason(error)}. Check that the "
                "database is running and reachable; the outcome is unknown.",
                job_id=job_id,
                owner=owner,
                generation=generation,
            ) from error
        except exc.StatementError as error:
            # a value the driver could not send (not a database error)
            raise LeaseConfigurationError(
                f"SQL lease store {self.url} could not send {operation}{about}: {_reason(error)}",
                job_id=job_id,
                owner=owner,
                generation=generation,
            ) from error

    def _record(self, row: RowMapping) -> LeaseRecord:
        return _record(row, self.url)

    def _select_record(self, conn: Connection, job_id: str) -> LeaseRecord | None:
        row = conn.execute(self._statements.record, {"p_job_id": job_id}).first()
        return None if row is None else self._record(row._mapping)

    # -- fencing support ----------------------------------------------------

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
        return sa.exists().where(_held_by(self.table, job_id, owner, generation))

    # -- hooks --------------------------------------------------------------

    def _now_ms(self) -> int:
        with self._guard("now_ms"), self._reader.connect() as conn:
            return int(conn.execute(self._statements.now).scalar_one())

    def _claim(
        self, job_id: str, owner: str, ttl_ms: int, task_name: str, send_id: str | None
    ) -> ClaimResult:
        statements = self._statements
        parameters = {
            "p_job_id": job_id,
            "p_owner": owner,
            "p_ttl_ms": ttl_ms,
            "p_task_name": task_name,
            "p_send_id": send_id or "",
            "p_new_send": send_id is not None,
        }
        result: ClaimResult | None = None
        with self._guard("claim", job_id, owner), self._writer.begin() as conn:
            for _ in range(CLAIM_ATTEMPTS):
                row = conn.execute(statements.claim, parameters).first()
                if row is not None:
                    generation, lease_until, now, takeovers = row
                    result = Acquired(job_id, owner, generation, lease_until, now, takeovers)
                    break
                found = conn.execute(statements.holder, {"p_job_id": job_id}).first()
                if found is None:
                    continue  # purged between the two statements: claim again
                holder = self._record(found._mapping)
                now = int(found.now)
                if holder.state is LeaseState.COMPLETED:
                    if send_id is not None and send_id != holder.send_id:
                        continue  # completed since the claim looked: a new run
                    result = AlreadyCompleted(
                        job_id, holder.generation, holder.send_id, holder.outcome
                    )
                    break
                remaining = (holder.lease_until_ms - now) / 1000
                result = HeldElsewhere(job_id, holder.owner, holder.generation, max(0.0, remaining))
                if holder.is_live(now):
                    break
                # released or run out since the claim looked: try again
        if result is None:
            # every attempt found the record changing under it
            raise StoreUnavailable(
                f"SQL lease store {self.url}: the record of job {job_id!r} changed during "
                f"each of {CLAIM_ATTEMPTS} claim attempts; no lease was given",
                job_id=job_id,
                owner=owner,
            )
        # only now has the transaction committed (and the Acquired is real)
        return result

    def _renew(self, job_id: str, owner: str, generation: int, ttl_ms: int) -> RenewResult:
        parameters = {
            "p_job_id": job_id,
            "p_owner": owner,
            "p_generation": generation,
            "p_ttl_ms": ttl_ms,
        }
        with self._guard("renew", job_id, owner, generation), self._writer.begin() as conn:
            row = conn.execute(self._statements.renew, parameters).first()
            if row is None:
                return refusal_for(self._select_record(conn, job_id), job_id, owner, generation)
        return Renewed(job_id, generation, row.lease_until, row.renewed_at)

    def _renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """One UPDATE ... FROM (the batch as JSON rows) ... RETURNING.

        Refused requests cost one more SELECT of their records.
        """
        batch_json = json.dumps(
            [
                {
                    "job_id": r.job_id,
                    "owner": r.owner,
                    "generation": r.generation,
                    "ttl": ttl_to_ms(r.ttl),
                }
                for r in requests
            ]
        )
        with self._guard("renew_many"), self._writer.begin() as conn:
            renewed = {
                (row.job_id, row.owner, row.generation): Renewed(
                    row.job_id, row.generation, row.lease_until, row.renewed_at
                )
                for row in conn.execute(self._statements.renew_many, {"p_batch": batch_json})
            }
            refused = sorted(
                {r.job_id for r in requests if (r.job_id, r.owner, r.generation) not in renewed}
            )
            current = self._select_records(conn, refused)
        results: list[RenewResult] = []
        for r in requests:
            hit = renewed.get((r.job_id, r.owner, r.generation))
            if hit is not None:
                results.append(hit)
                continue
            record = current.get(r.job_id)
            if isinstance(record, LeaseRecordUnreadable):
                # one bad record must not stop the heartbeat of every other lease
                results.append(unreadable_refusal(r.job_id, r.owner, r.generation))
            else:
                results.append(refusal_for(record, r.job_id, r.owner, r.generation))
        return results

    def _select_records(
        self, conn: Connection, job_ids: Sequence[str]
    ) -> dict[str, LeaseRecord | LeaseRecordUnreadable]:
        """The records of ``job_ids`` (in chunks, to stay under bind limits);
        an error in place of each one that cannot be read."""
        found: dict[str, LeaseRecord | LeaseRecordUnreadable] = {}
        for start in range(0, len(job_ids), 1000):
            chunk = list(job_ids[start : start + 1000])
            for row in conn.execute(self._statements.records_of, {"p_job_ids": chunk}):
                found[row.job_id] = self._readable(row._mapping)
        return found

    def _readable(self, row: RowMapping) -> LeaseRecord | LeaseRecordUnreadable:
        try:
            return self._record(row)
        except LeaseRecordUnreadable as error:
            return error

    def _complete(
        self, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        parameters = {
            "p_job_id": job_id,
            "p_owner": owner,
            "p_generation": generation,
            "p_outcome": outcome,
        }
        with self._guard("complete", job_id, owner, generation), self._writer.begin() as conn:
            if conn.execute(self._statements.complete, parameters).first() is None:
                return refusal_for(self._select_record(conn, job_id), job_id, owner, generation)
        return Completed(job_id, generation)

    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        parameters = {"p_job_id": job_id, "p_owner": owner, "p_generation": generation}
        with self._guard("release", job_id, owner, generation), self._writer.begin() as conn:
            if conn.execute(self._statements.release, parameters).first() is None:
                return refusal_for(self._select_record(conn, job_id), job_id, owner, generation)
        return Released(job_id, generation)

    def _force_release(self, job_id: str, by: str, reason: str) -> LeaseRecord | None:
        parameters = {"p_job_id": job_id, "p_by": by, "p_reason": reason}
        with self._guard("force_release", job_id), self._writer.begin() as conn:
            row = conn.execute(self._statements.force_release, parameters).first()
            if row is not None:
                return self._record(row._mapping)
            # missing, completed (left as it is) or unreadable
            return self._select_record(conn, job_id)

    def _get(self, job_id: str) -> LeaseRecord | None:
        with self._guard("get", job_id), self._reader.connect() as conn:
            return self._select_record(conn, job_id)

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
            with self._guard("records"), self._reader.connect() as conn:
                rows = [row._mapping for row in conn.execute(query)]
            for row in rows:
                yield self._readable(row)
            if len(rows) < RECORDS_PAGE_SIZE:
                return
            after = rows[-1]["job_id"]

    def _purge(self, older_than_ms: int) -> int:
        with self._guard("purge"), self._writer.begin() as conn:
            result = conn.execute(self._statements.purge, {"p_older_than_ms": older_than_ms})
            return int(result.rowcount)
