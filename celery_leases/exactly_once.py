"""Exactly-once database effects: the task's writes and its completion in one commit.

When the lease store is an ``SqlStore`` and the task's tables live in the
same database, :func:`exactly_once` opens one short transaction that locks
the lease record, runs the task's writes and ends with the fenced
completion, which keeps the run's outcome; it commits once::

    @app.task(base=LeasedTask, bind=True)
    def bill(self, order_id):
        total = price(order_id)                  # minutes, outside any transaction
        with exactly_once(self, session) as tx:  # BEGIN; lock the lease record
            session.add(Invoice(order_id=order_id, total=total))
            return tx.complete({"total": total}) # completion written; COMMIT on exit

What a crash, a stall or a redelivery can do to it::

    killed before COMMIT     nothing committed: the next generation runs the body
    taken over before BEGIN  the lock matches nothing: LeaseLost, rolled back
    claim during the block   waits for the record's lock, then finds it completed
    killed after COMMIT      the redelivery finds the job completed and answers
                             with the kept outcome; the body does not run again

The library's own completion after the body then only stores the result.
Anything outside the transaction (HTTP calls, other databases) is not
covered: fence those as before.

While the block holds the record's lock, a renewal from the store's own
connection would only wait for it; so the heartbeat renews the lease in the
block's transaction instead, between the task's statements
(:class:`BlockRenewal`), and a block may last longer than the lease. The
database ends the transaction once it has been idle for the lease's time
(PostgreSQL, MySQL, MariaDB), so a paused process holds the lock no longer
than its lease; SQLite cannot end it::

    task thread     BEGIN lock ── insert ─────────── insert ── complete COMMIT
    renewal thread             renew (same transaction)   renew
    (every statement on the connection takes turns with the renewals)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from celery_leases import unpatched
from celery_leases.errors import LeaseConfigurationError, LeaseError, LeaseLost, StoreUnavailable
from celery_leases.fencing.sql_once import (
    IdleLimit,
    OnceStore,
    complete_in_transaction,
    lock_in_transaction,
    renew_in_transaction,
)
from celery_leases.lease import Lease
from celery_leases.outcome import encode_value
from celery_leases.run_steps import outcome_options
from celery_leases.stores.base import Refusal, RenewRequest, RenewResult
from celery_leases.stores.deadline import time_left
from celery_leases.stores.sql import permanent, reason, refused_for_good

__all__ = ["BlockRenewal", "Bind", "ExactlyOnce", "exactly_once"]

T = TypeVar("T")

#: where the transaction runs: an engine (a connection is opened and closed),
#: a connection or an ORM session, none of them inside a transaction
Bind = Engine | Connection | Session

_UNSET: Any = object()

#: the shortest wait for the connection between two checks of the lease (seconds)
_MIN_WAIT = 0.01

#: what makes a transaction's other statements (those not run on its
#: SQLAlchemy connection, such as Django's ORM) take turns with the
#: renewals: given the context in which one statement must run, a context
#: manager that applies it to each of them for the block
StatementTurns = Callable[
    [Callable[[], contextlib.AbstractContextManager[None]]],
    contextlib.AbstractContextManager[None],
]


class ExactlyOnce:
    """The open transaction of :func:`exactly_once`.

    Attributes:
        connection: the transaction's connection (the session's, for a session).
        session: the session, when one was given.
        lease: the run's lease.
    """

    def __init__(self, connection: Connection, session: Session | None, lease: Lease) -> None:
        self.connection = connection
        self.session = session
        self.lease = lease
        self._value: Any = _UNSET

    def complete(self, value: T) -> T:
        """Name the run's result; it is kept with the completion at the commit.

        Return it from the task (``return tx.complete(value)``): a
        redelivery after the commit answers with this value.

        Returns:
            ``value``.
        """
        self._value = value
        return value

    @property
    def completing(self) -> bool:
        """Whether :meth:`complete` was called."""
        return self._value is not _UNSET


@contextlib.contextmanager
def exactly_once(task: Any, bind: Bind) -> Iterator[ExactlyOnce]:
    """One transaction holding the task's writes and its fenced completion.

    Call it in the body of a ``LeasedTask`` whose lease store is an
    ``SqlStore``, with an engine, connection or session on that store's
    database. Make the writes inside the block and call ``tx.complete(value)``;
    leaving the block commits both, once. Keep the block short: the record
    stays locked until the commit, and a claim of this job waits for it
    (the heartbeat renews the lease in the block's transaction meanwhile).

    Args:
        task: the running task (``self``).
        bind: an ``Engine``, ``Connection`` or ``Session`` on the lease
            store's database, not inside a transaction.

    Yields:
        The :class:`ExactlyOnce` transaction.

    Raises:
        LeaseLost: the lease is not current (lost locally, or taken over,
            released or run out by the database's clock), or the database
            failed before the commit, also while connecting as the block
            opens (a lost or refused connection, a timeout: ``reason``
            ``"unavailable"``); nothing was committed, and the run ends
            fenced out and its message is published again.
        LeaseConfigurationError: the lease store is not SQL, ``bind`` is on
            another database, already in a transaction, its role has no
            rights on the lease table, a session wrote through a second
            connection (``binds=``), ``retry()`` or ``replace()`` was called
            inside the block, or the block ended without ``tx.complete()``;
            nothing was committed.
        LeaseError: the run already completed in such a transaction.

    A failure that trying again cannot cure (credentials, rights, a
    constraint, a bad statement) passes through as the task's own error.
    """
    with run_once(task, _opened(bind), failures=(exc.OperationalError,)) as tx:
        yield tx


class OpenTransaction(NamedTuple):
    """A transaction :func:`run_once` completes in: its connection, the session
    (if any), and how to commit and roll it back. ``before_complete`` runs
    after the body, before the completion (a session's flush; a check that
    the transaction can still commit)."""

    connection: Connection
    session: Session | None
    commit: Callable[[], None]
    rollback: Callable[[], None]
    before_complete: Callable[[], None]


@contextlib.contextmanager
def run_once(
    task: Any,
    opened: contextlib.AbstractContextManager[OpenTransaction],
    *,
    failures: tuple[type[BaseException], ...],
    other_statements: StatementTurns | None = None,
) -> Iterator[ExactlyOnce]:
    """The mechanism of :func:`exactly_once` in the transaction ``opened`` gives.

    The lease is checked before ``opened`` is entered, the record locked as
    the transaction's first statement and completed as its last; a failure
    of one of ``failures`` (the database's: a lost connection, a timeout)
    from entering ``opened`` until the commit makes the lease lost with
    ``reason`` ``"unavailable"``, unless it is a refusal for good (rights,
    credentials), which passes through.
    In between the lease is renewed in the transaction (:class:`BlockRenewal`);
    ``other_statements`` makes the statements that do not run on the
    transaction's SQLAlchemy connection take turns with those renewals.
    """
    lease: Lease = task.lease
    store = _sql_store(lease)
    _one_block(lease)
    lease.check()
    with _open(lease, opened, failures) as (connection, session, commit, rollback, before_complete):
        renewal: BlockRenewal | None = None
        try:
            _fenced(lease, lock_in_transaction, connection, store)
            renewal = BlockRenewal(lease, store, connection, other_statements)
            tx = ExactlyOnce(connection, session, lease)
            yield tx
            if not tx.completing:
                raise LeaseConfigurationError(
                    f"the exactly_once block of job {lease.job_id!r} ended without "
                    "tx.complete(value); it was rolled back. Name the run's result inside "
                    "the block: return tx.complete(value)",
                    job_id=lease.job_id,
                    generation=lease.generation,
                )
            before_complete()
            lease.check()
            outcome = encode_value(tx._value, **outcome_options(task))
            _fenced(lease, complete_in_transaction, connection, store, outcome)
            renewal.end(committing=True)
        except failures as error:
            # a lost connection, a timeout, a lock not granted: nothing was
            # committed, so the job runs again (a constraint, a bad
            # statement or missing rights are the task's own error and pass
            # through: running again would meet them again)
            _end_renewal(renewal)
            _roll_back(rollback)
            if not _outage(error):
                raise
            raise _unavailable(
                lease,
                f"the transaction of job {lease.job_id!r} (generation {lease.generation}) "
                f"failed: {getattr(error, 'orig', None) or error}; it was rolled back, "
                "nothing was written",
            ) from error
        except BaseException:
            _end_renewal(renewal)
            _roll_back(rollback)
            raise
        try:
            commit()
        except failures as error:
            # the reply may be lost after the server committed: ask the record
            _settle_commit(lease, error)
    lease.finish()
    lease.completed_in_transaction = True


def _one_block(lease: Lease) -> None:
    """Refuse a second block in a run: after the first committed, or inside
    it (its lock would wait for the one the open block holds, while the
    heartbeat keeps renewing the lease in that block)."""
    if lease.completed_in_transaction:
        error: type[LeaseError] = LeaseError
        detail = "was already completed in a transaction by this run; a run completes once"
    elif lease.in_transaction:
        error = LeaseConfigurationError
        detail = (
            "opened exactly_once inside its exactly_once block; a run has one block: make "
            "all its writes in it"
        )
    else:
        return
    raise error(
        f"job {lease.job_id!r} (generation {lease.generation}) {detail}",
        job_id=lease.job_id,
        generation=lease.generation,
    )


@contextlib.contextmanager
def _open(
    lease: Lease,
    opened: contextlib.AbstractContextManager[OpenTransaction],
    failures: tuple[type[BaseException], ...],
) -> Iterator[OpenTransaction]:
    """Enter ``opened``; the lease reads as in a transaction until it is left.

    Opening connects (an engine's new connection, a session's first one, a
    pool's pre-ping and its reconnect, Django's ``ensure_connection``) and
    begins: an outage there is one of the transaction's, and the job runs
    again, as for a failure inside the block.

    Raises:
        LeaseLost: the database failed to open the transaction (reason
            ``"unavailable"``); nothing was begun.
    """
    with contextlib.ExitStack() as stack:
        try:
            transaction = stack.enter_context(opened)
        except failures as error:
            if not _outage(error):
                raise  # credentials, a database that does not exist: not an outage
            raise _unavailable(
                lease,
                f"the transaction of job {lease.job_id!r} (generation {lease.generation}) "
                f"could not begin: {reason(error)}; nothing was written",
            ) from error
        lease.in_transaction = True
        try:
            yield transaction
        finally:
            lease.in_transaction = False


def _outage(error: BaseException) -> bool:
    """Whether a database failure is an outage that trying again can cure (a
    lost or refused connection, a timeout), not a refusal for good (credentials,
    rights), judged as the SQL lease store judges its own."""
    if isinstance(error, exc.DBAPIError):
        return not permanent(error)
    # a framework's class around the driver's error (Django's OperationalError)
    cause = error.__cause__
    return cause is None or not refused_for_good(cause)


class BlockRenewal:
    """Renews a lease in the transaction of its ``exactly_once`` block.

    From the lock to the end of the block the heartbeat renews the lease
    here (``lease.renewer``), with the store's renew statement on the
    block's own connection: the record is locked by that transaction, and a
    renewal from any other connection would wait for the lock until the
    lease ran out. The renewals take turns with the task's statements on
    the connection (a driver connection serves one statement at a time),
    and each one sets the transaction's idle limit (:class:`IdleLimit`) to
    the lease's time again. A renewal in the transaction commits with the
    completion, or is undone with a rollback, and then so is its effect on
    the lease (:meth:`Lease.void_renewals`).

    Under gevent or eventlet the connection belongs to the hub, which the
    heartbeat's OS threads must not touch: the lease is not renewed during
    the block there, and the block must end within the lease.
    """

    def __init__(
        self,
        lease: Lease,
        store: OnceStore,
        connection: Connection,
        other_statements: StatementTurns | None,
    ) -> None:
        self._lease = lease
        self._store = store
        self._connection = connection
        self._deadline = lease.deadline
        self._lease_until_ms = lease.lease_until_ms
        self._turn = unpatched.lock()
        self._task_thread = threading.get_ident()
        self._task_has_turn = False
        self._ended = False
        self._idle = IdleLimit(connection, store.dialect_name)
        self._watching = contextlib.ExitStack()
        try:
            # the lease's whole ttl, as each renewal sets it, not what is
            # left of it: a savepoint rolled back sets PostgreSQL's limit
            # back to this one, while the lease keeps the renewal's time
            self._idle.set(lease.timing.ttl)
        except StoreUnavailable as error:
            raise _unavailable(lease, str(error)) from error
        if unpatched.green_library() is not None:
            return
        with self._watching as watching:
            event.listen(connection, "before_cursor_execute", self._before_statement)
            event.listen(connection, "after_cursor_execute", self._after_statement)
            watching.callback(self._stop_listening)
            if other_statements is not None:
                watching.enter_context(other_statements(self._statement_turn))
            self._watching = watching.pop_all()
        lease.renewer = self

    # -- the task's thread ---------------------------------------------------

    def _take_turn(self) -> bool:
        """Wait for a renewal on the connection to end; False if the task has the turn."""
        if threading.get_ident() != self._task_thread or self._task_has_turn:
            return False
        while not self._turn.acquire(timeout=max(self._lease.remaining(), _MIN_WAIT)):
            self._lease.check()  # a renewal that hangs past the deadline
        self._task_has_turn = True
        return True

    def _give_turn(self) -> None:
        if threading.get_ident() == self._task_thread and self._task_has_turn:
            self._task_has_turn = False
            self._turn.release()

    def _before_statement(self, *_: Any) -> None:
        self._take_turn()

    def _after_statement(self, *_: Any) -> None:
        # a statement that fails gets no "after" event (SQLAlchemy has no
        # per-connection error event): the task keeps the turn until its
        # next statement ends, or the block does
        self._give_turn()

    @contextlib.contextmanager
    def _statement_turn(self) -> Iterator[None]:
        taken = self._take_turn()
        try:
            yield
        finally:
            if taken:
                self._give_turn()

    def _stop_listening(self) -> None:
        event.remove(self._connection, "before_cursor_execute", self._before_statement)
        event.remove(self._connection, "after_cursor_execute", self._after_statement)

    def end(self, *, committing: bool) -> None:
        """The block ends: renewals go to the store again; before a rollback
        the renewals made in the transaction are voided.

        Raises:
            LeaseLost: committing, and a session-wide idle limit could not
                be set back (``reason`` ``"unavailable"``).
        """
        if self._ended:
            return
        lease = self._lease
        # wait for a renewal on the connection, but not past the deadline:
        # one that hangs there is left to the connection's own timeouts
        taken = self._task_has_turn or self._turn.acquire(timeout=max(lease.remaining(), _MIN_WAIT))
        self._ended = True
        lease.renewer = lease.store
        if taken:
            self._task_has_turn = False
            self._turn.release()
        self._watching.close()
        if not committing:
            lease.void_renewals(self._deadline, self._lease_until_ms)
            with contextlib.suppress(StoreUnavailable):
                self._idle.restore()
            return
        try:
            self._idle.restore()
        except StoreUnavailable as error:
            raise _unavailable(lease, str(error)) from error

    # -- the heartbeat's renewal thread ----------------------------------------

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewResult]:
        """Renew in the block's transaction, or in the store once the block ended.

        Raises:
            StoreUnavailable: the task's statement held the connection until
                the caller's deadline, or the renewal statement failed.
        """
        left = time_left()
        if not self._turn.acquire(timeout=-1 if left is None else left):
            raise StoreUnavailable(
                f"the transaction of job {self._lease.job_id!r} was running a statement of "
                "the task until the lease's deadline; no renewal could be sent on it",
                job_id=self._lease.job_id,
            )
        try:
            if not self._ended:
                results = [
                    renew_in_transaction(
                        self._connection, self._store, r.job_id, r.owner, r.generation, r.ttl
                    )
                    for r in requests
                ]
                self._idle.set(max(r.ttl for r in requests))
                return results
        except (StoreUnavailable, exc.SQLAlchemyError) as error:
            # The transaction failed (its session ended, a statement of the
            # task aborted it): its lock and its renewals are gone, and the
            # next generation may claim once the committed lease runs out.
            # The lease keeps only that time, not what the renewals gave it.
            self._lease.void_renewals(self._deadline, self._lease_until_ms)
            if isinstance(error, StoreUnavailable):
                raise
            raise StoreUnavailable(
                f"the transaction of job {self._lease.job_id!r} cannot renew its lease: {error}",
                job_id=self._lease.job_id,
            ) from error
        finally:
            self._turn.release()
        return self._lease.store.renew_many(requests)


def _end_renewal(renewal: BlockRenewal | None) -> None:
    if renewal is not None:
        with contextlib.suppress(LeaseLost):
            renewal.end(committing=False)


def _roll_back(rollback: Callable[[], None]) -> None:
    # on a dead connection the rollback fails too; the error that broke the
    # transaction is the one to raise, and the server rolls back on its own
    with contextlib.suppress(exc.SQLAlchemyError):
        rollback()


def _sql_store(lease: Lease) -> OnceStore:
    store: Any = lease.store
    if not (
        callable(getattr(store, "lock_in", None)) and callable(getattr(store, "complete_in", None))
    ):
        raise LeaseConfigurationError(
            f"exactly_once needs an SQL lease store (SqlStore), not {type(store).__name__}: "
            "the completion can only commit with your writes in the lease store's database",
            job_id=lease.job_id,
        )
    return store  # type: ignore[no-any-return]


def _fenced(
    lease: Lease,
    step: Callable[..., None],
    connection: Connection,
    store: OnceStore,
    *outcome: bytes | None,
) -> None:
    """Run a statement of the lease; a refusal or a failure makes the lease lost."""
    try:
        step(connection, store, lease.job_id, lease.owner, lease.generation, *outcome)
    except LeaseLost as lost:
        lease.mark_lost(lost)
        raise
    except StoreUnavailable as error:
        raise _unavailable(lease, str(error)) from error


def _unavailable(lease: Lease, detail: str) -> LeaseLost:
    """The lease reads as lost after a failed transaction, so the run is
    fenced out and its message published again (the store stays the judge
    of whether the job completed)."""
    lost = LeaseLost(
        detail, job_id=lease.job_id, owner=lease.owner, generation=lease.generation,
        reason="unavailable",
    )  # fmt: skip
    lease.mark_lost(lost)
    return lost


def _settle_commit(lease: Lease, error: BaseException) -> None:
    """The COMMIT failed: judge by the record whether it was applied.

    A release answers it (protocol duty 6): refused because this very run
    completed the job, the commit went through; released, it did not. The
    release waits for the record's lock if the transaction is still
    committing on the server.

    Raises:
        LeaseLost: not committed, or unknown (reason ``"unavailable"``).
    """
    detail = (
        f"the commit of job {lease.job_id!r} (generation {lease.generation}) failed: "
        f"{getattr(error, 'orig', None) or error}"
    )
    try:
        result = lease.store.release(lease.job_id, lease.owner, lease.generation)
    except StoreUnavailable:
        raise _unavailable(lease, f"{detail}; whether it committed is unknown") from error
    if isinstance(result, Refusal) and lease.is_own_completion(result):
        return
    raise _unavailable(lease, f"{detail}; nothing was committed") from error


def _nothing() -> None:
    pass


@contextlib.contextmanager
def _opened(bind: Bind) -> Iterator[OpenTransaction]:
    """The connection of a new transaction on ``bind``, with its commit and rollback."""
    if isinstance(bind, Session):
        _not_in_transaction(bind.in_transaction(), "session")
        bind.begin()
        try:
            connection = bind.connection()  # connects: may fail
        except BaseException:
            _roll_back(bind.rollback)  # the session stays usable, outside a transaction
            raise
        with _one_connection(bind, connection) as check:

            def before_complete() -> None:
                bind.flush()
                check()

            yield OpenTransaction(connection, bind, bind.commit, bind.rollback, before_complete)
    elif isinstance(bind, Connection):
        _not_in_transaction(bind.in_transaction(), "connection")
        transaction = bind.begin()
        yield OpenTransaction(bind, None, transaction.commit, transaction.rollback, _nothing)
    elif isinstance(bind, Engine):
        with bind.connect() as connection:
            transaction = connection.begin()
            yield OpenTransaction(
                connection, None, transaction.commit, transaction.rollback, _nothing
            )
    else:
        raise LeaseConfigurationError(
            f"exactly_once needs a SQLAlchemy Engine, Connection or Session, not "
            f"{type(bind).__name__}"
        )


@contextlib.contextmanager
def _one_connection(session: Session, connection: Connection) -> Iterator[Callable[[], None]]:
    """Watch the connections ``session`` begins in the block: one that is not
    ``connection``, the lock's, is refused as it begins, and again by the
    check made after the block's flush (for code that caught the first).

    A session whose ``binds=`` send some classes or tables to another engine
    writes them on a connection of their own, which commits apart from the
    completion (and may fail alone): refused before anything commits, also
    when the write comes from a ``before_commit`` hook, flushed by the commit
    itself after the check (the refusal then fails the commit's flush).

    Raises:
        LeaseConfigurationError: another connection was begun, or was used.
    """
    others: list[Connection] = []

    def begun(_session: Session, _transaction: Any, begun_connection: Connection) -> None:
        if begun_connection is not connection:
            others.append(begun_connection)
            check()

    def check() -> None:
        if others:
            other = others[0].engine.url.render_as_string(hide_password=True)
            raise LeaseConfigurationError(
                f"the session given to exactly_once used a second connection, to {other}, "
                "besides the one that locks the lease record (a bind of its binds=): its "
                "writes there would commit apart from the completion. Give the block a "
                "session with one bind, on the lease store's database; the transaction was "
                "rolled back, nothing was written"
            )

    event.listen(session, "after_begin", begun)
    try:
        yield check
    finally:
        event.remove(session, "after_begin", begun)


def _not_in_transaction(inside: bool, what: str) -> None:
    if inside:
        raise LeaseConfigurationError(
            f"exactly_once needs a {what} outside any transaction: commit or roll back "
            "first. Its transaction is the one that completes the job, and it must not "
            "have been open across the task's long work"
        )
