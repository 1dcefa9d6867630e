"""The SQL store's waiters (``lease_on_busy="wait"``): their table and statements.

The waiters live in a table of their own beside the lease table, named
after it with ``_waiters`` (``celery_leases_waiters`` by default), one row
per waiting send: ``job_id`` and ``send_id`` (the key), ``task_id``,
``waiting_since`` and ``waiting_until`` (milliseconds on the database's
clock) and ``payload``. It is made with the lease table (``create_table``).
A row that ran out never counts; it is deleted by the job's next take or
registration, and by :meth:`~celery_leases.stores.base.LeaseStore.purge`.

Taking is one ``DELETE ... RETURNING`` on PostgreSQL and SQLite, and a
locking read then a delete in one transaction on MySQL and MariaDB: of
two takers at once, each row goes to one.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection

from celery_leases.stores.sql._queued import SideTable
from celery_leases.stores.sql._table import MYSQL_NAMES
from celery_leases.stores.waiters import MAX_WAITERS, Waiter

__all__ = ["Waiters", "waiters_table"]


def waiters_table(metadata: sa.MetaData, lease_table: sa.Table) -> sa.Table:
    """The table of the waiters beside ``lease_table`` (same key types)."""
    return sa.Table(
        f"{lease_table.name}_waiters",
        metadata,
        sa.Column("job_id", lease_table.c.job_id.type, primary_key=True),
        sa.Column("send_id", lease_table.c.send_id.type, primary_key=True),
        sa.Column("task_id", lease_table.c.task_id.type, nullable=False),
        sa.Column("waiting_since", sa.BigInteger, nullable=False),
        sa.Column("waiting_until", sa.BigInteger, nullable=False),
        # MySQL's BLOB holds 64 KiB less one byte, less than MAX_WAITER_BYTES
        sa.Column(
            "payload",
            sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), *MYSQL_NAMES),
            nullable=False,
        ),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


class Waiters(SideTable):
    """The statements on one store's waiters table.

    Args:
        lease_table: the store's lease table.
        dialect: the store's dialect entry (``now_ms()``, ``insert``, ``name``).
    """

    def __init__(self, lease_table: sa.Table, dialect: Any) -> None:
        super().__init__(waiters_table(sa.MetaData(), lease_table), "waiters")
        table = self.table
        now = dialect.now_ms()
        of_job = table.c.job_id == sa.bindparam("p_job_id")
        live = table.c.waiting_until > now
        self.sweep = sa.delete(table).where(of_job, sa.not_(live))
        self.sweep_all = sa.delete(table).where(sa.not_(live))
        self.count_others = (
            sa.select(sa.func.count())
            .select_from(table)
            .where(of_job, live, table.c.send_id != sa.bindparam("p_send_id"))
        )
        insert = dialect.insert(table).values(
            job_id=sa.bindparam("p_job_id"),
            send_id=sa.bindparam("p_send_id"),
            task_id=sa.bindparam("p_task_id"),
            payload=sa.bindparam("p_payload", type_=sa.LargeBinary),
            waiting_since=now,
            waiting_until=now + sa.bindparam("p_ttl_ms", type_=sa.BigInteger),
        )
        columns = ("task_id", "payload", "waiting_since", "waiting_until")
        if dialect.name == "mysql":
            self.upsert = insert.on_duplicate_key_update(
                {name: getattr(insert.inserted, name) for name in columns}
            )
        else:
            self.upsert = insert.on_conflict_do_update(
                index_elements=[table.c.job_id, table.c.send_id],
                set_={name: getattr(insert.excluded, name) for name in columns},
            )
        fields = (
            table.c.send_id,
            table.c.task_id,
            table.c.payload,
            table.c.waiting_since,
            table.c.waiting_until,
            now.label("now"),
        )
        self.read = sa.select(*fields).where(of_job)
        self.returning = dialect.name != "mysql"
        # a mark (no payload) is never taken
        waiting = sa.and_(of_job, sa.func.length(table.c.payload) > 0)
        self.take = (
            sa.delete(table).where(waiting).returning(*fields)
            if self.returning
            else sa.delete(table).where(waiting)
        )
        self.read_locked = sa.select(*fields).where(waiting).with_for_update()

    def add(
        self, conn: Connection, job_id: str, send_id: str, task_id: str, payload: bytes, ttl_ms: int
    ) -> bool:
        """Register the send unless the job has :data:`MAX_WAITERS` others."""
        parameters = {
            "p_job_id": job_id, "p_send_id": send_id, "p_task_id": task_id,
            "p_payload": payload, "p_ttl_ms": ttl_ms,
        }  # fmt: skip
        conn.execute(self.sweep, parameters)
        if int(conn.execute(self.count_others, parameters).scalar_one()) >= MAX_WAITERS:
            return False
        conn.execute(self.upsert, parameters)
        return True

    def taken(self, conn: Connection, job_id: str) -> list[Waiter]:
        """Delete the job's rows; the live ones among them."""
        parameters = {"p_job_id": job_id}
        if self.returning:
            rows = conn.execute(self.take, parameters).all()
        else:
            rows = conn.execute(self.read_locked, parameters).all()
            conn.execute(self.take, parameters)
        return _live(job_id, rows)

    def live(self, conn: Connection, job_id: str) -> list[Waiter]:
        """The job's live waiters; a read."""
        return _live(job_id, conn.execute(self.read, {"p_job_id": job_id}).all())

    def purge(self, conn: Connection) -> None:
        """Delete every row that ran out."""
        conn.execute(self.sweep_all)


def _live(job_id: str, rows: Any) -> list[Waiter]:
    waiters = [
        Waiter(
            job_id,
            str(row.send_id),
            str(row.task_id),
            bytes(row.payload),
            int(row.waiting_since),
            int(row.waiting_until),
        )
        for row in rows
        if int(row.waiting_until) > int(row.now)
    ]
    return sorted(waiters, key=lambda waiter: waiter.waiting_since_ms)
