"""The statements of the SQL lease store, each built once per store.

Used by :mod:`celery_leases.stores.sql._store`; ``docs/sql.md`` shows their SQL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.expression import ColumnElement, FromClause

from celery_leases.stores.base import TASK_ID_SEND_PREFIX, LeaseState
from celery_leases.stores.sql._table import SqlDialect

# --- the statements, built once per store ------------------------------------
#
# Building a SQLAlchemy statement, and then its cache key, costs more Python
# than the round trip it makes: rebuilt on every call, a claim spent about
# 600 of its 820 microseconds there. So each operation's statement is built
# once per store, with bind parameters named below, and executed with a
# parameter dict. A statement object keeps its cache key, so every later
# call finds the compiled SQL in the engine's compiled cache at once.
#
# Bind parameters: p_job_id, p_owner, p_generation, p_ttl_ms, p_task_name,
# p_send_id, p_new_send (a send id was given), p_task_id, p_outcome, p_by,
# p_reason; p_batch (the JSON of a renew_many); p_job_ids (expanding); p_older_than_ms.
# The "p_" keeps them apart from the column names, which SQLAlchemy reserves
# in INSERT and UPDATE. The constants (states, counts, NULLs) are written
# into the SQL instead (_const): bound, each would be one more parameter to
# build and convert on every call, and the claim had 21 of them.


def _const(value: str | int | None) -> ColumnElement[Any]:
    """``value`` written into the statement's SQL, not bound."""
    if value is None:
        return sa.null()
    if isinstance(value, int):
        return sa.literal_column(str(value), sa.Integer)
    if "'" in value:
        raise ValueError(f"not a constant this module writes: {value!r}")
    return sa.literal_column(f"'{value}'", sa.String)


_HELD = _const(LeaseState.HELD.value)
_RELEASED = _const(LeaseState.RELEASED.value)
_COMPLETED = _const(LeaseState.COMPLETED.value)


def _held_by_parameters(table: sa.Table) -> ColumnElement[bool]:
    """Held by ``:p_owner`` with ``:p_generation``, for the record of ``:p_job_id``."""
    return held_by(
        table, sa.bindparam("p_job_id"), sa.bindparam("p_owner"), sa.bindparam("p_generation")
    )


def held_by(table: sa.Table, job_id: Any, owner: Any, generation: Any) -> ColumnElement[bool]:
    """The fence: ``owner`` holds ``job_id`` with ``generation`` (values or parameters)."""
    t = table.c
    return sa.and_(
        t.job_id == job_id,
        t.owner == owner,
        t.generation == generation,
        t.state == _HELD,
    )


def _now_row(dialect: SqlDialect) -> FromClause:
    """A one-row subquery ``n(now)``, so a statement reads the clock once."""
    return sa.select(dialect.now_ms().label("now")).subquery("n")


def _now_once(dialect: SqlDialect) -> ColumnElement[int]:
    """The clock as ``(SELECT now FROM n)`` over a CTE, for UPDATEs.

    PostgreSQL evaluates a CTE with a volatile function once, so every use
    in the statement sees the same value (SQLite's 'now' is fixed per
    statement anyway).
    """
    n = sa.select(dialect.now_ms().label("now")).cte("n")
    return sa.select(n.c.now).scalar_subquery()


def _takeable(record: Any, now: Any, send_id: Any) -> ColumnElement[bool]:
    """A claim may take ``record`` over: released, held with a lease that
    ran out by ``now`` (at ``lease_until`` exactly, it has run out), or
    completed by another run than that of a given ``:p_send_id`` (a new
    run): another send id, and not ``task:`` and the completer's task id
    (``LeaseRecord.is_same_run``)."""
    return sa.or_(
        record.state == _RELEASED,
        sa.and_(record.state == _HELD, record.lease_until <= now),
        sa.and_(
            record.state == _COMPLETED,
            sa.bindparam("p_new_send", type_=sa.Boolean),
            record.send_id != send_id,
            sa.or_(
                record.task_id == _const(""),
                send_id != _const(TASK_ID_SEND_PREFIX) + record.task_id,
            ),
        ),
    )


