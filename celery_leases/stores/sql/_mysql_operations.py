"""The SQL lease store's operations on MySQL and MariaDB (InnoDB).

Used by :mod:`celery_leases.stores.sql._store`. MySQL has no ``UPDATE ...
RETURNING`` and its upsert has no condition, so a claim and a renewal
decide on records they hold locked, in one transaction::

    BEGIN (implicit)
    INSERT INTO t (...) VALUES (..., generation = LAST_INSERT_ID(now), ...)
        ON DUPLICATE KEY UPDATE job_id = IF(LAST_INSERT_ID(marker), job_id, job_id)
                                     -- a first claim: done, the insert id
                                     -- is its generation; else the record
                                     -- is now locked and the id the marker
    SELECT now, t.* FROM (SELECT now) n LEFT JOIN t ON t.job_id IN (...)
        FOR UPDATE                   -- the clock and the locked record
    decide in Python, on the record and that clock reading
    UPDATE ... WHERE job_id = ... AND generation = <as read>   (a takeover)
    COMMIT

The upsert takes the record's lock exclusively at once: concurrent claims
of one job wait in turn on its key, where a locking read of a missing row
would lock the gap and deadlock them. The clock of a decision is read at
the locking SELECT's start, after the lock was granted, and the new
``lease_until`` counts from it. A renewal locks its records with that
SELECT (a batch in job_id order) and updates the current ones. Completion,
release and an operator's release are one conditional UPDATE; its row count
(1 or 0: each changes a column it matched on) says whether it applied.
A transaction InnoDB ends as a deadlock is a claim made again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Engine

from celery_leases.errors import LeaseRecordUnreadable
from celery_leases.stores.base import (
    Acquired,
    ClaimResult,
    Completed,
    CompleteResult,
    LeaseRecord,
    LeaseState,
    Refusal,
    Released,
    ReleaseResult,
    Renewed,
    RenewRequest,
    RenewResult,
    refusal_for,
    ttl_to_ms,
    unreadable_refusal,
)
from celery_leases.stores.sql._errors import MYSQL_DEADLOCK, mysql_error_number
from celery_leases.stores.sql._operations import CLAIM_ATTEMPTS, Operations
from celery_leases.stores.sql._statements import Statements
from celery_leases.stores.sql._table import MYSQL_ROW_EXISTED, SqlDialect, lock_on_duplicate

__all__ = ["MysqlOperations"]

#: what a completion or a release returns when it applied
_Written = TypeVar("_Written", Completed, Released)

#: records locked by one SELECT of a batch renewal
_BATCH_CHUNK = 500


def _claim_upsert(t: sa.Table, dialect: SqlDialect) -> Any:
    """INSERT the first claim of a job, or lock its record and change nothing
    (:func:`lock_on_duplicate`): a new row reports its generation (the clock,
    set with ``LAST_INSERT_ID(expr)``) as the insert id, an existing one
    ``MYSQL_ROW_EXISTED``."""
    now = dialect.now_ms()
    insert = mysql.insert(t).values(
        job_id=sa.bindparam("p_job_id"),
        owner=sa.bindparam("p_owner"),
        generation=sa.func.LAST_INSERT_ID(now, type_=sa.BigInteger),
        lease_until=now + sa.bindparam("p_ttl_ms", type_=sa.BigInteger),
        state=LeaseState.HELD.value,
        task_name=sa.bindparam("p_task_name"),
        claimed_at=now,
        renew_count=0,
        takeovers=0,
        send_id=sa.bindparam("p_send_id"),
        task_id=sa.bindparam("p_task_id"),
    )
    return lock_on_duplicate(insert, t.c.job_id)


@dataclass(frozen=True)
class MysqlStatements:
    """MySQL's own statements, built once per store."""

    #: the clock, and the records of ``:p_job_ids`` locked FOR UPDATE (one
    #: row of NULLs when none exists)
    lock_records: Any
    #: a job's first claim, or the lock of its record (see _claim_locked)
    claim_upsert: Any
    #: a takeover of the record as it was read (``:p_old_generation``)
    takeover: Any
    #: the renewal of the locked records ``:p_job_ids``
    renew_locked: Any

    @classmethod
    def build(cls, table: sa.Table, dialect: SqlDialect) -> MysqlStatements:
        t = table
        n = sa.select(dialect.now_ms().label("now")).subquery("n")
        held = LeaseState.HELD.value
        now = sa.bindparam("p_now", type_=sa.BigInteger)
        lease_until = now + sa.bindparam("p_ttl_ms", type_=sa.BigInteger)
        claim_values = {
            "owner": sa.bindparam("p_owner"),
            "generation": sa.bindparam("p_generation", type_=sa.BigInteger),
            "lease_until": lease_until,
            "state": held,
            "task_name": sa.bindparam("p_task_name"),
            "claimed_at": now,
            "renew_count": 0,
            "takeovers": sa.bindparam("p_takeovers", type_=sa.Integer),
            "send_id": sa.bindparam("p_send_id"),
            "task_id": sa.bindparam("p_task_id"),
        }
        return cls(
            lock_records=(
                sa.select(n.c.now, t)
                .select_from(
                    n.outerjoin(t, t.c.job_id.in_(sa.bindparam("p_job_ids", expanding=True)))
                )
                .order_by(t.c.job_id)
                .with_for_update()
            ),
            claim_upsert=_claim_upsert(t, dialect),
            takeover=(
                sa.update(t)
                .values(
                    **claim_values,
                    renewed_at=None,
                    completed_at=None,
                    outcome=None,
                    released_at=None,
                    released_by="",
                    release_reason="",
                )
                .where(
                    t.c.job_id == sa.bindparam("p_job_id"),
                    t.c.generation == sa.bindparam("p_old_generation", type_=sa.BigInteger),
                )
            ),
            renew_locked=(
                sa.update(t)
                .values(lease_until=lease_until, renewed_at=now, renew_count=t.c.renew_count + 1)
                .where(t.c.job_id.in_(sa.bindparam("p_job_ids", expanding=True)))
            ),
        )


