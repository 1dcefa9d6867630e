"""CELERY_LEASES_* settings: misspellings named, ``manage.py check`` reports the store."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from celery_leases.spelling import misspelled_settings


@contextlib.contextmanager
def django_app(**overrides: Any) -> Iterator[Any]:
    """A fresh app on the settings with ``overrides``, configured as a Django project's is.

    It is the current app (the one the system check reads) inside the block.
    """
    from shop.celery import app as shop_app

    with override_settings(**overrides):
        app = Celery("checked", set_as_current=True)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        app.autodiscover_tasks()
        app.conf.leases_store  # noqa: B018 - read the settings now, overridden
        try:
            yield app
        finally:
            shop_app.set_current()


def check(*args: str) -> str:
    out = io.StringIO()
    call_command("check", *args, stdout=out, stderr=out)
    return out.getvalue()


def test_a_misspelled_setting_names_the_closest_one_in_the_projects_spelling() -> None:
    with django_app(CELERY_LEASES_TLL=5, CELERY_LEASE_STORE="x") as app:
        assert misspelled_settings(app.conf) == [
            "the setting 'CELERY_LEASES_TLL' is not a celery-leases setting and is ignored; "
            "did you mean 'CELERY_LEASES_TTL'?",
            "the setting 'CELERY_LEASE_STORE' is not a celery-leases setting and is ignored; "
            "did you mean 'CELERY_LEASES_STORE'?",
        ]
        assert app.conf.leases_ttl == 3  # the spelled setting is still read


def test_manage_py_check_warns_about_a_misspelled_setting() -> None:
    with django_app(CELERY_LEASES_TLL=5):
        assert "did you mean 'CELERY_LEASES_TTL'?" in check()


def test_manage_py_check_refuses_an_invalid_setting() -> None:
    with django_app(CELERY_LEASES_TTL=-1), pytest.raises(SystemCheckError, match="lease ttl"):
        check()


@pytest.mark.django_db(transaction=True)
def test_check_with_a_database_reaches_the_store_and_its_table() -> None:
    with django_app():
        output = check("--database", "default")
    # the one warning of the shop's SQLite database: nothing bounds how long
    # a paused worker holds its write lock
    assert output.count("celery_leases.W") == 1
    assert "celery_leases.W001) celery-leases store: the lease store is SQLite" in output
    call_command("migrate", "celery_leases", "zero", verbosity=0)
    try:
        with django_app():
            # before `migrate` makes the table, its absence is a warning
            assert "celery_leases.W002" in check("--database", "default")
        # once the migration is recorded, a missing table is an error
        call_command("migrate", "celery_leases", fake=True, verbosity=0)
        with django_app(), pytest.raises(SystemCheckError, match="celery-leases store"):
            check("--database", "default")
    finally:
        call_command("migrate", "celery_leases", "zero", fake=True, verbosity=0)
        call_command("migrate", "celery_leases", verbosity=0)


@pytest.mark.django_db(transaction=True)
def test_check_with_a_database_reports_a_visibility_timeout_below_the_ttl() -> None:
    broker = {
        "CELERY_BROKER_URL": "redis://localhost:6379/0",
        "CELERY_BROKER_TRANSPORT_OPTIONS": {"visibility_timeout": 1},
    }
    with django_app(**broker):
        output = check("--database", "default")
    assert "celery_leases.W001" in output
    assert "visibility_timeout (1 s) is shorter than the lease ttl" in output
    # the settings named as the project writes them
    assert "set CELERY_LEASES_BROKER_KEEP_INVISIBLE = True" in output, output
    assert "raise CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout']" in output, output
    for celery_key in ("broker_transport_options", "leases_broker_keep_invisible"):
        assert celery_key not in output, output


@pytest.mark.django_db(transaction=True)
def test_the_store_is_checked_only_when_a_database_is_named() -> None:
    # a store nobody listens on: only the store check can find that out
    with django_app(CELERY_LEASES_STORE="redis://127.0.0.1:1/0", CELERY_LEASES_TLL=5):
        plain = check()
        assert "celery-leases store" not in plain
        assert "did you mean 'CELERY_LEASES_TTL'?" in plain
        with pytest.raises(SystemCheckError, match="celery-leases store") as found:
            check("--database", "default")
    # the settings are reported once, by the settings check
    assert str(found.value).count("did you mean 'CELERY_LEASES_TTL'?") == 1