def _takeover_values(
    t: sa.Table, dialect: SqlDialect, now: Any, new: dict[str, Any]
) -> dict[str, Any]:
    """The SET of a takeover at ``now``; ``new`` holds the claim's owner,
    lease_until, task_name, send_id and task_id."""
    return {
        **new,
        "generation": dialect.greatest(t.c.generation + _const(1), now),
        "state": _HELD,
        "claimed_at": now,
        "renewed_at": _const(None),
        "completed_at": _const(None),
        "renew_count": _const(0),
        "takeovers": sa.case(
            (t.c.state == _HELD, t.c.takeovers + _const(1)),
            (t.c.state == _COMPLETED, _const(0)),
            else_=t.c.takeovers,
        ),
        "outcome": _const(None),
        "released_at": _const(None),
        "released_by": _const(""),
        "release_reason": _const(""),
    }


def _claim_statement(table: sa.Table, dialect: SqlDialect) -> Any:
    """INSERT ... SELECT ... ON CONFLICT (job_id) DO UPDATE ... RETURNING.

    A new row gets generation = now. An existing row is taken over only if
    it is released, held with a lease that ran out, or completed by another
    run than that of a given ``:p_send_id`` (a new run); then its
    generation becomes ``max(generation + 1, now)`` and a held one counts as
    a takeover (a new run starts counting again). The clock bound keeps
    generations above every one handed out before when the database lost
    its last commits (``synchronous_commit=off``, a promoted replica). The
    clock is read once, in ``n``; the DO UPDATE reads it back as
    ``excluded.claimed_at``.
    """
    t = table
    n = _now_row(dialect)
    source = (
        sa.select(
            sa.bindparam("p_job_id", type_=sa.String),
            sa.bindparam("p_owner", type_=sa.String),
            n.c.now,
            n.c.now + sa.bindparam("p_ttl_ms", type_=sa.BigInteger),
            _HELD,
            sa.bindparam("p_task_name", type_=sa.String),
            n.c.now,
            _const(0),
            _const(0),
            sa.bindparam("p_send_id", type_=sa.String),
            sa.bindparam("p_task_id", type_=sa.String),
        )
        .select_from(n)
        # SQLite reads "SELECT ... FROM n ON CONFLICT" as a join's ON
        # unless the SELECT has a WHERE
        .where(sa.true())
    )
    insert = dialect.insert(t).from_select(
        [
            "job_id",
            "owner",
            "generation",
            "lease_until",
            "state",
            "task_name",
            "claimed_at",
            "renew_count",
            "takeovers",
            "send_id",
            "task_id",
        ],
        source,
    )
    now = insert.excluded.claimed_at
    new = {
        name: getattr(insert.excluded, name)
        for name in ("owner", "lease_until", "task_name", "send_id", "task_id")
    }
    return insert.on_conflict_do_update(
        index_elements=[t.c.job_id],
        set_=_takeover_values(t, dialect, now, new),
        where=sa.and_(
            _takeable(t.c, now, insert.excluded.send_id),
            dialect.whole(t.c.generation),
            dialect.whole(t.c.lease_until),
        ),
    ).returning(t.c.generation, t.c.lease_until, t.c.claimed_at, t.c.takeovers)


