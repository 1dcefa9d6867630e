"""The Django tests (tests/django_app and the shop's), on SQLite, PostgreSQL
and MariaDB, with this virtualenv's Django; scripts/matrix runs them with
Django 5.2 (the LTS) and with the newest Django.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import serve
from tests.django_runner import DJANGO_APP, NETWORK_ONLY, RUN_TIMEOUT, TESTS, run_django_tests
from tests.servers import MariadbServer, PostgresServer

#: each test is one run of the Django tests in a process of its own
pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 10)

#: on PostgreSQL and MariaDB, the tests whose outcome depends on the database: the
#: tables, the fenced statements, the real workers, and the first contact (the
#: check before and after migrate); the other checks and the pytest plugin do
#: not change with it
POSTGRES_TESTS = [
    DJANGO_APP / "test_schema.py",
    DJANGO_APP / "test_orm_fencing.py",
    DJANGO_APP / "test_workers.py",
    DJANGO_APP / "test_exactly_once.py",
    DJANGO_APP / "test_first_contact.py",
    DJANGO_APP / "test_admin.py",  # "expired" and "left" read the database's clock
]


def test_the_django_tests_pass_on_sqlite(tmp_path: Path) -> None:
    run_django_tests(tmp_path, TESTS, leave_out=NETWORK_ONLY)


@pytest.mark.postgres
def test_the_django_tests_pass_on_postgresql(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.url.replace("postgresql+psycopg://", "postgresql://")
    run_django_tests(tmp_path, POSTGRES_TESTS, SHOP_POSTGRES=url)


@pytest.mark.mysql
def test_the_django_tests_pass_on_mariadb(tmp_path: Path, mariadb_server: MariadbServer) -> None:
    # Django's test runner makes test_<name> and test_schema a fresh
    # database: a user of their own may create databases (the store's user
    # has its one database only)
    user, password = "shop", "shop-test-pw"
    mariadb_server.sql(
        f"CREATE USER IF NOT EXISTS '{user}'@'127.0.0.1' IDENTIFIED BY '{password}';"
        f"GRANT ALL ON *.* TO '{user}'@'127.0.0.1';"
    )
    url = f"mysql://{user}:{password}@127.0.0.1:{mariadb_server.port}/shop"
    run_django_tests(tmp_path, POSTGRES_TESTS, SHOP_MYSQL=url)


#: the tests of the django:// store's connection, with the settings that lay
#: SHOP_DATABASE_ENTRY over the shop's DATABASES["default"]
CONNECTION_TESTS = [DJANGO_APP / "test_connections.py"]
ENTRY_SETTINGS = "tests.django_app.settings_entry"


def ssl_postgres_server() -> PostgresServer:
    """A PostgreSQL server with SSL on (a self-signed certificate, ``server.crt``
    in its folder), a database ``shop``, and a schema ``app`` in every new database."""
    server = PostgresServer()
    try:
        certificate, key = server.root / "server.crt", server.root / "server.key"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(certificate)],
            check=True, capture_output=True,
        )  # fmt: skip
        key.chmod(0o600)
        if server.user is not None:  # the server reads its key as its own user
            entry = pwd.getpwnam(server.user)
            for made in (certificate, key):
                os.chown(made, entry.pw_uid, entry.pw_gid)
        server.settings = ("ssl=on", f"ssl_cert_file={certificate}", f"ssl_key_file={key}")
        server.restart()
        for database, statement in [
            # Django's test database is made from template1: the schema is in it
            ("template1", "CREATE SCHEMA app"),
            ("postgres", "CREATE DATABASE shop"),
        ]:
            url = sa.make_url(server.url).set(database=database)
            engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
            with engine.connect() as connection:
                connection.exec_driver_sql(statement)
            engine.dispose()
    except BaseException:
        server.close()
        raise
    return server


def run_connection_tests(tmp_path: Path, entry: dict[str, Any], **env: str) -> None:
    """The connection tests with ``entry`` laid over the shop's ``DATABASES["default"]``."""
    run_django_tests(
        tmp_path,
        CONNECTION_TESTS,
        SHOP_DATABASE_ENTRY=json.dumps(entry),
        DJANGO_SETTINGS_MODULE=ENTRY_SETTINGS,
        **env,
    )


def shop_on(server: PostgresServer) -> str:
    """The shop's database ``shop`` on ``server``, as ``SHOP_POSTGRES`` takes it."""
    return f"postgresql://postgres@127.0.0.1:{server.port}/shop"


@pytest.fixture(scope="module")
def ssl_postgres() -> Iterator[PostgresServer]:
    yield from serve(ssl_postgres_server)


@pytest.mark.postgres
def test_the_django_store_connects_over_a_socket_folder_with_a_search_path(
    tmp_path: Path, ssl_postgres: PostgresServer
) -> None:
    entry: dict[str, Any] = {
        "HOST": str(ssl_postgres.root),  # the socket folder
        "PORT": str(ssl_postgres.port),
        "OPTIONS": {"options": "-c search_path=app"},
    }
    run_connection_tests(tmp_path, entry, SHOP_POSTGRES=shop_on(ssl_postgres))


@pytest.mark.postgres
def test_the_django_store_connects_with_a_service_and_verified_ssl(
    tmp_path: Path, ssl_postgres: PostgresServer
) -> None:
    # the schema path comes from the service only (Django leaves the service
    # out of its connection to the 'postgres' database, so HOST and PORT stay)
    services = tmp_path / "pg_service.conf"
    services.write_text("[shop]\noptions=-c search_path=app\n")
    entry: dict[str, Any] = {
        "OPTIONS": {
            "service": "shop",
            # the server's own certificate is the root: a connection that
            # left sslrootcert out would fail to verify it
            "sslmode": "verify-ca",
            "sslrootcert": str(ssl_postgres.root / "server.crt"),
            "target_session_attrs": "read-write",
        },
    }
    run_connection_tests(
        tmp_path, entry, SHOP_POSTGRES=shop_on(ssl_postgres), PGSERVICEFILE=str(services)
    )


@pytest.mark.mysql
def test_the_django_store_connects_over_a_mariadb_socket(
    tmp_path: Path, mariadb_server: MariadbServer
) -> None:
    user, password = "shop", "shop-socket-pw"
    mariadb_server.sql(
        f"CREATE USER IF NOT EXISTS '{user}'@'localhost' IDENTIFIED BY '{password}';"
        f"GRANT ALL ON *.* TO '{user}'@'localhost';"
    )
    entry = {"HOST": str(mariadb_server.socket), "PORT": ""}  # Django's unix_socket
    run_connection_tests(tmp_path, entry, SHOP_MYSQL=f"mysql://{user}:{password}@localhost/shop")