class MysqlOperations(Operations):
    """The operations on one store's table in MySQL or MariaDB."""

    def __init__(self, statements: Statements, where: str, mysql: MysqlStatements) -> None:
        super().__init__(statements, where)
        self.mysql = mysql

    def _locked(
        self, conn: Connection, job_ids: Sequence[str]
    ) -> tuple[int, dict[str, LeaseRecord | LeaseRecordUnreadable]]:
        """The clock and the records of ``job_ids``, each now locked."""
        rows = conn.execute(self.mysql.lock_records, {"p_job_ids": list(job_ids)}).all()
        records = {
            row.job_id: self.readable(row._mapping) for row in rows if row.job_id is not None
        }
        return int(rows[0].now), records

    # -- claim ----------------------------------------------------------------

    def claim_in_turns(self, engine: Engine, parameters: dict[str, Any]) -> ClaimResult:
        """Claim in a transaction of its own; again in a new one when InnoDB
        ended it as a deadlock (the server rolled it back)."""
        for _ in range(CLAIM_ATTEMPTS):
            try:
                with engine.begin() as conn:
                    return self._claim_locked(conn, parameters)
            except exc.OperationalError as error:
                if mysql_error_number(error.orig) != MYSQL_DEADLOCK:
                    raise
        raise self._undecided(parameters)

    def _claim_locked(self, conn: Connection, parameters: dict[str, Any]) -> ClaimResult:
        """The first claim of a job in one upsert; otherwise a decision on
        its record, which that upsert locked."""
        job_id, owner = parameters["p_job_id"], parameters["p_owner"]
        ttl_ms = parameters["p_ttl_ms"]
        generation = conn.execute(self.mysql.claim_upsert, parameters).lastrowid
        if generation != MYSQL_ROW_EXISTED:
            if not generation:  # a server that does not report LAST_INSERT_ID(expr)
                row = conn.execute(self.statements.record, {"p_job_id": job_id}).one()
                generation = row.generation
            return Acquired(job_id, owner, generation, generation + ttl_ms, generation, 0)
        now, records = self._locked(conn, [job_id])
        found = records.get(job_id)
        if found is None:  # cannot happen while the row is locked; refuse rather than guess
            raise self._undecided(parameters)
        values = {**parameters, "p_now": now}
        if isinstance(found, LeaseRecordUnreadable):
            raise found
        decided = self._judge(found, now, parameters["p_send_id"] or None)
        if decided is not None:
            return decided
        # the takeover rule of every SQL store (sql_statements._takeover_values)
        generation = max(found.generation + 1, now)
        if found.state is LeaseState.HELD:
            takeovers = found.takeovers + 1
        elif found.state is LeaseState.COMPLETED:
            takeovers = 0
        else:
            takeovers = found.takeovers
        updated = conn.execute(
            self.mysql.takeover,
            {
                **values,
                "p_generation": generation,
                "p_takeovers": takeovers,
                "p_old_generation": found.generation,
            },
        ).rowcount
        if updated != 1:  # cannot happen while the row is locked; refuse rather than guess
            raise self._undecided(parameters)
        return Acquired(job_id, owner, generation, now + ttl_ms, now, takeovers)

    # -- renewals ---------------------------------------------------------------

    def renew(self, conn: Connection, parameters: dict[str, Any]) -> RenewResult:
        request = (
            parameters["p_job_id"],
            parameters["p_owner"],
            parameters["p_generation"],
            parameters["p_ttl_ms"],
        )
        # one job: its unreadable record is an error, as every store raises it
        return self._renew_locked(conn, [request], unreadable_raises=True)[0]

    def renew_many(self, conn: Connection, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """Lock the batch's records, judge each request, renew the current
        ones with one UPDATE per lease time (usually one)."""
        return self._renew_locked(
            conn, [(r.job_id, r.owner, r.generation, ttl_to_ms(r.ttl)) for r in requests]
        )

    def _renew_locked(
        self,
        conn: Connection,
        requests: Sequence[tuple[str, str, int, int]],
        *,
        unreadable_raises: bool = False,
    ) -> list[RenewResult]:
        results: list[RenewResult] = []
        for start in range(0, len(requests), _BATCH_CHUNK):
            chunk = requests[start : start + _BATCH_CHUNK]
            now, records = self._locked(conn, sorted({job_id for job_id, *_ in chunk}))
            renew: dict[int, set[str]] = {}
            for job_id, owner, generation, ttl_ms in chunk:
                record = records.get(job_id)
                if isinstance(record, LeaseRecordUnreadable):
                    if unreadable_raises:
                        raise record
                    # one bad record must not stop the heartbeat of every other lease
                    results.append(unreadable_refusal(job_id, owner, generation))
                elif (
                    record is not None
                    and record.state is LeaseState.HELD
                    and record.owner == owner
                    and record.generation == generation
                ):
                    renew.setdefault(ttl_ms, set()).add(job_id)
                    results.append(Renewed(job_id, generation, now + ttl_ms, now))
                else:
                    results.append(refusal_for(record, job_id, owner, generation))
            for ttl_ms, job_ids in renew.items():
                conn.execute(
                    self.mysql.renew_locked,
                    {"p_now": now, "p_ttl_ms": ttl_ms, "p_job_ids": sorted(job_ids)},
                )
        return results

    # -- one conditional UPDATE each ----------------------------------------------

    def _applied(self, conn: Connection, statement: Any, parameters: dict[str, Any]) -> bool:
        return bool(conn.execute(statement, parameters).rowcount)

    def _held_write(
        self,
        conn: Connection,
        statement: Any,
        parameters: dict[str, Any],
        success: type[_Written],
    ) -> _Written | Refusal:
        """A write on the condition of renew: ``success`` when it applied,
        else the refusal that the record explains."""
        if self._applied(conn, statement, parameters):
            return success(parameters["p_job_id"], parameters["p_generation"])
        return self.refusal(conn, parameters)

    def complete(self, conn: Connection, parameters: dict[str, Any]) -> CompleteResult:
        return self._held_write(conn, self.statements.complete, parameters, Completed)

    def release(self, conn: Connection, parameters: dict[str, Any]) -> ReleaseResult:
        return self._held_write(conn, self.statements.release, parameters, Released)

    def force_release(self, conn: Connection, parameters: dict[str, Any]) -> LeaseRecord | None:
        # the record as the UPDATE left it (our lock), or as it is when the
        # UPDATE passed it by (missing, completed or unreadable)
        self._applied(conn, self.statements.force_release, parameters)
        return self.select_record(conn, parameters["p_job_id"])
