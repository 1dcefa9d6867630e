"""The SQL store's queued marks (``lease_queue_unique``): their table and statements.

The marks live in a table of their own beside the lease table, named after
it with ``_queued`` (``celery_leases_queued`` by default), one row per key:
``job_id``, ``task_id``, ``queued_at`` and ``queued_until`` (milliseconds on
the database's clock). It is made with the lease table (``create_table``). A row
that ran out is taken over by the next mark and otherwise left; it is not
a lease record, so it never counts for a claim.

Placing a mark is an upsert that replaces the row only when it ran out,
then a read of the row: the mark is the caller's when the row names the
caller's task id (a fresh one per send), so of many senders at once
exactly one finds its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection, Engine

from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.stores.queued import QueuedMark
from celery_leases.stores.sql._errors import MYSQL_DEADLOCK, mysql_error_number

__all__ = ["MARK_ATTEMPTS", "QueuedMarks", "SideTable", "queued_table"]

#: tries of one mark: the row read after the upsert can be gone (its run
#: claimed it), and InnoDB may end a transaction of a race as a deadlock
MARK_ATTEMPTS = 5


def queued_table(metadata: sa.MetaData, lease_table: sa.Table) -> sa.Table:
    """The table of the queued marks beside ``lease_table`` (same key type)."""
    return sa.Table(
        f"{lease_table.name}_queued",
        metadata,
        sa.Column("job_id", lease_table.c.job_id.type, primary_key=True),
        sa.Column("task_id", lease_table.c.task_id.type, nullable=False),
        sa.Column("queued_at", sa.BigInteger, nullable=False),
        sa.Column("queued_until", sa.BigInteger, nullable=False),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


class SideTable:
    """A table beside the lease table, made with it (``create_table``).

    Args:
        table: the table.
        what: what its rows are, for messages.
    """

    def __init__(self, table: sa.Table, what: str) -> None:
        self.table = table
        self.what = what
        self.ready = False

    def exists(self, engine: Engine) -> bool:
        """Whether the table is there (made with the lease table: ``create_table``)."""
        if not self.ready:
            with engine.connect() as conn:
                self.ready = sa.inspect(conn).has_table(self.table.name)
        return self.ready

    def missing(self, url: str, job_id: str) -> LeaseConfigurationError:
        """The error of a call that needs the table where it is missing."""
        return LeaseConfigurationError(
            f"the table of {self.what} {self.table.name!r} is missing in {url}: it is "
            "made with the lease table, by `celery leases init-db` (in a Django "
            "project: manage.py migrate), or by a store opened with create_table=True",
            job_id=job_id,
        )


class QueuedMarks(SideTable):
    """The statements on one store's mark table.

    Args:
        lease_table: the store's lease table.
        dialect: the store's dialect entry (``now_ms()``, ``insert``,
            ``lock_for_ddl``, ``unlock_for_ddl``, ``name``).
    """

    def __init__(self, lease_table: sa.Table, dialect: Any) -> None:
        super().__init__(queued_table(sa.MetaData(), lease_table), "queued marks")
        self.dialect = dialect
        table = self.table
        now = dialect.now_ms()
        insert = dialect.insert(table).values(
            job_id=sa.bindparam("p_job_id"),
            task_id=sa.bindparam("p_task_id"),
            queued_at=now,
            queued_until=now + sa.bindparam("p_ttl_ms", type_=sa.BigInteger),
        )
        ran_out = table.c.queued_until <= now
        # the sender's own mark, marked again for longer (after its publish)
        taken = sa.or_(ran_out, table.c.task_id == sa.bindparam("p_task_id"))
        if dialect.name == "mysql":
            # assignments apply left to right, each seeing the ones before:
            # queued_at first (it tests ran_out alone), then task_id, then
            # queued_until, which both tests read
            self.upsert = insert.on_duplicate_key_update(
                [
                    (
                        "queued_at",
                        sa.case((ran_out, insert.inserted.queued_at), else_=table.c.queued_at),
                    ),
                    ("task_id", sa.case((taken, insert.inserted.task_id), else_=table.c.task_id)),
                    (
                        "queued_until",
                        sa.case((taken, insert.inserted.queued_until), else_=table.c.queued_until),
                    ),
                ]
            )
        else:
            self.upsert = insert.on_conflict_do_update(
                index_elements=[table.c.job_id],
                set_={
                    "task_id": insert.excluded.task_id,
                    "queued_at": sa.case(
                        (ran_out, insert.excluded.queued_at), else_=table.c.queued_at
                    ),
                    "queued_until": insert.excluded.queued_until,
                },
                where=taken,
            )
        live = sa.and_(table.c.job_id == sa.bindparam("p_job_id"), table.c.queued_until > now)
        read = sa.select(table.c.task_id, table.c.queued_at, table.c.queued_until).where(live)
        self.read = read.with_for_update() if dialect.name == "mysql" else read
        own = sa.and_(live, table.c.task_id == sa.bindparam("p_task_id"))
        self.extend_own = (
            sa.update(table)
            .where(own)
            .values(queued_until=now + sa.bindparam("p_ttl_ms", type_=sa.BigInteger))
        )
        self.delete = sa.delete(table).where(own)
        self.delete_ran_out = sa.delete(table).where(
            table.c.job_id == sa.bindparam("p_job_id"),
            table.c.task_id == sa.bindparam("p_task_id"),
        )

    def mark(
        self, in_write: Callable[..., Any], job_id: str, task_id: str, ttl_ms: int
    ) -> QueuedMark:
        """Place the mark unless a live one is there; the live mark after it.

        ``in_write(step, parameters)`` runs ``step(conn, parameters)`` on a
        writing connection, in a transaction where the database has them.
        """
        parameters = {"p_job_id": job_id, "p_task_id": task_id, "p_ttl_ms": ttl_ms}
        for _ in range(MARK_ATTEMPTS):
            try:
                mark: QueuedMark | None = in_write(self._mark, parameters)
            except exc.OperationalError as error:
                if mysql_error_number(error.orig) != MYSQL_DEADLOCK:
                    raise
                continue  # the server rolled the transaction back: nothing was written
            if mark is not None:
                return mark
        raise StoreUnavailable(
            f"the queued mark of job {job_id!r} kept changing under {MARK_ATTEMPTS} tries"
        )

    def _mark(self, conn: Connection, parameters: dict[str, Any]) -> QueuedMark | None:
        conn.execute(self.upsert, parameters)
        return self.live(conn, parameters["p_job_id"])

    def live(self, conn: Connection, job_id: str) -> QueuedMark | None:
        """The mark of ``job_id`` that has not run out, or ``None``."""
        row = conn.execute(self.read, {"p_job_id": job_id}).first()
        if row is None:
            return None
        return QueuedMark(job_id, str(row.task_id), int(row.queued_at), int(row.queued_until))

    def extend(self, conn: Connection, job_id: str, task_id: str, ttl_ms: int) -> QueuedMark | None:
        """Make the live mark of ``task_id`` run out ``ttl_ms`` from now (it
        places none); the live mark after it."""
        parameters = {"p_job_id": job_id, "p_task_id": task_id, "p_ttl_ms": ttl_ms}
        conn.execute(self.extend_own, parameters)
        return self.live(conn, job_id)

    def unmark(self, conn: Connection, job_id: str, task_id: str) -> bool:
        """Delete the mark if it names ``task_id``: whether a live one went."""
        parameters = {"p_job_id": job_id, "p_task_id": task_id}
        if conn.execute(self.delete, parameters).rowcount:
            return True
        conn.execute(self.delete_ran_out, parameters)
        return False
