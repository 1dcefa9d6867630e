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

import difflib
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.core import checks
from django.db import connections
from django.db.migrations.recorder import MigrationRecorder

from celery_leases.checks import Check, run_checks
from celery_leases.contrib.django.store import SCHEME, database_alias
from celery_leases.errors import LeaseConfigurationError
from celery_leases.redact import mask
from celery_leases.settings import LeaseSettings
from celery_leases.spelling import as_spelled, misspelled_settings
from celery_leases.stores import known_schemes, scheme_is_known
from celery_leases.urls import url_scheme

__all__ = ["check_leases", "check_settings", "register"]

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


#: how Celery's Django guide loads the project's app when Django starts
_LOAD_THE_APP = (
    "load the project's Celery app when Django starts, as Celery's Django guide does: "
    "in proj/__init__.py, `from .celery import app as celery_app` and "
    "`__all__ = ('celery_app',)`, with proj/celery.py calling "
    "app.config_from_object('django.conf:settings', namespace='CELERY')"
)


def _store_url_errors(url: str) -> list[checks.CheckMessage]:
    """Mistakes in the store URL that need no database: an unknown scheme, an unknown alias."""
    scheme = url_scheme(url)
    if not scheme_is_known(url):
        close = difflib.get_close_matches(scheme, known_schemes(), n=1)
        return [
            checks.Error(
                f"celery-leases settings: the lease store URL {mask(url)!r} has the scheme "
                f"{scheme or url!r}, which no lease store has",
                hint=(f"did you mean {close[0]}://? " if close else "")
                + f"the schemes: {', '.join(s + '://' for s in known_schemes())}",
                id="celery_leases.E002",
            )
        ]
    if scheme == SCHEME:
        try:
            database_alias(url)
        except LeaseConfigurationError as exc:
            return [
                checks.Error(
                    f"celery-leases settings: {exc}",
                    hint=f"name one of {sorted(settings.DATABASES)}: django://<alias>",
                    id="celery_leases.E002",
                )
            ]
    return []


def check_settings(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """The ``CELERY_LEASES_*`` settings, as Django check messages (no database needed)."""
    app = _celery_app()
    if not app.conf.get("leases_store") and getattr(settings, "CELERY_LEASES_STORE", None):
        # the current app is Celery's fallback, or an app that does not read
        # Django's settings: none of the CELERY_LEASES_* settings are read
        return [
            checks.Error(
                "celery-leases settings: no configured Celery app was found: "
                "CELERY_LEASES_STORE is set, but the current Celery app "
                f"({app.main!r}) does not read Django's settings",
                hint=_LOAD_THE_APP,
                id="celery_leases.E003",
            )
        ]
    found: list[checks.CheckMessage] = []
    try:
        lease_settings = LeaseSettings.from_conf(app.conf)
    except LeaseConfigurationError as exc:
        found.append(
            checks.Error(
                f"celery-leases settings: {as_spelled(str(exc), app.conf)}",
                id="celery_leases.E001",
            )
        )
    else:
        found.extend(_store_url_errors(lease_settings.store_url))
    found.extend(
        checks.Warning(f"celery-leases settings: {message}", id="celery_leases.W001")
        for message in misspelled_settings(app.conf)
    )
    return found


def check_leases(
    app_configs: Any = None, databases: Sequence[str] | None = None, **_: Any
) -> list[checks.CheckMessage]:
    """The store, broker and task checks, as Django check messages, when a
    database is named; the settings are :func:`check_settings`'s."""
    if not databases:
        return []
    unmigrated = _unmigrated(databases)
    return [
        _message(check, unmigrated)
        for check in run_checks(_celery_app())
        if check.status != "ok" and check.name != "settings"
    ]


def register() -> None:
    """Add the lease checks to Django's; called when Django starts the app.

    :func:`check_leases` opens the store, so it is tagged ``database``: it
    runs when a database is named (``check --database``, ``migrate``). Django
    6 hands every check all the databases unless told otherwise, and runs a
    ``database`` check only when one is named; Celery's Django fixup runs the
    checks at worker start without one, from inside :func:`run_checks`.
    """
    checks.register(check_settings, "celery_leases")
    checks.register(check_leases, "celery_leases", checks.Tags.database)
