"""The Django tests (tests/django_app and the shop's), on SQLite, PostgreSQL
and MariaDB, with this virtualenv's Django; scripts/matrix runs them with
Django 5.2 (the LTS) and with the newest Django.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.django_runner import DJANGO_APP, NETWORK_ONLY, RUN_TIMEOUT, TESTS, run_django_tests
from tests.servers import MariadbServer, PostgresServer

#: each test is one run of the Django tests in a process of its own
pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 10)

#: on PostgreSQL and MariaDB, the tests whose outcome depends on the database: the
#: tables, the fenced statements and the real workers (settings, checks and
#: the pytest plugin do not change with it)
POSTGRES_TESTS = [
    DJANGO_APP / "test_schema.py",
    DJANGO_APP / "test_orm_fencing.py",
    DJANGO_APP / "test_workers.py",
    DJANGO_APP / "test_exactly_once.py",
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
