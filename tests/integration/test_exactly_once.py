"""``exactly_once``: a task's writes and its completion in one transaction.

Real Celery workers in this process, a real Redis broker, and the lease
store in PostgreSQL or SQLite; the task writes to its own table in the same
database through its own engine (a connection or an ORM session).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from celery_leases import AlreadyCompleted, LeaseConfigurationError, LeasedTask, LeaseState
from celery_leases.exactly_once import exactly_once
from celery_leases.outcome import decode
from celery_leases.task import store_for
from tests.acceptance.harness import wait_until
from tests.integration.conftest import WAIT, Recorder, worker
from tests.proxy import Proxy

pytestmark = pytest.mark.redis


def engine_for(url: str, **options: Any) -> sa.Engine:
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return sa.create_engine(parsed, **options)


@pytest.fixture
def engine(sql_url: str) -> Iterator[sa.Engine]:
    engine = engine_for(sql_url)
    yield engine
    engine.dispose()


@pytest.fixture
def effects(engine: sa.Engine, unique: str) -> sa.Table:
    table = sa.Table(
        f"effects_{unique}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
    )
    table.create(engine)
    return table


@pytest.fixture
def app(make_app: Callable[..., Celery], sql_url: str, unique: str) -> Celery:
    return make_app(sql_url, leases_store_options={"table_name": f"leases_{unique}"}, leases_ttl=5)


def rows_of(engine: sa.Engine, table: sa.Table, job_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).select_from(table).where(table.c.job_id == job_id)
            ).scalar_one()
        )


def rows_in(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def insert(conn: sa.Connection, table: sa.Table, lease: Any) -> None:
    conn.execute(sa.insert(table).values(job_id=lease.job_id, generation=lease.generation))


def test_writes_and_completion_commit_together(
    app: Celery, engine: sa.Engine, effects: sa.Table
) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True)
    def bill(self: LeasedTask, amount: int) -> dict[str, int]:
        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, self.lease)
            return tx.complete({"amount": amount, "generation": self.lease.generation})

    with worker(app):
        result = bill.delay(42)
        value = result.get(timeout=WAIT)
    assert rows_of(engine, effects, result.id) == 1
    record = store_for(app).get(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert value == {"amount": 42, "generation": record.generation}
    assert record.outcome is not None
    assert decode(record.outcome, serializer="json") == ("ok", value)


def test_an_orm_session_commits_its_objects_with_the_completion(
    app: Celery, engine: sa.Engine, unique: str
) -> None:
    class Base(DeclarativeBase):
        pass

    class Invoice(Base):
        __tablename__ = f"invoices_{unique}"
        id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
        job_id: Mapped[str] = mapped_column(sa.String(64))

    Invoice.__table__.create(engine)  # type: ignore[attr-defined]

    @app.task(shared=False, base=LeasedTask, bind=True)
    def bill(self: LeasedTask) -> str:
        with Session(engine) as session, exactly_once(self, session) as tx:
            session.add(Invoice(job_id=self.lease.job_id))
            return tx.complete("billed")

    with worker(app):
        result = bill.delay()
        assert result.get(timeout=WAIT) == "billed"
    with Session(engine) as session:
        assert (
            session.scalar(
                sa.select(sa.func.count()).select_from(Invoice).where(Invoice.job_id == result.id)
            )
            == 1
        )
    record = store_for(app).get(result.id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED


def test_a_superseded_holder_is_refused_and_the_next_generation_writes_once(
    app: Celery, engine: sa.Engine, effects: sa.Table, recorder: Recorder
) -> None:
    """The first run's lease is taken over before its transaction: its
    transaction is refused and rolled back; the copy published again runs
    once the usurper's lease runs out, and commits the only row."""

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=2)
    def bill(self: LeasedTask) -> int:
        lease = self.lease
        if not recorder.of("taken-over"):
            store = store_for(app)
            store.force_release(lease.job_id, by="test", reason="take over")
            taken = store.claim(lease.job_id, "usurper", 1.0, task_name="other")
            recorder.add("taken-over", taken)
        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, lease)
            recorder.add("committed", lease.generation)
            return tx.complete(lease.generation)

    with worker(app):
        result = bill.delay()
        generation = result.get(timeout=WAIT)
    assert rows_of(engine, effects, result.id) == 1
    assert recorder.of("committed") == [generation]  # the stale run never reached its commit
    [fenced] = recorder.of("lease_fenced_out")
    assert fenced["reason"] == "superseded"
    with engine.connect() as conn:
        [written] = conn.execute(sa.select(effects.c.generation)).scalars().all()
    assert written == generation > recorder.of("taken-over")[0].generation


