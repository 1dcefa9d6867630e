"""What the SQL store relies on in its drivers where they have no public API.

Neither psycopg nor PyMySQL has a public way to bound one wait for a reply
inside a call, so the store's connection classes override driver methods
(celery_leases/stores/sql/_postgres.py and _mysql.py). Each test here pins
one behaviour those overrides need, on a real server, so that a driver
release that changes it fails here by name, before a store call could hang.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.servers import MariadbServer, PostgresServer


def _driver_connection(url: str) -> Iterator[Any]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    raw = engine.raw_connection()
    try:
        yield raw.driver_connection
    finally:
        raw.close()
        engine.dispose()


@pytest.fixture
def psycopg_connection(postgres_server: PostgresServer) -> Iterator[Any]:
    yield from _driver_connection(postgres_server.url)


@pytest.fixture
def pymysql_connection(mariadb_server: MariadbServer) -> Iterator[Any]:
    yield from _driver_connection(mariadb_server.url)


# --- psycopg: Connection.wait -------------------------------------------------


def test_psycopg_waits_for_every_reply_through_connection_wait(
    psycopg_connection: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    assert list(inspect.signature(psycopg.Connection.wait).parameters)[:4] == [
        "self",
        "gen",
        "interval",
        "timeout",
    ]
    waits = []
    original = psycopg.Connection.wait

    def counted(self: Any, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        waits.append(timeout)
        return original(self, gen, interval, timeout)

    monkeypatch.setattr(psycopg.Connection, "wait", counted)
    with psycopg_connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)
    assert waits, "a statement's reply no longer comes through Connection.wait"


def test_psycopg_s_wait_ends_at_its_timeout_with_an_operational_error(
    psycopg_connection: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    original = psycopg.Connection.wait

    def bounded(self: Any, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        return original(self, gen, interval, 0.3)

    monkeypatch.setattr(psycopg.Connection, "wait", bounded)
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError), psycopg_connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(10)")
    assert time.monotonic() - started < 5


# --- PyMySQL: _read_packet, _write_bytes, _read_timeout, _force_close -----------


def test_pymysql_writes_through_write_bytes_and_reads_through_read_packet(
    pymysql_connection: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pymysql.connections import Connection, MysqlPacket

    assert "packet_type" in inspect.signature(Connection._read_packet).parameters
    assert inspect.signature(Connection._read_packet).parameters["packet_type"].default is (
        MysqlPacket
    )
    calls: list[str] = []
    read, write = Connection._read_packet, Connection._write_bytes

    def reading(self: Any, packet_type: Any = MysqlPacket) -> Any:
        calls.append("read")
        return read(self, packet_type)

    def writing(self: Any, data: bytes) -> None:
        calls.append("write")
        write(self, data)

    monkeypatch.setattr(Connection, "_read_packet", reading)
    monkeypatch.setattr(Connection, "_write_bytes", writing)
    with pymysql_connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)
    assert calls[0] == "write"
    assert "read" in calls


def test_pymysql_applies_read_timeout_at_each_read_packet(pymysql_connection: Any) -> None:
    import pymysql

    pymysql_connection._read_timeout = 0.3
    started = time.monotonic()
    with (
        pytest.raises(pymysql.err.OperationalError, match="timed out"),
        pymysql_connection.cursor() as cursor,
    ):
        cursor.execute("SELECT SLEEP(10)")
    assert time.monotonic() - started < 5
    # PyMySQL closed the socket: SQLAlchemy's pool discards such a connection
    assert not pymysql_connection.open


def test_pymysql_force_close_closes_the_socket_without_a_word(pymysql_connection: Any) -> None:
    sent: list[bytes] = []
    pymysql_connection._write_bytes = sent.append
    pymysql_connection._force_close()
    assert not pymysql_connection.open
    assert sent == []  # no COM_QUIT: it could wait on a silent server
