"""The Django tests (tests/django_app and the shop's), on SQLite, PostgreSQL and MariaDB.

Django's settings are one per process, and pytest-django is off in this
suite (``-p no:django``), so each database gets a pytest process of its own
on ``example_project/django_shop/pytest.ini``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import MariadbServer, PostgresServer

REPO_ROOT = Path(__file__).resolve().parents[2]
SHOP = REPO_ROOT / "example_project" / "django_shop"
INI = SHOP / "pytest.ini"
DJANGO_APP = REPO_ROOT / "tests" / "django_app"
#: the shop's own tests (with their fixtures in tests/conftest.py), then the
#: tests of celery_leases.contrib.django
TESTS = [SHOP / "tests" / "test_orders.py", DJANGO_APP]
#: on PostgreSQL and MariaDB, the tests whose outcome depends on the database: the
#: tables, the fenced statements and the real workers (settings, checks and
#: the pytest plugin do not change with it)
POSTGRES_TESTS = [
    DJANGO_APP / "test_schema.py",
    DJANGO_APP / "test_orm_fencing.py",
    DJANGO_APP / "test_workers.py",
    DJANGO_APP / "test_exactly_once.py",
]


def _arguments(tests: list[Path]) -> list[str]:
    """pytest's arguments for ``tests``. A file outside the shop's folder is
    named by its folder and ``-k``: given by its own path, pytest would show
    its tests' ids without the file's name."""
    outside = [t for t in tests if t.suffix == ".py" and SHOP not in t.parents]
    arguments = [str(t) for t in tests if t not in outside]
    arguments += sorted({str(t.parent) for t in outside})
    if outside:
        arguments += ["-k", " or ".join(t.stem for t in outside)]
    return arguments


def run_django_tests(tmp_path: Path, tests: list[Path], **env: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(INI), "-v", *_arguments(tests)],
        cwd=SHOP,
        env={
            **os.environ,
            "SHOP_DATA": str(tmp_path),
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    summary = output.strip().splitlines()[-1]
    passed = re.search(r"\b(\d+) passed\b", summary)
    assert passed, output
    # every test module given ran: none was left out of collection
    modules = [m for t in tests for m in ([t] if t.suffix == ".py" else t.glob("test_*.py"))]
    for module in modules:
        assert f"{module.name}::" in output, f"{module.name} did not run:\n{output}"
    assert not re.search(r"skipped|xfailed|error", summary), output
    return summary


def test_the_django_tests_pass_on_sqlite(tmp_path: Path) -> None:
    run_django_tests(tmp_path, TESTS)


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
