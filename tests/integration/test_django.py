"""The Django tests (tests/django_app and the shop's), on SQLite and on PostgreSQL,
with this Python's Django (the LTS); tests/packaging/test_django_latest.py
runs them with the newest Django.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.django_runner import DJANGO_APP, TESTS, run_django_tests
from tests.servers import PostgresServer

#: on PostgreSQL, the tests whose outcome depends on the database: the
#: tables, the fenced statements and the real workers (settings, checks and
#: the pytest plugin do not change with it)
POSTGRES_TESTS = [
    DJANGO_APP / "test_schema.py",
    DJANGO_APP / "test_orm_fencing.py",
    DJANGO_APP / "test_workers.py",
    DJANGO_APP / "test_exactly_once.py",
]


def test_the_django_tests_pass_on_sqlite(tmp_path: Path) -> None:
    run_django_tests(tmp_path, TESTS)


@pytest.mark.postgres
def test_the_django_tests_pass_on_postgresql(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.url.replace("postgresql+psycopg://", "postgresql://")
    run_django_tests(tmp_path, POSTGRES_TESTS, SHOP_POSTGRES=url)
