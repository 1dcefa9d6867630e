"""``lease_on_busy`` and ``leases_on_busy``: checked where they are written,
and a skipped call reported in the transition log.

The ``app`` fixture is a fresh app without settings
(``tests/unit/conftest.py``)."""

from __future__ import annotations

import logging
import types

import pytest
from celery import Celery

from celery_leases import LeaseConfigurationError, LeasedTask, LeaseSettings, LeaseSkipped, observe
from celery_leases.errors import LeaseError, LeaseHeld
from celery_leases.spelling import misspelled_settings, misspelled_task_attributes
from celery_leases.worker import check_app


def test_the_default_is_wait_and_skip_is_accepted() -> None:
    assert LeaseSettings(store_url="memory://").on_busy == "wait"
    conf = {"leases_store": "memory://", "leases_on_busy": "skip"}
    assert LeaseSettings.from_conf(conf).on_busy == "skip"


def test_a_misspelled_mode_in_the_settings_is_refused_naming_the_setting() -> None:
    with pytest.raises(LeaseConfigurationError, match=r"leases_on_busy must be one of 'wait', "):
        LeaseSettings.from_conf({"leases_store": "memory://", "leases_on_busy": "skp"})


def test_the_django_spelling_of_the_setting_is_read_and_checked() -> None:
    settings = types.ModuleType("django_settings")
    settings.CELERY_LEASES_STORE = "memory://"  # type: ignore[attr-defined]
    settings.CELERY_LEASES_ON_BUSY = "skp"  # type: ignore[attr-defined]
    app = Celery("namespaced", set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")
    try:
        assert misspelled_settings(app.conf) == []
        with pytest.raises(LeaseConfigurationError, match=r"leases_on_busy must be one of"):
            LeaseSettings.from_conf(app.conf)
    finally:
        app.close()


def test_a_misspelled_mode_on_a_task_is_refused_where_the_task_is_defined(app: Celery) -> None:
    app.conf.leases_store = "memory://"
    app.finalize()  # a finalized app makes the task class at the decorator
    with pytest.raises(LeaseConfigurationError, match=r"busy\.job\.lease_on_busy must be one of"):

        @app.task(shared=False, base=LeasedTask, bind=True, name="busy.job", lease_on_busy="skp")
        def job(self: LeasedTask) -> None:
            pass


def test_a_misspelled_mode_on_a_subclass_is_refused_at_its_class_statement() -> None:
    with pytest.raises(LeaseConfigurationError, match=r"Busy\.lease_on_busy must be one of"):

        class Busy(LeasedTask):  # type: ignore[misc]
            lease_on_busy = "skp"  # type: ignore[assignment]


def test_a_misspelled_setting_stops_the_worker_at_start(app: Celery) -> None:
    app.conf.leases_store = "memory://"
    app.conf.leases_on_busy = "skp"

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    with pytest.raises(LeaseConfigurationError, match=r"leases_on_busy must be one of"):
        check_app(app, pool="prefork")


def test_a_mode_set_on_the_task_after_its_definition_stops_the_worker_at_start(
    app: Celery,
) -> None:
    app.conf.leases_store = "memory://"

    @app.task(shared=False, base=LeasedTask, bind=True, name="busy.late")
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    type(app.tasks["busy.late"]).lease_on_busy = "skp"
    with pytest.raises(LeaseConfigurationError, match=r"busy\.late\.lease_on_busy must be one of"):
        check_app(app, pool="prefork")


def test_the_task_mode_wins_over_the_setting(app: Celery) -> None:
    app.conf.leases_store = "memory://"
    app.conf.leases_on_busy = "wait"

    @app.task(shared=False, base=LeasedTask, bind=True, lease_on_busy="skip")
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    assert job.lease_options().on_busy == "skip"


def test_the_attribute_is_known_to_the_spelling_check_and_a_typo_is_named(app: Celery) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True, lease_on_bussy="skip")
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    assert misspelled_task_attributes(app.tasks[job.name], LeasedTask) == [
        f"task {job.name!r} sets 'lease_on_bussy', which is not a LeasedTask attribute and "
        "is ignored; did you mean 'lease_on_busy'?"
    ]


def test_a_skipped_call_is_an_expected_error_for_celery_also_with_the_tasks_own_throws(
    app: Celery,
) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True, throws=(KeyError,))
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    assert set(job.throws) == {KeyError, LeaseSkipped}
    assert issubclass(LeaseSkipped, LeaseHeld)
    assert issubclass(LeaseSkipped, LeaseError)


def test_a_busy_skip_is_logged_with_the_holders_task_id(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> None:
        pass

    caplog.set_level(logging.INFO, logger="celery_leases.transitions")
    observe._skipped(
        job, job_id="j1", generation=7, task_id="t2", reason="busy", holder_task_id="t1"
    )
    [line] = [r for r in caplog.records if r.name == "celery_leases.transitions"]
    assert line.getMessage() == (
        "lease skipped: job=j1 task=t2 generation=7 reason=busy holder_task_id=t1"
    )