def _decide_statement(table: sa.Table, dialect: SqlDialect) -> Any:
    """After a claim matched nothing: lock the record, then take it over or
    report it, in one statement (PostgreSQL).

    ``old`` reads the record ``FOR UPDATE``: it waits for a writer that
    holds the row and then sees the version that writer committed. ``upd``
    takes that version over if it may be taken; the outer SELECT returns
    the record as ``old`` read it, with the clock, and the takeover's
    columns (NULL when it was not taken)::

        claim (autocommit) -> no row        (held, or it changed meanwhile)
        decide             -> old: the record under our lock
                              upd: taken over if old may be  -> Acquired
                              else old is the answer: HeldElsewhere or
                              AlreadyCompleted
                              no row: the record was purged  -> claim again
    """
    t = table
    n = _now_row(dialect)
    old = (
        sa.select(t, n.c.now)
        .select_from(t)
        .join(n, sa.true())
        .where(t.c.job_id == sa.bindparam("p_job_id", type_=sa.String))
        .with_for_update(of=t)
        .cte("old")
    )
    now = old.c.now
    new = {
        "owner": sa.bindparam("p_owner", type_=sa.String),
        "lease_until": now + sa.bindparam("p_ttl_ms", type_=sa.BigInteger),
        "task_name": sa.bindparam("p_task_name", type_=sa.String),
        "send_id": sa.bindparam("p_send_id", type_=sa.String),
        "task_id": sa.bindparam("p_task_id", type_=sa.String),
    }
    upd = (
        sa.update(t)
        .values(_takeover_values(t, dialect, now, new))
        .where(
            t.c.job_id == old.c.job_id,
            _takeable(old.c, now, new["send_id"]),
        )
        .returning(
            t.c.generation.label("new_generation"),
            t.c.lease_until.label("new_lease_until"),
            t.c.claimed_at.label("new_claimed_at"),
            t.c.takeovers.label("new_takeovers"),
        )
        .cte("upd")
    )
    return sa.select(old, upd).select_from(old.outerjoin(upd, sa.true()))


def _renew_many_statement(table: sa.Table, dialect: SqlDialect) -> Any:
    """One UPDATE ... FROM (the ``:p_batch`` JSON as rows) ... RETURNING."""
    t = table
    now = _now_once(dialect)
    assert dialect.batch_rows is not None, "MySQL renews a batch in module sql_mysql"
    batch = dialect.batch_rows(sa.bindparam("p_batch", type_=sa.String))
    return (
        sa.update(t)
        .values(
            lease_until=now + batch.c.ttl,
            renewed_at=now,
            renew_count=t.c.renew_count + _const(1),
        )
        .where(
            t.c.job_id == batch.c.job_id,
            t.c.owner == batch.c.owner,
            t.c.generation == batch.c.generation,
            # "|| ''" keeps SQLite from driving the join with the state
            # index, which would scan the whole batch once per held row
            t.c.state.concat(_const("")) == _HELD,
        )
        .returning(t.c.job_id, t.c.owner, t.c.generation, t.c.lease_until, t.c.renewed_at)
    )


def _lock_statement(table: sa.Table, dialect: SqlDialect) -> Any:
    """Lock the record of ``:p_job_id`` while ``:p_owner`` holds it with
    ``:p_generation`` and its lease has not run out, as the first statement
    of a caller's transaction; it matches one row or none.

    ``SELECT ... FOR UPDATE`` where the database locks rows that way
    (PostgreSQL, MySQL). SQLite has no row locks: an UPDATE that changes
    nothing takes the database's write lock, which a claim needs too.
    """
    t = table
    current = sa.and_(_held_by_parameters(t), t.c.lease_until > dialect.now_ms())
    if dialect.name == "sqlite":
        return sa.update(t).values(generation=t.c.generation).where(current)
    return sa.select(t.c.generation).where(current).with_for_update()


