"""The ``lease_skipped`` receiver, ready for task runners that send that signal."""

from __future__ import annotations

import logging

import pytest
from celery import Celery

from celery_leases import LeasedTask, observe, signals


def test_a_skipped_copy_is_logged_with_the_completed_generation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Celery("skipped", set_as_current=False)

    @app.task(shared=False, base=LeasedTask, bind=True, name="skipped.job")
    def job(self: LeasedTask) -> None:
        pass

    caplog.set_level(logging.INFO, logger="celery_leases.transitions")
    try:
        observe._skipped(job, job_id="j1", generation=7, task_id="t1")
    finally:
        app.close()
    (record,) = [r for r in caplog.records if r.name == "celery_leases.transitions"]
    assert record.getMessage() == "lease skipped: job=j1 task=t1 generation=7 owner=None"
    assert (record.lease_transition, record.job_id, record.generation) == ("skipped", "j1", 7)  # type: ignore[attr-defined]


def test_the_receiver_is_connected_when_the_signal_exists() -> None:
    skipped = getattr(signals, "lease_skipped", None)
    if skipped is None:
        pytest.skip("this task runner does not send lease_skipped yet")
    assert skipped.has_listeners()
