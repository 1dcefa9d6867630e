"""Misspelled settings and task attributes are named with the closest valid one."""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

import celery_leases
from celery_leases import LeaseConfigurationError, LeasedTask
from celery_leases.checks import run_checks
from celery_leases.spelling import SETTINGS, misspelled_settings
from celery_leases.task import forget_runtime
from celery_leases.worker import check_app

PACKAGE = Path(celery_leases.__file__).parent


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("spelling", set_as_current=False)
    app.conf.leases_store = "memory://"
    yield app
    forget_runtime(app)
    app.close()


def test_every_setting_the_code_reads_is_known() -> None:
    read = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r'get\("(leases_\w+)"', text))
        read |= set(re.findall(r"conf\.(leases_\w+)", text))
    assert read
    assert read <= SETTINGS


def test_a_misspelled_setting_warns_at_start_naming_the_closest(app: Celery) -> None:
    app.conf.leases_tll = 5
    warnings = check_app(app, pool="prefork")
    assert any("'leases_tll'" in w and "did you mean 'leases_ttl'?" in w for w in warnings)


def test_a_setting_without_the_s_is_named_too(app: Celery) -> None:
    app.conf.lease_ttl = 5
    assert misspelled_settings(app.conf) == [
        "the setting 'lease_ttl' is not a celery-leases setting and is ignored; "
        "did you mean 'leases_ttl'?"
    ]


def test_valid_settings_give_no_warning(app: Celery) -> None:
    app.conf.leases_ttl = 5
    app.conf.leases_metrics_port = None
    assert misspelled_settings(app.conf) == []


def test_a_misspelled_store_setting_is_named_in_the_missing_store_error() -> None:
    app = Celery("spelling-store", set_as_current=False)
    app.conf.leases_stor = "memory://"
    try:
        with pytest.raises(LeaseConfigurationError, match="did you mean 'leases_store'"):
            check_app(app, pool="prefork")
    finally:
        app.close()


def test_a_misspelled_task_keyword_warns_naming_the_attribute(app: Celery) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True, lease_tll=5)
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    warnings = check_app(app, pool="prefork")
    assert any(
        "sets 'lease_tll'" in w and "did you mean 'lease_ttl'?" in w and job.name in w
        for w in warnings
    )


def test_a_misspelled_attribute_of_a_subclass_warns(app: Celery) -> None:
    class Report(LeasedTask):  # type: ignore[misc]
        lease_on_lots = "raise"

    @app.task(shared=False, base=Report, bind=True)
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    warnings = check_app(app, pool="prefork")
    assert any("'lease_on_lots'" in w and "did you mean 'lease_on_lost'?" in w for w in warnings)


def test_correct_task_attributes_give_no_warning(app: Celery) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=5, lease_key="job:{0}")
    def job(self: LeasedTask, n: int) -> None:
        pass

    app.finalize()
    assert check_app(app, pool="prefork") == []


def test_check_reports_the_misspelled_setting(app: Celery) -> None:
    app.conf.leases_tll = 5
    report = run_checks(app)
    assert ("settings", "warning") in [(c.name, c.status) for c in report]
    assert any("did you mean 'leases_ttl'?" in c.detail for c in report)


def test_check_reports_an_error_and_the_warnings_at_once(app: Celery) -> None:
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    app.conf.broker_transport_options = {"visibility_timeout": 10}

    @app.task(shared=False, base=LeasedTask, bind=True, acks_late=False)
    def broken(self: LeasedTask) -> None:
        pass

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=30)
    def slow(self: LeasedTask) -> None:
        pass

    app.finalize()
    report = run_checks(app)
    details = {(c.status, c.detail.split(":")[0]) for c in report}
    assert any(c.status == "error" and "acks_late=False" in c.detail for c in report), details
    assert any(c.status == "warning" and "visibility_timeout (10 s)" in c.detail for c in report)


def test_a_setting_under_the_apps_namespace_is_named_in_its_own_spelling() -> None:
    # as a Django project configures Celery: config_from_object(..., namespace="CELERY")
    settings = types.ModuleType("django_settings")
    settings.CELERY_LEASES_STORE = "memory://"  # type: ignore[attr-defined]
    settings.CELERY_LEASES_TLL = 5  # type: ignore[attr-defined]
    settings.CELERY_leases_renew_intreval = 1  # type: ignore[attr-defined]
    settings.CELERY_BROKER_URL = "memory://"  # type: ignore[attr-defined]
    app = Celery("namespaced", set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")
    assert misspelled_settings(app.conf) == [
        "the setting 'CELERY_LEASES_TLL' is not a celery-leases setting and is ignored; "
        "did you mean 'CELERY_LEASES_TTL'?",
        "the setting 'CELERY_leases_renew_intreval' is not a celery-leases setting and is "
        "ignored; did you mean 'CELERY_leases_renew_interval'?",
    ]
    app.close()
