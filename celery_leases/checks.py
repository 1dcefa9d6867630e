"""One report of everything that can make leases unsafe or slow, for ``celery leases check``.

It gathers what a worker warns about at start
(:func:`celery_leases.worker.check_app`), whether the store answers, what
the Redis store warns about its server (persistence, eviction), and how far
this host's clock is from the store's.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.runtime import forget_runtime, settings_for
from celery_leases.spelling import as_spelled, misspelled_settings
from celery_leases.stores import is_sql_url, open_store, table_maker
from celery_leases.urls import url_scheme
from celery_leases.worker import SQLITE_PAUSE_WARNING, check_app

__all__ = ["Check", "run_checks"]

Status = Literal["ok", "warning", "error"]

#: a clock offset above this many seconds is reported (leases never compare
#: a worker's clock with the store's, but people reading times do)
CLOCK_OFFSET_WARNING = 1.0


@dataclass(frozen=True)
class Check:
    """One line of the report; ``exit_code`` matters for errors only."""

    name: str
    status: Status
    detail: str
    exit_code: int = 0


def run_checks(app: Any) -> list[Check]:
    """Check ``app``'s lease settings, tasks and store; never raises for a finding.

    Settings are named as the app's configuration spells them
    (``CELERY_LEASES_TTL`` in a Django project).
    """
    return [
        dataclasses.replace(check, detail=as_spelled(check.detail, app.conf))
        for check in _checks(app)
    ]


def _checks(app: Any) -> list[Check]:
    report: list[Check] = []
    # the task modules a worker imports at start (imports, include, a Django
    # project's autodiscovered tasks.py), so their leased tasks are checked
    app.loader.import_default_modules()
    forget_runtime(app)  # read the configuration as it is now
    try:
        settings = settings_for(app)
    except LeaseConfigurationError as exc:
        hints = misspelled_settings(app.conf)
        detail = f"{exc} ({'; '.join(hints)})" if hints else str(exc)
        return [Check("settings", "error", detail, exit_code=5)]
    report.append(
        Check(
            "settings", "ok", f"store {url_scheme(settings.store_url)}://, ttl {settings.ttl:g} s"
        )
    )
    if is_sql_url(settings.store_url):
        # the worker's start checks would create a missing table; a check must not
        options = {**dict(settings.store_options), "create_table": False}
        app.conf.leases_store_options = options
        forget_runtime(app)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report.extend(_store_checks(settings.store_url, dict(settings.store_options)))
        errors: list[str] = []  # every mistake at once, beside the warnings
        try:
            app_warnings = check_app(app, errors=errors)
        except LeaseConfigurationError as exc:
            errors.append(str(exc))
            app_warnings = []
    store_failed = any(c.name == "store" and c.status == "error" for c in report)
    for message in errors:
        # the store's own check has said why it cannot be used
        if not (store_failed and message.startswith("the lease store cannot be used")):
            report.append(Check("tasks", "error", message, exit_code=5))
    seen: set[str] = set()
    named = [("store", str(w.message)) for w in caught] + [(_topic(m), m) for m in app_warnings]
    for name, message in named:
        # an unreachable store is already an error of the "store" check
        if message not in seen and "cannot be reached" not in message:
            seen.add(message)
            report.append(Check(name, "warning", message))
    if not any(c.name == "tasks" for c in report):
        report.append(
            Check("tasks", "ok", "leased tasks, time limits and broker fit the lease ttl")
        )
    return report


def _topic(warning: str) -> str:
    """The report line a warning of :func:`check_app` belongs to."""
    if warning == SQLITE_PAUSE_WARNING:
        return "store"
    return "settings" if warning.startswith("the setting ") else "tasks"


def _store_checks(url: str, options: dict[str, Any]) -> list[Check]:
    if is_sql_url(url):
        options["create_table"] = False
    try:
        store = open_store(url, **options)
    except LeaseConfigurationError as exc:
        return [Check("store", "error", str(exc), exit_code=5)]
    except StoreUnavailable as exc:
        return [Check("store", "error", str(exc), exit_code=4)]
    try:
        before = time.time()
        try:
            store_now = store.now_ms() / 1000
            # reaches the table or keys, not only the server
            next(iter(store.records(limit=1)), None)
        except StoreUnavailable as exc:
            return [Check("store", "error", str(exc), exit_code=4)]
        except LeaseConfigurationError as exc:
            # reached, but refused: rights, or a SQL table not made yet
            maker = table_maker(url)
            hint = f" (a new database: {maker})" if maker else ""
            return [Check("store", "error", f"{exc}{hint}", exit_code=5)]
        after = time.time()
    finally:
        store.close()
    round_trip = after - before
    offset = store_now - (before + after) / 2
    checks = [Check("store", "ok", f"{store.url} answered in {round_trip * 1000:.1f} ms")]
    detail = f"store clock {offset:+.3f} s from this host's (within ±{round_trip / 2:.3f} s)"
    if abs(offset) - round_trip / 2 > CLOCK_OFFSET_WARNING:
        checks.append(
            Check(
                "clock",
                "warning",
                detail + ": leases use only the store's clock, but times shown to people "
                "and task ETAs compare clocks; synchronise this host with NTP",
            )
        )
    else:
        checks.append(Check("clock", "ok", detail))
    return checks
