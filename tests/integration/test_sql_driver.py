"""The PostgreSQL store's claim and complete, sent on the driver's cursor.

A real PostgreSQL. Which way a statement went is told by SQLAlchemy's
``engine_connect`` event: Core opens a ``Connection`` for a statement, the
driver path takes a pooled DBAPI connection without one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from celery_leases import (
    Acquired,
    AlreadyCompleted,
    Completed,
    HeldElsewhere,
    LeaseConfigurationError,
    Refusal,
    RefusalReason,
    StoreUnavailable,
)
from celery_leases.stores.sql import SqlStore
from celery_leases.stores.sql_driver import DriverStatements
from tests.servers import PostgresServer

pytestmark = pytest.mark.postgres

A, B = "worker-a", "worker-b"


@pytest.fixture
def store(postgres_server: PostgresServer, unique: str) -> Iterator[SqlStore]:
    opened = SqlStore.from_url(postgres_server.url, table_name=f"leases_{unique}")
    yield opened
    opened.close()


class Connects:
    """Counts the Core connections an engine opens."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.count = 0

    def _opened(self, *_: Any) -> None:
        self.count += 1

    def __enter__(self) -> Connects:
        event.listen(self.engine, "engine_connect", self._opened)
        return self

    def __exit__(self, *_: object) -> None:
        event.remove(self.engine, "engine_connect", self._opened)


def test_a_claim_and_its_completion_open_no_core_connection(store: SqlStore) -> None:
    with Connects(store.calls_engine) as connects:
        acquired = store.claim("job", A, 30, task_name="t", send_id="s1", task_id="job")
        assert isinstance(acquired, Acquired)
        completed = store.complete("job", A, acquired.generation, outcome=b"\x00r")
        assert isinstance(completed, Completed)
    assert connects.count == 0
    record = store.get("job")
    assert record is not None
    assert record.outcome == b"\x00r"
    assert record.send_id == "s1"


def test_what_the_driver_path_cannot_answer_goes_through_core(store: SqlStore) -> None:
    acquired = store.claim("job", A, 30)
    assert isinstance(acquired, Acquired)
    with Connects(store.calls_engine) as connects:
        held = store.claim("job", B, 30)  # matched nothing: decided under the row's lock
        refused = store.complete("job", B, acquired.generation)  # why: from the record
    assert isinstance(held, HeldElsewhere)
    assert held.holder == A
    assert isinstance(refused, Refusal)
    assert refused.reason is RefusalReason.SUPERSEDED
    assert connects.count == 2
    assert isinstance(store.complete("job", A, acquired.generation), Completed)
    assert isinstance(store.claim("job", A, 30), AlreadyCompleted)


def test_while_a_listener_listens_every_statement_goes_through_core(store: SqlStore) -> None:
    seen: list[str] = []

    def log(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement.lstrip().split(" ")[0].upper())

    event.listen(store.calls_engine, "before_cursor_execute", log)
    try:
        acquired = store.claim("job", A, 30)
        assert isinstance(acquired, Acquired)
        store.complete("job", A, acquired.generation)
    finally:
        event.remove(store.calls_engine, "before_cursor_execute", log)
    assert seen == ["INSERT", "UPDATE"]


def test_a_connection_taken_out_of_autocommit_is_refused_and_nothing_is_claimed(
    store: SqlStore,
) -> None:
    def out_of_autocommit(dbapi_connection: Any, *_: Any) -> None:
        dbapi_connection.autocommit = False

    pool = store.calls_engine.pool
    event.listen(pool, "checkout", out_of_autocommit)
    try:
        with pytest.raises(LeaseConfigurationError, match="not in autocommit"):
            store.claim("job", A, 30)
    finally:
        event.remove(pool, "checkout", out_of_autocommit)
        store.calls_engine.dispose()
    assert store.get("job") is None


def test_a_connection_lost_under_the_driver_is_discarded_and_the_next_call_works(
    store: SqlStore, postgres_server: PostgresServer
) -> None:
    first = store.claim("warm", A, 30)
    assert isinstance(first, Acquired)
    with store.calls_engine.connect() as conn:
        pids = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    admin = sa.create_engine(postgres_server.url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with admin.begin() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pids})
    finally:
        admin.dispose()
    # the pooled connection is dead: the completion (which may run twice)
    # is tried once more on a fresh connection, and succeeds
    assert isinstance(store.complete("warm", A, first.generation), Completed)
    again = store.claim("next", A, 30)
    assert isinstance(again, Acquired)


def test_a_claim_on_a_server_that_is_gone_is_unavailable(unique: str) -> None:
    store = SqlStore.from_url(
        "postgresql://nobody@127.0.0.1:9/none", table_name=f"leases_{unique}", create_table=False
    )
    try:
        with pytest.raises(StoreUnavailable):
            store.claim("job", A, 30)
    finally:
        store.close()


def test_a_statement_that_binds_a_value_of_its_own_is_refused() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1/none")
    statement = sa.select(sa.literal(1, sa.Integer))
    with pytest.raises(ValueError, match="binds values of its own"):
        DriverStatements(engine, {"claim": statement, "complete": statement})


class Stop(BaseException):
    """Not an error of the driver: an exit, or a green library's timeout."""


def test_a_statement_interrupted_mid_way_leaves_its_connection_out_of_the_pool(
    store: SqlStore,
) -> None:
    import psycopg

    class Interrupted(psycopg.Cursor[Any]):
        def execute(self, *args: Any, **kwargs: Any) -> Any:
            raise Stop

    used: list[Any] = []

    def interrupting(dbapi_connection: Any, *_: Any) -> None:
        dbapi_connection.cursor_factory = Interrupted
        used.append(dbapi_connection)

    pool = store.calls_engine.pool
    event.listen(pool, "checkout", interrupting)
    try:
        with pytest.raises(Stop):
            store.claim("job", A, 30)
    finally:
        event.remove(pool, "checkout", interrupting)
    assert used
    assert used[-1].closed
    assert isinstance(store.claim("job", A, 30), Acquired)  # on a fresh connection
