"""The two statements of every leased run on PostgreSQL, sent by the driver.

A leased run makes two store calls, a claim and a completion. Through
SQLAlchemy Core's execution each statement costs about 50 µs of CPU beyond
the driver's own work (the execution context, its parameters and result),
about as much as its round trip to a local server. On a store whose calls
engine is PostgreSQL with psycopg in autocommit, those two statements are
compiled by SQLAlchemy once and sent on a cursor of one of the engine's
pooled connections; every other statement, every statement of a claim that
did not take the record, and all of them while anything listens to the
engine's cursor events (a statement log, instrumentation), still go
through Core.

Nothing else changes. The pool, its checkout hooks (the ping after idle)
and the connections' bounded waits are the engine's. A driver error is
wrapped as Core wraps it, a :class:`sqlalchemy.exc.DBAPIError` whose
connection is invalidated (and the pool's older connections with it) when
the connection was lost, so the store judges errors the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from sqlalchemy import exc
from sqlalchemy.engine import Engine

from celery_leases.errors import LeaseConfigurationError

__all__ = ["DriverStatements", "sends_by_driver"]

#: the statements sent by the driver: the store's names for them
DRIVEN = ("claim", "complete")


def sends_by_driver(engine: Engine) -> bool:
    """Whether :class:`DriverStatements` can run on ``engine``, a store's calls
    engine (whose connections are made in autocommit): PostgreSQL with psycopg."""
    return engine.dialect.name == "postgresql" and engine.driver == "psycopg"


class _Compiled:
    """One statement's SQL, and the conversions of its parameters that have one."""

    __slots__ = ("convert", "sql")

    def __init__(self, statement: Any, engine: Engine) -> None:
        compiled = statement.compile(dialect=engine.dialect)
        unbound = [name for name, value in compiled.params.items() if value is not None]
        if unbound:  # a constant left bound would be sent as NULL
            raise ValueError(f"statement binds values of its own: {unbound}")
        self.sql: str = str(compiled)
        self.convert: list[tuple[str, Callable[[Any], Any]]] = []
        for name, bind in compiled.binds.items():
            processor = bind.type.bind_processor(engine.dialect)
            if processor is not None:
                self.convert.append((name, processor))


class DriverStatements:
    """The store's claim and complete statements, run on the driver's cursor.

    Args:
        engine: the store's calls engine (see :func:`sends_by_driver`).
        statements: the store's statements, by name.
    """

    def __init__(self, engine: Engine, statements: dict[str, Any]) -> None:
        self._engine = engine
        self._statements = {name: statements[name] for name in DRIVEN}
        for statement in self._statements.values():
            _Compiled(statement, engine)  # refused now rather than at the first call
        #: compiled again once the engine has connected, as Core compiles: the
        #: dialect knows the server then
        self._compiled: dict[str, _Compiled] = {}

    @property
    def listened(self) -> bool:
        """Whether something listens to the engine's cursor events (a log,
        instrumentation): the statements then go through Core, where they see them."""
        dispatch = self._engine.dispatch
        return bool(dispatch.before_cursor_execute or dispatch.after_cursor_execute)

    def first(self, name: str, parameters: dict[str, Any]) -> tuple[Any, ...] | None:
        """The first row of statement ``name`` run with ``parameters``, or None.

        Raises:
            LeaseConfigurationError: the connection is not in autocommit.
            sqlalchemy.exc.StatementError: as Core raises it (a DBAPIError
                for a driver error).
            sqlalchemy.exc.TimeoutError: no pooled connection came in time.
        """
        dialect = self._engine.dialect
        try:
            connection = self._engine.raw_connection()
        except dialect.loaded_dbapi.Error as error:
            raise self._wrapped(error, None, None, None) from error
        sql = None
        try:
            compiled = self._compiled.get(name)
            if compiled is None:
                compiled = self._compiled[name] = _Compiled(self._statements[name], self._engine)
            sql = compiled.sql
            if compiled.convert:
                parameters = dict(parameters)
                for key, convert in compiled.convert:
                    parameters[key] = convert(parameters[key])
            if not connection.dbapi_connection.autocommit:  # type: ignore[union-attr]
                # its statement would be rolled back when the connection goes back
                raise LeaseConfigurationError(
                    "a connection of the SQL store's calls engine is not in autocommit "
                    "(something changed it); the store's calls need autocommit"
                )
            cursor = connection.cursor()
            try:
                cursor.execute(sql, parameters)
                row = cursor.fetchone()
            except dialect.loaded_dbapi.Error:
                raise
            except BaseException:
                # interrupted mid-statement (an exit, a timeout of a green
                # library): the connection's state is unknown, as Core judges it
                connection.invalidate()
                raise
            finally:
                cursor.close()
        except dialect.loaded_dbapi.Error as error:
            raise self._wrapped(error, sql, parameters, connection) from error
        finally:
            connection.close()  # back to the pool (or discarded, if invalidated)
        return None if row is None else tuple(row)

    def _wrapped(
        self, error: Any, sql: str | None, parameters: Any, connection: Any
    ) -> exc.StatementError:
        dialect = self._engine.dialect
        lost = dialect.is_disconnect(error, connection, None)
        if lost and connection is not None:
            # as Core does: the pool's connections made before this one are
            # replaced when next checked out, and this one is discarded
            self._engine.pool._invalidate(connection, error)
        return cast(
            exc.StatementError,
            exc.DBAPIError.instance(
                sql,
                parameters,
                error,
                dialect.loaded_dbapi.Error,
                connection_invalidated=lost,
                dialect=dialect,
            ),
        )