def test_a_claim_during_the_transaction_waits_and_finds_the_job_completed(
    app: Celery, engine: sa.Engine, effects: sa.Table, recorder: Recorder
) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True)
    def bill(self: LeasedTask) -> str:
        lease = self.lease
        store = store_for(app)

        def claim() -> None:
            recorder.add("claim", store.claim(lease.job_id, "other", 5.0, task_name="other"))

        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, lease)
            claimer = threading.Thread(target=claim)
            claimer.start()
            claimer.join(0.5)
            recorder.add("claim answered inside", claimer.is_alive() is False)
            value = tx.complete("done")
        claimer.join(WAIT)
        return value

    with worker(app):
        bill.delay().get(timeout=WAIT)
    assert recorder.of("claim answered inside") == [False]
    [answer] = recorder.of("claim")
    assert isinstance(answer, AlreadyCompleted)


def test_a_block_without_complete_rolls_back(
    app: Celery, engine: sa.Engine, effects: sa.Table, recorder: Recorder
) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True)
    def bill(self: LeasedTask) -> None:
        try:
            with exactly_once(self, engine) as tx:
                insert(tx.connection, effects, self.lease)
        except LeaseConfigurationError as error:
            recorder.add("error", str(error))

    with worker(app):
        result = bill.delay()
        result.get(timeout=WAIT)
    assert "without tx.complete" in recorder.of("error")[0]
    assert rows_of(engine, effects, result.id) == 0


def errors_of(
    app: Celery, recorder: Recorder, make_bind: Callable[[], Any], use: Callable[[Any], Any]
) -> str:
    """Run a task whose exactly_once block is given ``make_bind()``; the
    LeaseConfigurationError it raised."""

    @app.task(shared=False, base=LeasedTask, bind=True)
    def bill(self: LeasedTask) -> None:
        bind = make_bind()
        try:
            with exactly_once(self, use(bind)) as tx:
                tx.complete(None)
        except LeaseConfigurationError as error:
            recorder.add("error", str(error))
        finally:
            if isinstance(bind, sa.Connection):
                bind.close()

    with worker(app):
        bill.delay().get(timeout=WAIT)
    [error] = recorder.of("error")
    return str(error)


def test_a_connection_inside_a_transaction_is_refused(
    app: Celery, engine: sa.Engine, recorder: Recorder
) -> None:
    def inside(conn: sa.Connection) -> sa.Connection:
        conn.begin()
        return conn

    error = errors_of(app, recorder, engine.connect, inside)
    assert "outside any transaction" in error


def test_an_autocommit_connection_is_refused(app: Celery, sql_url: str, recorder: Recorder) -> None:
    autocommit = engine_for(sql_url, isolation_level="AUTOCOMMIT")
    try:
        error = errors_of(app, recorder, autocommit.connect, lambda conn: conn)
    finally:
        autocommit.dispose()
    assert "autocommit" in error


def test_another_database_with_a_lease_table_is_refused(
    app: Celery, tmp_path: Path, unique: str, recorder: Recorder
) -> None:
    """A copy of the lease table elsewhere must not pass for the store's."""
    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    store = store_for(app)
    if store.dialect_name != "sqlite":
        pytest.skip("a second SQLite file stands for another database")
    store.table.create(other)
    try:
        error = errors_of(app, recorder, lambda: other, lambda engine: engine)
    finally:
        other.dispose()
    assert "another database" in error


