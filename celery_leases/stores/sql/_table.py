"""The lease table, the clock and what differs between PostgreSQL, SQLite and MySQL.

Used by :mod:`celery_leases.stores.sql._store`; ``lease_table`` is public there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection
from sqlalchemy.sql.expression import ColumnElement, FromClause

from celery_leases.errors import LeaseConfigurationError
from celery_leases.stores.base import LeaseRecord, LeaseState, unreadable
from celery_leases.stores.sql._indexes import indexes_in, lease_indexes
from celery_leases.values import is_whole

DEFAULT_TABLE_NAME = "celery_leases"


_TABLE_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


# --- the clock, per dialect --------------------------------------------------

#: PostgreSQL: clock_timestamp() is the time at evaluation. now() and
#: CURRENT_TIMESTAMP are the *transaction's* start and would stand still.
POSTGRES_NOW_MS = "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"

#: SQLite: julianday('now') is a REAL count of days that SQLite computes from
#: integer milliseconds, and 'now' is the same for a whole sqlite3_step().
#: 2440587.5 is the Unix epoch as a Julian day; ROUND undoes the float error
#: so the result is the exact millisecond (never a text timestamp).
SQLITE_NOW_MS = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"

#: MySQL and MariaDB: UTC_TIMESTAMP(6) is the statement's start, the same
#: for every use in one statement, and independent of the session's time
#: zone (UNIX_TIMESTAMP(NOW()) is not: it steps back when daylight saving
#: time ends). Microseconds since the epoch, divided down to whole ms.
MYSQL_NOW_MS = (
    "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)"
)

#: the names SQLAlchemy gives MySQL's dialects
MYSQL_NAMES = ("mysql", "mariadb")

#: MySQL: what an upsert sets LAST_INSERT_ID() to when it found its row, so
#: that its reply tells a found row from an insert (which reports 0, the
#: AUTO_INCREMENT value or the generation it wrote, never this)
MYSQL_ROW_EXISTED = 2**64 - 1

#: Option on connections that only read: SQLite then begins a deferred
#: transaction instead of taking the write lock.
READ_ONLY_OPTION = "celery_leases_read_only"


class _ExactText(sa.types.TypeDecorator[str]):
    """MySQL: text compared byte for byte, as VARBINARY of its UTF-8.

    MySQL's text collations ignore case (``utf8mb4_general_ci``) or trailing
    spaces (every ``PAD SPACE`` one, ``utf8mb4_bin`` too), so two job ids
    that differ only there would share one record.
    """

    impl = mysql.VARBINARY(1020)  # 255 characters of up to 4 bytes
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> bytes | None:
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value: bytes | str | None, dialect: Any) -> str | None:
        if value is None or isinstance(value, str):  # a column made as text by hand
            return value
        return bytes(value).decode("utf-8")


def key_text() -> sa.types.TypeEngine[str]:
    """A job id, owner or send id: compared exactly in every database."""
    return sa.String(255).with_variant(_ExactText(), *MYSQL_NAMES)


def lease_table(
    metadata: sa.MetaData, table_name: str = DEFAULT_TABLE_NAME, *, dialect: str | None = None
) -> sa.Table:
    """Define the lease table on ``metadata``.

    Times are integer milliseconds on the database's clock. In MySQL the
    table is InnoDB in ``utf8mb4``, and job ids, owners and send ids are
    ``VARBINARY`` (see :class:`_ExactText`).

    The index differs between databases (module ``sql_indexes``). Without
    ``dialect`` the table carries each with a condition that makes
    ``create_all`` emit only the database's own; with a dialect name
    (``"postgresql"``, ``"sqlite"``, ``"mysql"``) it carries that one only,
    as a tool that compares tables (Alembic's autogenerate) needs, since it
    ignores the conditions.

    Raises:
        LeaseConfigurationError: ``table_name`` is not a plain identifier.
    """
    _check_table_name(table_name)
    return sa.Table(
        table_name,
        metadata,
        sa.Column("job_id", key_text(), primary_key=True),
        sa.Column("owner", key_text(), nullable=False, server_default=""),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column("lease_until", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False, server_default=""),
        sa.Column("claimed_at", sa.BigInteger, nullable=True),
        sa.Column("renewed_at", sa.BigInteger, nullable=True),
        sa.Column("completed_at", sa.BigInteger, nullable=True),
        sa.Column("renew_count", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("takeovers", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("send_id", key_text(), nullable=False, server_default=""),
        # MySQL's BLOB holds 64 KiB, less than MAX_OUTCOME_BYTES
        sa.Column(
            "outcome",
            sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), *MYSQL_NAMES),
            nullable=True,
        ),
        sa.Column("released_at", sa.BigInteger, nullable=True),
        sa.Column("released_by", sa.String(255), nullable=False, server_default=""),
        # MySQL before 8.0.13 gives a TEXT column no default; REASON_LIMIT is 1000
        sa.Column(
            "release_reason",
            sa.Text().with_variant(sa.String(1000), *MYSQL_NAMES),
            nullable=False,
            server_default="",
        ),
        sa.Column("task_id", key_text(), nullable=False, server_default=""),
        # purge and records(state=...) filter on state and completed_at
        *lease_indexes(table_name, dialect),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


def missing_parts(conn: Connection, table: sa.Table) -> list[str]:
    """What the database's table named as ``table`` lacks of it: its
    columns and the database's index, each named; empty for this release's
    table.

    Raises:
        sqlalchemy.exc.NoSuchTableError: there is no such table.
    """
    inspector = sa.inspect(conn)
    columns = {c["name"] for c in inspector.get_columns(table.name)}
    indexes = {str(i["name"]) for i in inspector.get_indexes(table.name)}
    return [
        *(f"column {c.name}" for c in table.columns if c.name not in columns),
        *(
            f"index {index.name}"
            for index in indexes_in(table, conn.dialect.name)
            if index.name not in indexes
        ),
    ]


# --- what differs between PostgreSQL, SQLite and MySQL -------------------------


@dataclass(frozen=True)
class SqlDialect:
    """Everything dialect-specific, in one place."""

    name: str
    #: SQL text of "now in integer milliseconds" on the database's clock
    now_sql: str
    #: the dialect's INSERT, which has on_conflict_do_update
    insert: Callable[[sa.Table], Any]
    #: turns the bound JSON text of a renew batch into rows
    #: (job_id, owner, generation, ttl); None in MySQL, which renews a
    #: batch under the records' locks (module sql_mysql)
    batch_rows: Callable[[sa.BindParameter[str]], FromClause] | None
    #: execution options of connections that write / only read
    write_options: Mapping[str, Any]
    read_options: Mapping[str, Any]
    #: true when a column holds a whole number (SQLite keeps any value in any
    #: column, and then 'abc' + 1 is 1)
    whole: Callable[[ColumnElement[Any]], ColumnElement[bool]]
    #: the larger of two integers (GREATEST in PostgreSQL, two-argument
    #: max() in SQLite)
    greatest: Callable[[ColumnElement[Any], ColumnElement[Any]], ColumnElement[int]]
    #: SQLAlchemy's dialect, to compile DDL without a connection
    compiler: Callable[[], sa.engine.Dialect]

    def now_ms(self) -> ColumnElement[int]:
        """The database's clock in ms, as a column expression."""
        return sa.literal_column(self.now_sql, sa.BigInteger)

    def lock_for_ddl(self, conn: Connection, table_name: str) -> None:
        """Take the lock (``DDL_LOCKS``) that serializes DDL on the lease
        table inside ``conn``'s transaction.

        Raises:
            LeaseConfigurationError: the lock was not taken within 30 s.
        """
        take = DDL_LOCKS[self.name][0]
        if take is not None:
            answer = conn.execute(sa.text(take), {"name": ddl_lock_name(table_name)}).scalar()
            check_ddl_lock_taken(answer, table_name)

    def unlock_for_ddl(self, conn: Connection, table_name: str) -> None:
        """Give that lock up, where the transaction's end does not."""
        end = DDL_LOCKS[self.name][1]
        if end is not None:
            conn.execute(sa.text(end), {"name": ddl_lock_name(table_name)})


def _postgres_batch_rows(batch: sa.BindParameter[str]) -> FromClause:
    return (
        sa.func.jsonb_to_recordset(sa.cast(batch, pg.JSONB))
        .table_valued(
            sa.column("job_id", sa.Text),
            sa.column("owner", sa.Text),
            sa.column("generation", sa.BigInteger),
            sa.column("ttl", sa.BigInteger),
        )
        .render_derived(name="batch", with_types=True)
    )


def _sqlite_batch_rows(batch: sa.BindParameter[str]) -> FromClause:
    item = sa.func.json_each(batch).table_valued("value").alias("item")
    return (
        sa.select(
            sa.func.json_extract(item.c.value, "$.job_id", type_=sa.String).label("job_id"),
            sa.func.json_extract(item.c.value, "$.owner", type_=sa.String).label("owner"),
            sa.func.json_extract(item.c.value, "$.generation", type_=sa.BigInteger).label(
                "generation"
            ),
            sa.func.json_extract(item.c.value, "$.ttl", type_=sa.BigInteger).label("ttl"),
        )
        .select_from(item)
        .subquery("batch")
    )


#: per dialect, the statements that make DDL on a lease table take turns
#: (the lock named by ddl_lock_name, bound as :name) and that end it; None
#: where the transaction does. PostgreSQL: two processes creating the table
#: at once both pass checkfirst and one fails on the catalog's unique index,
#: so a transaction-scoped advisory lock makes them take turns. SQLite:
#: BEGIN IMMEDIATE already holds the write lock. MySQL: DDL commits at once,
#: so no lock of a transaction outlives it; a named lock of the session
#: does, until RELEASE_LOCK. Each taking statement answers 1 once it holds it.
DDL_LOCKS: dict[str, tuple[str | None, str | None]] = {
    "postgresql": ("SELECT 1 FROM pg_advisory_xact_lock(hashtext(:name))", None),
    "sqlite": (None, None),
    "mysql": ("SELECT GET_LOCK(:name, 30)", "SELECT RELEASE_LOCK(:name)"),
}


#: per dialect, what bounds the idle time of a caller's transaction that
#: holds a lease record's lock (``exactly_once``), so that a process paused
#: inside it holds the lock no longer than its lease: the statement that sets
#: the bound (``:ms``, milliseconds, or ``:seconds``, whole seconds), and
#: where the setting outlives the transaction the statement that reads it,
#: to set it back before the end. PostgreSQL: the server ends a session idle
#: in its transaction that long (``set_config`` with ``is_local`` is ``SET
#: LOCAL``, which takes no bind parameter). MySQL and MariaDB: the session's
#: ``wait_timeout`` ends a connection idle that long, in a transaction or not.
#: SQLite: nothing can; a paused process keeps the database's write lock.
IDLE_LIMITS: dict[str, tuple[str, str | None] | None] = {
    "postgresql": (
        "SELECT set_config('idle_in_transaction_session_timeout', CAST(:ms AS TEXT), true)",
        None,
    ),
    "mysql": ("SET SESSION wait_timeout = :seconds", "SELECT @@SESSION.wait_timeout"),
    "sqlite": None,
}


def ddl_lock_name(table_name: str) -> str:
    """The name of the lock that serializes DDL on lease table ``table_name``."""
    return f"celery_leases:{table_name}"


def check_ddl_lock_taken(answer: object, table_name: str) -> None:
    """Refuse to go on unless a DDL_LOCKS taking statement answered 1.

    Raises:
        LeaseConfigurationError: the lock was not taken within 30 s.
    """
    if answer != 1:
        raise LeaseConfigurationError(
            f"could not take the lock that serializes creating the lease table "
            f"{table_name!r} within 30 s; another process holds it"
        )


def _postgres_greatest(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[int]:
    return sa.func.greatest(a, b, type_=sa.BigInteger)


def _sqlite_greatest(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[int]:
    return sa.func.max(a, b, type_=sa.BigInteger)


def _postgres_whole(column: ColumnElement[Any]) -> ColumnElement[bool]:
    return sa.true()  # a BIGINT column holds nothing else


def _sqlite_whole(column: ColumnElement[Any]) -> ColumnElement[bool]:
    return sa.func.typeof(column) == "integer"


POSTGRES = SqlDialect(
    name="postgresql",
    now_sql=POSTGRES_NOW_MS,
    insert=pg.insert,
    batch_rows=_postgres_batch_rows,
    write_options={"isolation_level": "AUTOCOMMIT"},
    read_options={"isolation_level": "AUTOCOMMIT"},
    whole=_postgres_whole,
    greatest=_postgres_greatest,
    compiler=pg.dialect,
)

SQLITE = SqlDialect(
    name="sqlite",
    now_sql=SQLITE_NOW_MS,
    insert=sqlite_dialect.insert,
    batch_rows=_sqlite_batch_rows,
    write_options={},
    read_options={READ_ONLY_OPTION: True},
    whole=_sqlite_whole,
    greatest=_sqlite_greatest,
    compiler=sqlite_dialect.dialect,
)


#: MySQL and MariaDB (InnoDB): each write runs in a transaction that locks
#: the record first (module sql_mysql), as there is no UPDATE ... RETURNING
MYSQL = SqlDialect(
    name="mysql",
    now_sql=MYSQL_NOW_MS,
    insert=mysql.insert,
    batch_rows=None,
    write_options={},
    read_options={},
    whole=_postgres_whole,
    greatest=_postgres_greatest,
    compiler=mysql.dialect,
)

#: the dialect of each database name SQLAlchemy gives (a Django connection's
#: vendor is one of them)
DIALECTS = {"postgresql": POSTGRES, "sqlite": SQLITE, **dict.fromkeys(MYSQL_NAMES, MYSQL)}


def dialect_named(name: str, user: str) -> SqlDialect:
    """The dialect of the database SQLAlchemy (or Django) calls ``name``.

    Raises:
        LeaseConfigurationError: it is none of PostgreSQL, SQLite, MySQL and
            MariaDB; the message begins with ``user``, what needs one of them.
    """
    if name not in DIALECTS:
        raise LeaseConfigurationError(
            f"{user}: the database must be PostgreSQL, SQLite or MySQL/MariaDB, not {name!r}"
        )
    return DIALECTS[name]


def lock_on_duplicate(insert: Any, column: sa.Column[Any]) -> Any:
    """MySQL's upsert that locks: ``insert`` (of ``mysql.insert``) inserts its
    row, or, when a row with its key exists, locks that row exclusively and
    changes nothing.

    The duplicate branch sets ``LAST_INSERT_ID()`` to :data:`MYSQL_ROW_EXISTED`,
    which the reply carries as its insert id (``lastrowid``): that tells which
    it did, where a row count cannot (with ``CLIENT_FOUND_ROWS``, SQLAlchemy's
    setting, both count 1). The lock is exclusive at once, so a later ``FOR
    UPDATE`` read never upgrades a shared lock (which deadlocks two writers),
    and two writers of a new row take turns on its key lock, with no gap lock
    to deadlock on. ``column`` is the key column the update sets to itself.
    """
    keep = sa.func.IF(sa.func.LAST_INSERT_ID(MYSQL_ROW_EXISTED), column, column)
    return insert.on_duplicate_key_update({column.name: keep})


def _check_table_name(table_name: object) -> None:
    if not isinstance(table_name, str) or not _TABLE_NAME_PATTERN.fullmatch(table_name):
        raise LeaseConfigurationError(
            f"table_name must be letters, digits and underscores (at most 40, not "
            f"starting with a digit), got {table_name!r}"
        )


def record_of(row: Mapping[Any, Any], where: str) -> LeaseRecord:
    """The record in ``row``, a row of the lease table by column name: the one
    reader of a lease row, for the store, the fenced SQL targets and the Django
    app (``where`` names the table in the message of an unreadable one).

    Raises:
        LeaseRecordUnreadable: a column holds what the store never writes.
    """
    job_id = str(row["job_id"])
    try:
        outcome = row["outcome"]
        return LeaseRecord(
            job_id=job_id,
            owner=_text(row, "owner"),
            generation=_whole(row, "generation"),
            lease_until_ms=_whole(row, "lease_until"),
            state=LeaseState(row["state"]),
            task_name=_text(row, "task_name"),
            claimed_at_ms=_optional_whole(row, "claimed_at"),
            renewed_at_ms=_optional_whole(row, "renewed_at"),
            completed_at_ms=_optional_whole(row, "completed_at"),
            renew_count=_whole(row, "renew_count"),
            takeovers=_whole(row, "takeovers"),
            send_id=_text(row, "send_id"),
            outcome=None if outcome is None else bytes(outcome),
            released_at_ms=_optional_whole(row, "released_at"),
            released_by=_text(row, "released_by"),
            release_reason=_text(row, "release_reason"),
            task_id=_text(row, "task_id"),
        )
    except (ValueError, TypeError) as error:
        raise unreadable(job_id, where, str(error)) from error


def _whole(row: Mapping[Any, Any], name: str) -> int:
    value = row[name]
    if not is_whole(value):
        raise ValueError(f"{name} is {value!r}, not a whole number")
    return value


def _optional_whole(row: Mapping[Any, Any], name: str) -> int | None:
    return None if row[name] is None else _whole(row, name)


def _text(row: Mapping[Any, Any], name: str) -> str:
    value = row[name]
    if not isinstance(value, str):
        raise ValueError(f"{name} is {value!r}, not text")
    return value
