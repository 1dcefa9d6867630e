"""``lease_queue_unique`` is checked where the task is defined: a task
without a usable ``lease_key`` is refused there, not at its first send or
at the worker's start.

The ``app`` fixture is a fresh app without settings
(``tests/unit/conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_leases import LeaseConfigurationError, LeasedTask


def _define(app: Celery, **options: Any) -> Any:
    app.conf.leases_store = "memory://"
    app.finalize()  # a finalized app makes the task class at the decorator

    @app.task(shared=False, base=LeasedTask, bind=True, name="reports.build", **options)
    def build(self: LeasedTask, user_id: int) -> None:
        pass

    return build


def test_a_task_without_a_lease_key_is_refused_at_its_decorator(app: Celery) -> None:
    with pytest.raises(
        LeaseConfigurationError,
        match=r"task 'reports\.build' sets lease_queue_unique but no lease_key",
    ):
        _define(app, lease_queue_unique=True)
    assert "reports.build" not in app.tasks


@pytest.mark.parametrize("key", ["", 42], ids=["empty", "not-a-string-or-callable"])
def test_a_task_whose_lease_key_builds_no_key_is_refused_at_its_decorator(
    app: Celery, key: object
) -> None:
    with pytest.raises(
        LeaseConfigurationError,
        match=rf"task 'reports\.build' sets lease_queue_unique with lease_key={key!r}",
    ):
        _define(app, lease_queue_unique=600, lease_key=key)


def test_an_invalid_bound_is_refused_at_the_decorator(app: Celery) -> None:
    with pytest.raises(LeaseConfigurationError, match=r"reports\.build\.lease_queue_unique"):
        _define(app, lease_queue_unique=0, lease_key="report-{user_id}")


@pytest.mark.parametrize("key", ["report-{user_id}", "nightly", lambda user_id: f"r{user_id}"])
def test_a_task_with_a_key_is_defined(app: Celery, key: object) -> None:
    build = _define(app, lease_queue_unique=True, lease_key=key)
    assert build.lease_queue_unique is True


def test_a_task_class_without_a_key_is_refused_at_its_class_statement() -> None:
    with pytest.raises(
        LeaseConfigurationError, match=r"task 'reports\.nightly' sets lease_queue_unique"
    ):

        class Nightly(LeasedTask):  # type: ignore[misc]
            name = "reports.nightly"
            lease_queue_unique = True


def test_a_base_class_leaves_the_key_to_its_tasks(app: Celery) -> None:
    class Unique(LeasedTask):  # type: ignore[misc]
        lease_queue_unique = True  # names no task: its tasks give the key

    app.conf.leases_store = "memory://"
    app.finalize()

    @app.task(shared=False, base=Unique, bind=True, name="reports.keyed", lease_key="k")
    def keyed(self: LeasedTask) -> None:
        pass

    assert keyed.lease_queue_unique is True
    with pytest.raises(LeaseConfigurationError, match=r"'reports\.keyless' sets lease_queue"):

        @app.task(shared=False, base=Unique, bind=True, name="reports.keyless")
        def keyless(self: LeasedTask) -> None:
            pass


def test_an_option_given_by_task_annotations_is_refused_where_the_task_is_bound(
    app: Celery,
) -> None:
    app.conf.task_annotations = {"reports.build": {"lease_queue_unique": True}}
    with pytest.raises(
        LeaseConfigurationError,
        match=r"task 'reports\.build' sets lease_queue_unique but no lease_key",
    ):
        _define(app)


def test_a_task_class_registered_without_a_name_is_refused_at_its_registration(
    app: Celery,
) -> None:
    class Nightly(LeasedTask):  # type: ignore[misc]
        lease_queue_unique = True  # no name yet: the registration gives it

        def run(self) -> None:
            pass

    app.conf.leases_store = "memory://"
    with pytest.raises(LeaseConfigurationError, match=r"Nightly' sets lease_queue_unique"):
        app.register_task(Nightly())