def test_another_database_without_the_lease_table_is_refused(
    app: Celery, tmp_path: Path, recorder: Recorder
) -> None:
    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    try:
        error = errors_of(app, recorder, lambda: other, lambda engine: engine)
    finally:
        other.dispose()
    assert "lease store" in error


def test_a_store_outside_sql_is_refused(
    make_app: Callable[..., Celery], engine: sa.Engine, recorder: Recorder
) -> None:
    memory_app = make_app("memory://")
    error = errors_of(memory_app, recorder, lambda: engine, lambda bind: bind)
    assert "needs an SQL lease store" in error


def fail_transiently(conn: sa.Connection) -> None:
    """A statement that fails as a lost connection or a timeout would
    (``OperationalError``), in each database, whatever the machine's load.

    PostgreSQL's own timer cancels the sleep; the sleep is long so that a
    starved server still cancels it rather than finishes it. MariaDB's
    statement timer runs on a thread of its own that a loaded machine can
    hold past a short sleep (a CI run once saw ``SLEEP(1)`` return), so the
    statement interrupts itself, as that timer would (error 1317). SQLite's
    stand-in is a function that raises (not a missing table: that is a
    refusal for good, which passes through as the task's own error).
    """
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SET LOCAL statement_timeout = 1"))
        conn.execute(sa.text("SELECT pg_sleep(60)"))
    elif conn.dialect.name in ("mysql", "mariadb"):
        conn.execute(sa.text("KILL QUERY CONNECTION_ID()"))
    else:
        conn.connection.driver_connection.create_function("fail", 0, lambda: 1 / 0)  # type: ignore[union-attr]
        conn.execute(sa.text("SELECT fail()"))


def end_session(conn: sa.Connection) -> None:
    """The server ends ``conn``'s session (as an idle limit, an operator or a
    restart would), from another connection; the task's next statement
    finds the connection gone."""
    if conn.dialect.name == "postgresql":
        own, end = "SELECT pg_backend_pid()", "SELECT pg_terminate_backend({})"
    else:
        own, end = "SELECT CONNECTION_ID()", "KILL CONNECTION {}"
    session = int(conn.exec_driver_sql(own).scalar_one())
    with conn.engine.connect() as other:
        other.exec_driver_sql(end.format(session))
        other.commit()
    conn.exec_driver_sql("SELECT 1")


# a session ended on MySQL and MariaDB also sets the session's idle limit
# back on a connection SQLAlchemy has invalidated
@pytest.mark.parametrize("fail", [fail_transiently, end_session])
def test_a_transient_database_error_rolls_back_and_runs_the_job_again(
    app: Celery,
    engine: sa.Engine,
    effects: sa.Table,
    recorder: Recorder,
    fail: Callable[[sa.Connection], None],
) -> None:
    if fail is end_session and engine.dialect.name == "sqlite":
        pytest.skip("an SQLite connection has no server session to end")

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=2)
    def bill(self: LeasedTask) -> int:
        lease = self.lease
        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, lease)
            if not recorder.of("failed"):
                recorder.add("failed", lease.generation)
                fail(tx.connection)
            return tx.complete(lease.generation)

    with worker(app):
        result = bill.delay()
        generation = result.get(timeout=WAIT)
    assert generation > recorder.of("failed")[0]
    assert rows_of(engine, effects, result.id) == 1
    assert [e["reason"] for e in recorder.of("lease_fenced_out")] == ["unavailable"]


def test_a_constraint_violation_is_the_task_s_own_failure(
    app: Celery, engine: sa.Engine, effects: sa.Table
) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True)
    def bill(self: LeasedTask) -> None:
        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, self.lease)
            twice = sa.insert(effects).values(id=-1, job_id="x", generation=1)
            tx.connection.execute(twice)
            tx.connection.execute(twice)
            tx.complete(None)

    with worker(app):
        result = bill.delay()
        # Celery rebuilds an exception it cannot import by its name
        with pytest.raises(Exception, match="IntegrityError"):
            result.get(timeout=WAIT, propagate=True)
    assert rows_of(engine, effects, result.id) == 0
    record = store_for(app).get(result.id)
    assert record is not None
    assert record.state is LeaseState.RELEASED


