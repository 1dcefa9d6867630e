"""What a Django project meets first: settings named as written, store URL
mistakes, the table the migration owns, a project that does not load its app."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection

from tests.django_app.conftest import SHOP
from tests.django_app.test_checks import check, django_app


def test_an_invalid_setting_is_named_as_the_project_writes_it() -> None:
    with django_app(CELERY_LEASES_TTL=-1), pytest.raises(SystemCheckError) as found:
        check()
    assert "the lease ttl (CELERY_LEASES_TTL / lease_ttl) must be" in str(found.value)
    assert "leases_ttl" not in str(found.value)


def test_a_typo_in_the_settings_prefix_is_reported() -> None:
    with django_app(CELERY_LEASSES_TTL=5, CELERY_LEASE_TTL=5, LEASES_DEFER_MAX=9):
        output = check()
    for typed, meant in [
        ("CELERY_LEASSES_TTL", "CELERY_LEASES_TTL"),
        ("CELERY_LEASE_TTL", "CELERY_LEASES_TTL"),
        ("LEASES_DEFER_MAX", "CELERY_LEASES_DEFER_MAX"),  # outside the namespace
    ]:
        assert (
            f"the setting {typed!r} is not a celery-leases setting and is ignored; "
            f"did you mean {meant!r}?" in output
        ), output


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("djang://default", "HINT: did you mean django://?"),
        ("django://other", "names the database alias 'other', which is not in DATABASES"),
    ],
)
def test_a_store_url_mistake_is_a_check_error_without_a_database(url: str, said: str) -> None:
    with django_app(CELERY_LEASES_STORE=url), pytest.raises(SystemCheckError) as found:
        check()
    assert said in str(found.value)
    assert "celery_leases.E002" in str(found.value)


def _python(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``cwd``; ``CELERY_APP`` only when ``env`` names it."""
    environ = {k: v for k, v in os.environ.items() if k != "CELERY_APP"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env={**environ, **env},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_before_migrate_the_check_says_migrate_and_init_db_leaves_the_table_to_it() -> None:
    call_command("migrate", "celery_leases", "zero", verbosity=0)
    try:
        with django_app():
            output = check("--database", "default")
        (warning,) = [line for line in output.splitlines() if "celery_leases.W002" in line]
        assert "(a new database: manage.py migrate)" in warning, output
        assert "init-db" not in output, output
        refused = _python(
            "-m", "celery", "-A", "shop", "leases", "init-db",
            cwd=SHOP, SHOP_DB_NAME=str(connection.settings_dict["NAME"]),
        )  # fmt: skip
        assert refused.returncode == 5, refused.stdout + refused.stderr
        assert "is made by manage.py migrate, which owns it" in refused.stderr
        # no table stands in the way of the migration
        assert "celery_leases" not in connection.introspection.table_names()
    finally:
        call_command("migrate", "celery_leases", verbosity=0)
    assert "celery_leases" in connection.introspection.table_names()


def test_a_project_that_does_not_load_its_celery_app_is_told_how(tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(SHOP, project, ignore=shutil.ignore_patterns("*.sqlite3", "broker"))
    (project / "shop" / "__init__.py").write_text("")  # the app is never imported
    # on MySQL, Django's model checks connect: to the test database, which exists
    database = str(connection.settings_dict["NAME"])
    checked = _python("manage.py", "check", cwd=project, SHOP_DB_NAME=database)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "no configured Celery app was found" in checked.stderr
    assert "in proj/__init__.py, `from .celery import app as celery_app`" in checked.stderr
    assert "leases_store setting is missing" not in checked.stderr
    # `celery leases check` without -A names what is missing
    without_app = _python("-m", "celery", "leases", "check", cwd=project, SHOP_DB_NAME=database)
    assert without_app.returncode == 5, without_app.stdout + without_app.stderr
    assert "no Celery app was given" in without_app.stdout
    assert "celery -A proj leases check" in without_app.stdout