def _write_statements(t: sa.Table, dialect: SqlDialect, now: Any) -> dict[str, Any]:
    """The conditional UPDATEs, without RETURNING (which MySQL lacks); the
    claim and the batch renewal are MySQL's own (module sql_mysql)."""
    return {
        "claim": None,
        "decide": None,
        "renew": (
            sa.update(t)
            .values(
                lease_until=now + sa.bindparam("p_ttl_ms", type_=sa.BigInteger),
                renewed_at=now,
                renew_count=t.c.renew_count + _const(1),
            )
            .where(_held_by_parameters(t))
        ),
        "renew_many": None,
        "complete": (
            sa.update(t)
            .values(
                state=_COMPLETED,
                completed_at=dialect.now_ms(),
                outcome=sa.bindparam("p_outcome", type_=sa.LargeBinary),
            )
            .where(_held_by_parameters(t))
        ),
        "release": (
            sa.update(t)
            .values(
                state=_RELEASED,
                owner=_const(""),
                lease_until=now,
                released_at=now,
            )
            .where(_held_by_parameters(t))
        ),
        "force_release": (
            sa.update(t)
            .values(
                generation=t.c.generation + _const(1),
                state=_RELEASED,
                owner=_const(""),
                lease_until=now,
                released_at=now,
                released_by=sa.bindparam("p_by", type_=sa.String),
                release_reason=sa.bindparam("p_reason", type_=sa.String),
            )
            .where(
                t.c.job_id == sa.bindparam("p_job_id"),
                t.c.state.in_([_HELD, _RELEASED]),
                dialect.whole(t.c.generation),
            )
        ),
    }


@dataclass(frozen=True)
class Statements:
    """Every statement of a store's hot path, built once (see above).

    In MySQL ``claim``, ``decide`` and ``renew_many`` are None, and the
    writes have no RETURNING (module sql_mysql runs them).
    """

    #: the claim; RETURNING generation, lease_until, claimed_at, takeovers
    claim: Any
    #: the record of ``:p_job_id`` and the clock, after a claim matched nothing
    holder: Any
    #: PostgreSQL: lock the record, take it over or report it (None in SQLite)
    decide: Any
    renew: Any
    renew_many: Any
    complete: Any
    #: lock a current lease in a caller's transaction (see _lock_statement)
    lock: Any
    release: Any
    #: an operator's release; RETURNING the whole record
    force_release: Any
    #: the record of ``:p_job_id``
    record: Any
    #: the records of ``:p_job_ids``
    records_of: Any
    now: Any
    purge: Any

    @classmethod
    def build(cls, table: sa.Table, dialect: SqlDialect) -> Statements:
        """Build every statement for ``table`` in ``dialect``."""
        t = table
        n = _now_row(dialect)
        # MySQL's clock is the statement's start, the same for each use in it
        renew_now = dialect.now_ms() if dialect.name == "mysql" else _now_once(dialect)
        # one clock reading for the purge (an InitPlan in PostgreSQL)
        purge_now = sa.select(dialect.now_ms()).scalar_subquery()
        purge_before = purge_now - sa.bindparam("p_older_than_ms", type_=sa.BigInteger)
        writes = _write_statements(t, dialect, renew_now)
        if dialect.name != "mysql":
            writes = {
                "claim": _claim_statement(t, dialect),
                "decide": _decide_statement(t, dialect) if dialect.name == "postgresql" else None,
                "renew": writes["renew"].returning(t.c.lease_until, t.c.renewed_at),
                "renew_many": _renew_many_statement(t, dialect),
                "complete": writes["complete"].returning(t.c.job_id),
                "release": writes["release"].returning(t.c.job_id),
                "force_release": writes["force_release"].returning(*t.c),
            }
        return cls(
            **writes,
            holder=(
                sa.select(t, n.c.now)
                .select_from(t)
                .join(n, sa.true())
                .where(t.c.job_id == sa.bindparam("p_job_id"))
            ),
            lock=_lock_statement(t, dialect),
            record=sa.select(t).where(t.c.job_id == sa.bindparam("p_job_id")),
            records_of=sa.select(t).where(
                t.c.job_id.in_(sa.bindparam("p_job_ids", expanding=True))
            ),
            now=sa.select(dialect.now_ms()),
            purge=sa.delete(t).where(
                sa.or_(
                    sa.and_(
                        t.c.state == _COMPLETED,
                        t.c.completed_at <= purge_before,
                    ),
                    sa.and_(
                        t.c.state == _RELEASED,
                        # released before released_at existed: the lease
                        # ended at the release
                        sa.func.coalesce(t.c.released_at, t.c.lease_until) <= purge_before,
                    ),
                ),
                dialect.whole(t.c.generation),
            ),
        )