def test_a_refusal_for_good_in_the_block_is_the_task_s_own_failure(
    app: Celery, engine: sa.Engine, effects: sa.Table, recorder: Recorder
) -> None:
    """A statement of the task that can never succeed (a missing table; on
    SQLite an ``OperationalError``, as missing rights are on MariaDB) fails
    the task once: it is not an outage, and the job is not run again."""

    @app.task(shared=False, base=LeasedTask, bind=True)
    def bill(self: LeasedTask) -> None:
        recorder.add("run", self.lease.generation)
        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, self.lease)
            tx.connection.execute(sa.text("SELECT * FROM a_table_that_is_not_there"))
            tx.complete(None)

    with worker(app):
        result = bill.delay()
        with pytest.raises(Exception, match="a_table_that_is_not_there"):
            result.get(timeout=WAIT, propagate=True)
    assert len(recorder.of("run")) == 1
    assert recorder.of("lease_fenced_out") == []
    assert rows_of(engine, effects, result.id) == 0
    record = store_for(app).get(result.id)
    assert record is not None
    assert record.state is LeaseState.RELEASED


def test_a_connection_lost_at_the_commit_is_judged_by_the_record(
    app: Celery, sql_url: str, engine: sa.Engine, effects: sa.Table, recorder: Recorder
) -> None:
    """The server ends the session just before the COMMIT: nothing was
    committed, the record still names this run as holder, so the run is
    fenced out and the job runs again; its row is written once."""
    if not sql_url.startswith("postgresql"):
        pytest.skip("ends the server's session with pg_terminate_backend")

    def end_the_session(conn: sa.Connection) -> None:
        if recorder.of("ended"):
            return
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        recorder.add("ended", pid)
        with engine.connect() as other:
            other.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
            other.commit()

    sa.event.listen(engine, "commit", end_the_session)

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=2)
    def bill(self: LeasedTask) -> int:
        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, self.lease)
            return tx.complete(self.lease.generation)

    try:
        with worker(app):
            result = bill.delay()
            generation = result.get(timeout=WAIT)
    finally:
        sa.event.remove(engine, "commit", end_the_session)
    assert recorder.of("ended")
    assert rows_of(engine, effects, result.id) == 1
    [fenced] = recorder.of("lease_fenced_out")
    assert fenced["reason"] == "unavailable"
    record = store_for(app).get(result.id)
    assert record is not None
    assert (record.state, record.generation) == (LeaseState.COMPLETED, generation)


@pytest.mark.parametrize("writer", ["block", "before_commit"])
def test_a_session_writing_through_a_second_bind_is_refused(
    app: Celery, engine: sa.Engine, unique: str, tmp_path: Path, recorder: Recorder, writer: str
) -> None:
    """``Session(bind=store_db, binds={Invoice: other_db})``: the invoice
    would commit on a connection of its own, apart from the completion (and
    could fail alone). Written in the block, it is refused before the
    completion; added by a ``before_commit`` hook, it is flushed by the
    commit itself, after that check, and refused there. Nothing is written
    on either database."""

    class Base(DeclarativeBase):
        pass

    class Ledger(Base):  # on the lease store's database
        __tablename__ = f"ledger_{unique}"
        id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
        job_id: Mapped[str] = mapped_column(sa.String(64))

    class Invoice(Base):  # on another database
        __tablename__ = f"invoices_{unique}"
        id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
        job_id: Mapped[str] = mapped_column(sa.String(64))

    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    Ledger.__table__.create(engine)  # type: ignore[attr-defined]
    Invoice.__table__.create(other)  # type: ignore[attr-defined]

    @app.task(shared=False, base=LeasedTask, bind=True)
    def bill(self: LeasedTask) -> str:
        job_id = self.lease.job_id
        with Session(bind=engine, binds={Invoice: other}) as session:
            if writer == "before_commit":
                sa.event.listen(session, "before_commit", lambda s: s.add(Invoice(job_id=job_id)))
            try:
                with exactly_once(self, session) as tx:
                    session.add(Ledger(job_id=job_id))
                    if writer == "block":
                        session.add(Invoice(job_id=job_id))
                    return tx.complete("billed")
            except LeaseConfigurationError as error:
                recorder.add("error", str(error))
                return "refused"

    try:
        with worker(app):
            result = bill.delay()
            assert result.get(timeout=WAIT) == "refused"
        ledger = rows_in(engine, Ledger.__table__)  # type: ignore[arg-type]
        invoices = rows_in(other, Invoice.__table__)  # type: ignore[arg-type]
    finally:
        other.dispose()
    [error] = recorder.of("error")
    assert "second connection" in error
    assert "other.db" in error
    assert (ledger, invoices) == (0, 0)


