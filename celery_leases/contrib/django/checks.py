"""``manage.py check`` for the lease settings and store, from :mod:`celery_leases.checks`.

The Celery app is ``celery.current_app``: the app a Django project's
``proj/celery.py`` makes and ``proj/__init__.py`` imports. Without a
database (``manage.py check``) only the ``CELERY_LEASES_*`` settings are
checked; with one (``manage.py check --database default``, and before
``migrate``) everything ``celery leases check`` reports is: the store
answers and has its table, the broker's ``acks_late`` and visibility
timeout fit the lease, leased tasks, misspelled settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core import checks
from django.db import connections
from django.db.migrations.recorder import MigrationRecorder

from celery_leases.checks import Check, run_checks
from celery_leases.errors import LeaseConfigurationError
from celery_leases.settings import LeaseSettings
from celery_leases.spelling import misspelled_settings

__all__ = ["check_leases", "register"]

_APP_LABEL = "celery_leases"


def _celery_app() -> Any:
    from celery import current_app

    return current_app._get_current_object()


def _unmigrated(databases: Sequence[str]) -> list[str]:
    missing = []
    for alias in databases:
        applied = MigrationRecorder(connections[alias]).applied_migrations()
        if (_APP_LABEL, "0001_initial") not in applied:
            missing.append(alias)
    return missing


def _message(check: Check, unmigrated: list[str]) -> checks.CheckMessage:
    text = f"celery-leases {check.name}: {check.detail}"
    if check.status == "error":
        if check.name == "store" and unmigrated:
            # `migrate` runs these checks before it creates the table
            return checks.Warning(
                text,
                hint=f"apply the migrations of {_APP_LABEL} on {unmigrated}: manage.py migrate",
                id="celery_leases.W002",
            )
        return checks.Error(text, id="celery_leases.E001")
    return checks.Warning(text, id="celery_leases.W001")


def check_leases(
    app_configs: Any = None, databases: Sequence[str] | None = None, **_: Any
) -> list[checks.CheckMessage]:
    """The lease checks, as Django check messages (errors, then warnings)."""
    app = _celery_app()
    if databases is None:
        found: list[checks.CheckMessage] = []
        try:
            LeaseSettings.from_conf(app.conf)
        except LeaseConfigurationError as exc:
            found.append(checks.Error(f"celery-leases settings: {exc}", id="celery_leases.E001"))
        found.extend(
            checks.Warning(f"celery-leases settings: {message}", id="celery_leases.W001")
            for message in misspelled_settings(app.conf)
        )
        return found
    unmigrated = _unmigrated(databases)
    return [_message(check, unmigrated) for check in run_checks(app) if check.status != "ok"]


def register() -> None:
    """Add :func:`check_leases` to Django's checks; called when Django starts the app."""
    checks.register(check_leases, "celery_leases")
