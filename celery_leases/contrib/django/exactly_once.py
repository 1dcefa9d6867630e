"""Exactly-once ORM writes: the task's writes and its completion in one ``atomic()``.

The ORM form of :mod:`celery_leases.exactly_once`: :func:`exactly_once`
opens ``transaction.atomic(using=alias)`` on Django's own connection, locks
the lease record as its first statement and ends with the fenced completion
as its last, so the ORM writes of the block and the completion commit
together, once::

    @shared_task(base=LeasedTask, bind=True)
    def ship(self, order_id):
        with exactly_once(self) as tx:             # atomic(); lock the lease record
            Shipment.objects.create(order_id=order_id)
            return tx.complete(order_id)           # completion written; COMMIT on exit

The two statements are the store's own (:mod:`celery_leases.fencing.sql_once`),
run through SQLAlchemy on Django's DB-API connection, which is lent for
the block: SQLAlchemy never commits, rolls back or closes it; Django's
``atomic()`` does. The ORM's statements take turns with the lease's
renewals in the block's transaction through Django's
``connection.execute_wrapper()``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from django.db import DatabaseError, connections, transaction
from django.db import OperationalError as DjangoOperationalError
from sqlalchemy import exc
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from celery_leases.contrib.django.store import connection_arguments
from celery_leases.errors import LeaseConfigurationError
from celery_leases.exactly_once import ExactlyOnce, OpenTransaction, StatementTurns, run_once
from celery_leases.stores.sql import dialect_named

__all__ = ["exactly_once"]

#: the database failing under the block: the lease is lost, the job runs again
_FAILURES = (exc.OperationalError, DjangoOperationalError)


@contextlib.contextmanager
def exactly_once(task: Any, using: str = "default") -> Iterator[ExactlyOnce]:
    """One ``transaction.atomic(using=using)`` holding the ORM writes and the completion.

    Call it in the body of a ``LeasedTask`` whose lease store is on the
    database of ``using`` (``CELERY_LEASES_STORE = "django://<alias>"``, or a
    URL of the same database), outside any ``atomic()`` block. Make the
    writes inside the block (on ``using``) and call ``tx.complete(value)``;
    leaving the block commits both. Keep the block short: the lease record
    stays locked until the commit (the lease is renewed in the block's
    transaction meanwhile). ``atomic()`` blocks inside it are savepoints of
    its transaction.

    Args:
        task: the running task (``self``).
        using: the ``DATABASES`` alias of the writes and of the lease store.

    Yields:
        The :class:`~celery_leases.exactly_once.ExactlyOnce` transaction;
        its ``connection`` is a SQLAlchemy connection on the same transaction.

    Raises:
        LeaseLost: the lease is not current, or the database failed before
            the commit; nothing was committed, and the run ends fenced out.
        LeaseConfigurationError: the lease store is not on the database of
            ``using``, the block is inside an ``atomic()`` block or the alias
            does not commit on its own (``AUTOCOMMIT`` off), the block was
            marked for rollback, or it ended without ``tx.complete()``;
            nothing was committed.
    """
    with run_once(
        task, _atomic(task, using), failures=_FAILURES, other_statements=_orm_statements(using)
    ) as tx:
        yield tx


def _orm_statements(using: str) -> StatementTurns:
    """Run each of Django's statements on ``using`` in the turn it is given,
    for the block (``execute_wrapper``, Django's hook around every query)."""

    def install(
        turn: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> contextlib.AbstractContextManager[None]:
        def in_turn(execute: Callable[..., Any], *arguments: Any) -> Any:
            with turn():
                return execute(*arguments)

        wrapping: contextlib.AbstractContextManager[None] = connections[using].execute_wrapper(
            in_turn
        )
        return wrapping

    return install


@contextlib.contextmanager
def _atomic(task: Any, using: str) -> Iterator[OpenTransaction]:
    """``atomic(using=using)``, with a SQLAlchemy connection on its DB-API connection."""
    connection = connections[using]
    if connection.in_atomic_block:
        raise LeaseConfigurationError(
            f"exactly_once(using={using!r}) was called inside an atomic() block: its "
            "transaction is the one that completes the job, and an enclosing block would "
            "commit (or roll back) it later, after the job was reported completed. Call "
            "it outside any atomic() block; atomic() blocks inside it are savepoints"
        )
    if not connection.get_autocommit():
        raise LeaseConfigurationError(
            f"DATABASES[{using!r}] has AUTOCOMMIT off: atomic() then does not commit, so "
            "the completion would not commit with your writes. exactly_once needs the "
            "default, AUTOCOMMIT on"
        )
    # after the checks above: the store's connection must not wait on a
    # transaction Django's connection holds open
    _check_same_database(task, using)
    engine = _engine(using)
    atomic = transaction.atomic(using=using, durable=True)
    atomic.__enter__()
    ended = False

    def end(*, commit: bool) -> None:
        nonlocal ended
        ended = True
        if not commit:
            transaction.set_rollback(True, using=using)
        atomic.__exit__(None, None, None)

    def roll_back() -> None:
        # on a dead connection the rollback fails too; the error that broke
        # the transaction is the one to raise
        with contextlib.suppress(DatabaseError):
            end(commit=False)

    def before_complete() -> None:
        if connection.needs_rollback or connection.closed_in_transaction:
            raise LeaseConfigurationError(
                f"the exactly_once block on {using!r} was marked for rollback (an error "
                "caught inside atomic() without a savepoint, transaction.set_rollback(), "
                "or a closed connection): it was rolled back with its completion"
            )

    try:
        with engine.connect() as lent:
            yield OpenTransaction(lent, None, lambda: end(commit=True), roll_back, before_complete)
    finally:
        if not ended:
            roll_back()


class _Lent:
    """Django's DB-API connection as SQLAlchemy sees it: every call but
    ``commit``, ``rollback`` and ``close`` reaches the connection; those three
    are Django's, which ends the transaction in ``atomic()``."""

    def __init__(self, dbapi_connection: Any) -> None:
        self._dbapi_connection = dbapi_connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dbapi_connection, name)

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass


_engines: dict[tuple[int, str, str], Engine] = {}
_engines_lock = threading.Lock()


def _engine(using: str) -> Engine:
    """An engine whose connections are Django's connection of ``using`` in
    the calling thread, lent (one per process and alias; made outside any
    transaction, where its first connection reads the server's settings)."""
    url, _ = connection_arguments(using)
    key = (os.getpid(), using, url.render_as_string())
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:

            def lend() -> _Lent:
                connections[using].ensure_connection()
                return _Lent(connections[using].connection)

            options: dict[str, Any] = (
                {"use_native_hstore": False} if url.get_backend_name() == "postgresql" else {}
            )
            engine = sa.create_engine(
                url,
                creator=lend,
                poolclass=NullPool,
                pool_reset_on_return=None,
                **options,
            )
            with engine.connect():
                pass  # the first connection initializes the dialect
            _engines[key] = engine
    return engine


def _check_same_database(task: Any, using: str) -> None:
    """Refuse a lease store on another database than ``using``'s, or one that
    finds another lease table under the same name (another schema).

    Both sides are asked where they are: what the server says, not how
    each was configured, so a socket folder and a host name, a service and
    its parameters, alike name one database.
    """
    store = task.lease.store
    store_engine = getattr(store, "engine", None)
    table = getattr(store, "table", None)
    if not isinstance(store_engine, Engine) or not isinstance(table, sa.Table):
        return  # not an SQL store: run_once says so
    with store_engine.connect() as store_side:
        theirs = _where(store_side, table.name)
    with _engine(using).connect() as django_side:
        ours = _where(django_side, table.name)
    if theirs != ours:
        raise LeaseConfigurationError(
            f"exactly_once(using={using!r}) needs the lease store on the database of "
            f"DATABASES[{using!r}] and its lease table, but the store is on {store.url}: "
            "the completion can only commit with your writes in one database. Set "
            f"CELERY_LEASES_STORE = 'django://{using}'",
            job_id=task.lease.job_id,
        )


#: what a server says of itself and of the table a name finds there
_WHERE = {
    # the server (its start and port), the database, the table's own id
    "postgresql": "SELECT pg_postmaster_start_time()::text, current_setting('port'), "
    "current_database(), to_regclass(quote_ident(:table))::oid::text",
    # the server (its host, port and files), the database: no schema path
    "mysql": "SELECT @@hostname, @@port, @@datadir, DATABASE(), :table",
}


def _where(connection: sa.Connection, table_name: str) -> tuple[str, ...]:
    """Where ``connection`` is: the server, the database, the table ``table_name`` finds."""
    name = connection.dialect.name
    if name == "sqlite":
        files = connection.exec_driver_sql("PRAGMA database_list").all()
        main = next(str(row[2]) for row in files if row[1] == "main")
        return ("sqlite", os.path.realpath(main) if main else "", table_name)
    name = dialect_named(name, "exactly_once").name
    row = connection.execute(sa.text(_WHERE[name]), {"table": table_name}).one()
    return (name, *map(str, row))