def test_a_session_whose_reconnect_is_refused_as_the_block_opens_runs_the_job_again(
    app: Celery, sql_url: str, effects: sa.Table, engine: sa.Engine, recorder: Recorder
) -> None:
    """The session's pooled connection died, and the pre-ping's reconnect is
    refused as the block opens: the run is fenced out and published again;
    the next run, once connections pass, writes the one row."""
    database = sa.make_url(sql_url)
    if database.port is None:
        pytest.skip("a refused connection needs a database over the network")
    with Proxy("127.0.0.1", database.port) as proxy:
        through = engine_for(
            database.set(port=proxy.port).render_as_string(hide_password=False),
            pool_pre_ping=True,
        )
        with through.connect():
            pass  # pooled: the block's checkout pings it

        @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=2)
        def bill(self: LeasedTask) -> int:
            lease = self.lease
            if recorder.of("refused"):
                proxy.heal()
            else:
                recorder.add("refused", lease.generation)
                proxy.refuse()  # cuts the pooled connection, refuses new ones
            with Session(through) as session, exactly_once(self, session) as tx:
                insert(tx.connection, effects, lease)
                return tx.complete(lease.generation)

        try:
            with worker(app):
                result = bill.delay()
                generation = result.get(timeout=WAIT)
        finally:
            through.dispose()
    assert generation > recorder.of("refused")[0]
    assert rows_of(engine, effects, result.id) == 1
    assert [e["reason"] for e in recorder.of("lease_fenced_out")] == ["unavailable"]


def test_renewals_in_a_block_that_rolls_back_leave_the_lease_its_committed_time(
    make_app: Callable[..., Celery], sql_url: str, unique: str, engine: sa.Engine, effects: sa.Table
) -> None:
    """The heartbeat renews in the block's transaction; when the block rolls
    back, those renewals never happened, and the lease keeps no more time
    than the committed record gives it."""
    app = make_app(sql_url, leases_store_options={"table_name": f"leases_{unique}"}, leases_ttl=2)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def fail_late(self: LeasedTask) -> dict[str, Any]:
        lease = self.lease
        before, renewals = lease.deadline, lease.renewals
        try:
            with exactly_once(self, engine) as tx:
                insert(tx.connection, effects, lease)
                wait_until(lambda: lease.renewals >= renewals + 2, timeout=WAIT,
                           message="two renewals in the block's transaction")  # fmt: skip
                in_block = lease.deadline
                raise ValueError("the task's own error")
        except ValueError:
            after = lease.deadline
        return {"renewed": in_block > before, "kept": after <= before}

    with worker(app):
        result = fail_late.delay()
        assert result.get(timeout=WAIT) == {"renewed": True, "kept": True}
    assert rows_of(engine, effects, result.id) == 0


