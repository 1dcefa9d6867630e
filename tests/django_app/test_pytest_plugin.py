"""leases_worker under pytest-django: a test wrapped in a transaction is told at once."""

from __future__ import annotations

import pytest


@pytest.fixture
def leases_app() -> object:
    from shop.celery import app

    return app


@pytest.fixture
def lease_store_url() -> str:
    return "django://default"


@pytest.mark.django_db
def test_leases_worker_refuses_a_test_run_inside_a_transaction(
    request: pytest.FixtureRequest,
) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"django_db\(transaction=True\)"):
        request.getfixturevalue("leases_worker")


@pytest.mark.django_db(transaction=True)
def test_leases_worker_takes_a_transactional_test(request: pytest.FixtureRequest) -> None:
    from celery_leases.pytest_plugin import _in_django_test_transaction

    assert not _in_django_test_transaction(request)


def test_leases_worker_takes_a_test_without_the_database(request: pytest.FixtureRequest) -> None:
    from celery_leases.pytest_plugin import _in_django_test_transaction

    assert not _in_django_test_transaction(request)
