"""The SQL lease store's operations, each on one open connection.

Used by :mod:`celery_leases.stores.sql._store`, which opens the connection (and its
transaction), bounds its waits and wraps driver errors. Each function runs
the statements of :mod:`celery_leases.stores.sql._statements` and turns their
rows into results.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection, RowMapping

from celery_leases.errors import LeaseRecordUnreadable, StoreUnavailable
from celery_leases.stores.base import (
    Acquired,
    AlreadyCompleted,
    ClaimResult,
    Completed,
    CompleteResult,
    HeldElsewhere,
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
from celery_leases.stores.sql._statements import Statements
from celery_leases.stores.sql._table import record_of

#: claim attempts. Each decides under the record's lock, so a second is made
#: only when the record was purged, or its lease ran out, in between
CLAIM_ATTEMPTS = 3


class Operations:
    """The operations on one store's table (``where`` names it in messages)."""

    def __init__(self, statements: Statements, where: str) -> None:
        self.statements = statements
        self.where = where

    def record(self, row: RowMapping) -> LeaseRecord:
        """The record in ``row``; LeaseRecordUnreadable if it cannot be read."""
        return record_of(row, self.where)

    def readable(self, row: RowMapping) -> LeaseRecord | LeaseRecordUnreadable:
        """The record in ``row``, or the error that says why it cannot be read."""
        try:
            return self.record(row)
        except LeaseRecordUnreadable as error:
            return error

    def select_record(self, conn: Connection, job_id: str) -> LeaseRecord | None:
        row = conn.execute(self.statements.record, {"p_job_id": job_id}).first()
        return None if row is None else self.record(row._mapping)

    def select_records(
        self, conn: Connection, job_ids: Sequence[str]
    ) -> dict[str, LeaseRecord | LeaseRecordUnreadable]:
        """The records of ``job_ids`` (in chunks, to stay under bind limits);
        an error in place of each one that cannot be read."""
        found: dict[str, LeaseRecord | LeaseRecordUnreadable] = {}
        for start in range(0, len(job_ids), 1000):
            chunk = list(job_ids[start : start + 1000])
            for row in conn.execute(self.statements.records_of, {"p_job_ids": chunk}):
                found[row.job_id] = self.readable(row._mapping)
        return found

    def try_claim(self, conn: Connection, parameters: dict[str, Any]) -> Acquired | None:
        """The claim statement alone: Acquired, or None when it matched nothing."""
        row = conn.execute(self.statements.claim, parameters).first()
        return (
            None if row is None else Acquired(parameters["p_job_id"], parameters["p_owner"], *row)
        )

    def claim_in_transaction(
        self, conn: Connection, parameters: dict[str, Any], send_id: str | None
    ) -> ClaimResult:
        """SQLite: claim, and read the record when the claim matched nothing,
        in one transaction that holds the write lock: the record read is the
        one the claim judged, unless its lease ran out in between (then the
        next claim takes it)."""
        job_id = parameters["p_job_id"]
        for _ in range(CLAIM_ATTEMPTS):
            acquired = self.try_claim(conn, parameters)
            if acquired is not None:
                return acquired
            found = conn.execute(self.statements.holder, {"p_job_id": job_id}).first()
            if found is not None:
                decided = self._judge(self.record(found._mapping), int(found.now), send_id)
                if decided is not None:
                    return decided
        raise self._undecided(parameters)

    def claim_locking(self, conn: Connection, parameters: dict[str, Any]) -> ClaimResult:
        """PostgreSQL: the claim, then (when it matched nothing) the decide
        statement, which locks the record and takes it over or reports it.
        Claimed again only if the record was purged in between."""
        job_id, owner = parameters["p_job_id"], parameters["p_owner"]
        for _ in range(CLAIM_ATTEMPTS):
            acquired = self.try_claim(conn, parameters)
            if acquired is not None:
                return acquired
            row = conn.execute(self.statements.decide, parameters).first()
            if row is None:
                continue  # purged since the claim: claim again
            if row.new_generation is not None:
                return Acquired(
                    job_id,
                    owner,
                    row.new_generation,
                    row.new_lease_until,
                    row.new_claimed_at,
                    row.new_takeovers,
                )
            holder = self.record(row._mapping)
            decided = self._judge(holder, int(row.now), parameters["p_send_id"] or None)
            if decided is not None:
                return decided
        raise self._undecided(parameters)

    @staticmethod
    def _judge(holder: LeaseRecord, now: int, send_id: str | None) -> ClaimResult | None:
        """The answer to a claim that did not take ``holder``; None when the
        record may be taken after all (its lease ran out since the claim)."""
        if holder.state is LeaseState.COMPLETED:
            if not holder.is_same_run(send_id):
                return None
            return AlreadyCompleted(
                holder.job_id, holder.generation, holder.send_id, holder.outcome
            )
        if holder.is_live(now):
            remaining = (holder.lease_until_ms - now) / 1000
            return HeldElsewhere(holder.job_id, holder.owner, holder.generation, remaining)
        return None

    def _undecided(self, parameters: dict[str, Any]) -> StoreUnavailable:
        job_id = parameters["p_job_id"]
        return StoreUnavailable(
            f"SQL lease store {self.where}: the record of job {job_id!r} changed during "
            f"each of {CLAIM_ATTEMPTS} claim attempts; no lease was given",
            job_id=job_id,
            owner=parameters["p_owner"],
        )

    def renew(self, conn: Connection, parameters: dict[str, Any]) -> RenewResult:
        row = conn.execute(self.statements.renew, parameters).first()
        if row is None:
            return self.refusal(conn, parameters)
        return Renewed(
            parameters["p_job_id"], parameters["p_generation"], row.lease_until, row.renewed_at
        )

    def renew_many(self, conn: Connection, requests: Sequence[RenewRequest]) -> list[RenewResult]:
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
        renewed = {
            (row.job_id, row.owner, row.generation): Renewed(
                row.job_id, row.generation, row.lease_until, row.renewed_at
            )
            for row in conn.execute(self.statements.renew_many, {"p_batch": batch_json})
        }
        refused = sorted(
            {r.job_id for r in requests if (r.job_id, r.owner, r.generation) not in renewed}
        )
        current = self.select_records(conn, refused)
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

    def complete(self, conn: Connection, parameters: dict[str, Any]) -> CompleteResult:
        if conn.execute(self.statements.complete, parameters).first() is None:
            return self.refusal(conn, parameters)
        return Completed(parameters["p_job_id"], parameters["p_generation"])

    def refusal(self, conn: Connection, parameters: dict[str, Any]) -> Refusal:
        """Why the fenced write of ``parameters`` matched nothing, from the record."""
        job_id, owner = parameters["p_job_id"], parameters["p_owner"]
        record = self.select_record(conn, job_id)
        return refusal_for(record, job_id, owner, parameters["p_generation"])

    def lock(self, conn: Connection, parameters: dict[str, Any]) -> bool:
        """Lock a current lease in ``conn``'s transaction; whether it matched."""
        result = conn.execute(self.statements.lock, parameters)
        if result.returns_rows:
            return result.first() is not None
        return bool(result.rowcount == 1)

    def release(self, conn: Connection, parameters: dict[str, Any]) -> ReleaseResult:
        if conn.execute(self.statements.release, parameters).first() is None:
            return self.refusal(conn, parameters)
        return Released(parameters["p_job_id"], parameters["p_generation"])

    def force_release(self, conn: Connection, parameters: dict[str, Any]) -> LeaseRecord | None:
        row = conn.execute(self.statements.force_release, parameters).first()
        if row is not None:
            return self.record(row._mapping)
        # missing, completed (left as it is) or unreadable
        return self.select_record(conn, parameters["p_job_id"])

    def purge(self, conn: Connection, older_than_ms: int) -> int:
        result = conn.execute(self.statements.purge, {"p_older_than_ms": older_than_ms})
        return int(result.rowcount)