def test_a_block_whose_session_ends_keeps_only_the_committed_time(
    make_app: Callable[..., Celery],
    sql_url: str,
    unique: str,
    engine: sa.Engine,
    effects: sa.Table,
    recorder: Recorder,
) -> None:
    """The server ends the block's session after renewals in its transaction
    gave the lease more time: the lock and those renewals are gone, so the
    lease is lost at the next renewal, not when their time would end."""
    if not sql_url.startswith("postgresql"):
        pytest.skip("ends the server's session with pg_terminate_backend")
    app = make_app(sql_url, leases_store_options={"table_name": f"leases_{unique}"}, leases_ttl=6)

    @app.task(shared=False, base=LeasedTask, bind=True)
    def cut_off(self: LeasedTask) -> None:
        lease = self.lease
        if recorder.of("cut"):
            return  # the next run, once the first was fenced out
        renewals = lease.renewals
        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, lease)
            pid = tx.connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            wait_until(lambda: lease.renewals >= renewals + 2, timeout=WAIT,
                       message="two renewals in the block's transaction")  # fmt: skip
            extended = lease.deadline
            with engine.connect() as other:
                other.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
                other.commit()
            wait_until(lambda: lease.lost, timeout=WAIT, message="the lease lost")
            recorder.add("cut", extended - time.monotonic())
            tx.complete(None)

    with worker(app):
        job = cut_off.delay().id
        [left] = recorder.wait("cut")
    # lost about one renewal interval (2 s) after the session ended, seconds
    # before the time the renewals made in the ended transaction gave it
    assert left > 1.0
    assert rows_of(engine, effects, job) == 0


class Undone(Exception):
    """Rolls a savepoint back."""


def test_a_savepoint_rolled_back_over_a_renewal_keeps_the_idle_limit_above_the_lease(
    make_app: Callable[..., Celery], sql_url: str, unique: str, engine: sa.Engine, effects: sa.Table
) -> None:
    """A renewal made inside a savepoint that the task rolls back is undone
    in the transaction, and PostgreSQL sets the transaction's idle limit back
    to the value before the savepoint; the lease keeps the renewal's time.
    That limit must still outlast the lease: a paused holder whose session
    ended earlier would read alive while the next generation holds the job."""
    if not sql_url.startswith("postgresql"):
        pytest.skip("PostgreSQL's idle limit is transactional (MySQL's is the session's)")
    # the lock is taken late in a long renewal interval: the limit set then
    # is far below what the renewal inside the savepoint gives the lease
    app = make_app(sql_url, leases_store_options={"table_name": f"leases_{unique}"},
                   leases_ttl=12, leases_renew_interval=8, leases_drift_margin=0.6)  # fmt: skip

    @app.task(shared=False, base=LeasedTask, bind=True)
    def undo(self: LeasedTask) -> dict[str, float]:
        lease = self.lease
        records = store_for(app).table  # type: ignore[attr-defined]
        wait_until(lambda: lease.remaining() < lease.timing.safe_duration - 4, timeout=WAIT,
                   message="half the renewal interval gone")  # fmt: skip
        with exactly_once(self, engine) as tx:
            conn = tx.connection
            renewed = sa.select(records.c.renew_count).where(records.c.job_id == lease.job_id)
            try:
                with conn.begin_nested():
                    before = conn.execute(renewed).scalar_one()
                    wait_until(lambda: conn.execute(renewed).scalar_one() > before, timeout=WAIT,
                               message="a renewal inside the savepoint")  # fmt: skip
                    raise Undone
            except Undone:
                pass
            remaining = lease.remaining()
            limit = conn.exec_driver_sql(
                "SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
            ).scalar_one()
            insert(conn, effects, lease)
            tx.complete(None)
        return {"limit": int(limit) / 1000, "remaining": remaining}

    with worker(app):
        result = undo.delay().get(timeout=WAIT)
    assert result["limit"] >= result["remaining"], result


def test_a_block_inside_a_block_is_refused(
    app: Celery, engine: sa.Engine, effects: sa.Table, recorder: Recorder
) -> None:
    """A second block opened inside the first would wait for the record's
    lock the first one holds, while the heartbeat renews the lease in the
    first one's transaction: refused at once instead, nothing written."""

    @app.task(shared=False, base=LeasedTask, bind=True)
    def nested(self: LeasedTask) -> None:
        with exactly_once(self, engine) as tx:
            insert(tx.connection, effects, self.lease)
            try:
                with exactly_once(self, engine):
                    pass
            except LeaseConfigurationError as error:
                recorder.add("refused", str(error))
                raise

    with worker(app):
        result = nested.delay()
        with pytest.raises(LeaseConfigurationError):
            result.get(timeout=WAIT)
    assert "inside its exactly_once block" in recorder.of("refused")[0]
    assert rows_of(engine, effects, result.id) == 0
