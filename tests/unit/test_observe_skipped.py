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


def test_a_signal_remembers_its_receivers_per_sender_and_forgets_them_on_connect() -> None:
    class Sender:
        pass

    sender = Sender()
    calls: list[str] = []

    def first(**_: object) -> None:
        calls.append("first")

    def second(**_: object) -> None:
        calls.append("second")

    signal = signals.lease_claimed
    signal.connect(first, sender=sender, weak=False)
    try:
        signal.send(sender=sender, lease=None, job_id="j", takeovers=0)
        assert sender in signal.sender_receivers_cache  # looked up once, then kept
        signal.connect(second, sender=sender, weak=False)
        signal.send(sender=sender, lease=None, job_id="j", takeovers=0)
    finally:
        signal.disconnect(first, sender=sender)
        signal.disconnect(second, sender=sender)
    assert calls == ["first", "first", "second"]
    signal.send(sender=sender, lease=None, job_id="j", takeovers=0)
    assert calls == ["first", "first", "second"]
    # a sender that cannot be kept in the cache is looked up each time
    assert signal.has_listeners() == bool(signal.receivers)
