"""leases_worker under pytest-django: a test wrapped in a transaction is told at once."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

pytest_plugins = ["pytester"]

INNER = """
import pytest

@pytest.fixture
def leases_app():
    from shop.celery import app
    return app

@pytest.fixture
def lease_store_url():
    return "django://default"

@pytest.mark.django_db
def test_wrapped(leases_worker):
    pass
"""


def test_leases_worker_refuses_a_test_run_inside_a_transaction(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_inner=INNER)
    # the inner run's test database must not be the outer run's
    monkeypatch.setenv("SHOP_DATA", str(pytester.path))
    monkeypatch.setenv("SHOP_DB_NAME", f"inner_{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    result = pytester.runpytest_subprocess("-p", "django", "--ds=shop.settings", "-q")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*use @pytest.mark.django_db(transaction=True)*"])
