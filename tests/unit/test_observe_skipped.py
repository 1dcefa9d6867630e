"""The ``lease_skipped`` receiver, ready for task runners that send that signal."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_leases import LeasedTask, observe, signals


@pytest.fixture
def job(caplog: pytest.LogCaptureFixture) -> Iterator[LeasedTask]:
    """A leased task of a fresh app; transition lines at INFO are captured."""
    app = Celery("transitions", set_as_current=False)

    @app.task(shared=False, base=LeasedTask, bind=True, name="transitions.job")
    def leased(self: LeasedTask) -> None:
        pass

    caplog.set_level(logging.INFO, logger="celery_leases.transitions")
    try:
        yield leased
    finally:
        app.close()


def _line(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    (record,) = [r for r in caplog.records if r.name == "celery_leases.transitions"]
    return record


def test_a_skipped_copy_is_logged_with_the_completed_generation(
    job: LeasedTask, caplog: pytest.LogCaptureFixture
) -> None:
    observe._skipped(job, job_id="j1", generation=7, task_id="t1")
    record = _line(caplog)
    assert record.getMessage() == "lease skipped: job=j1 task=t1 generation=7"
    assert (record.lease_transition, record.job_id, record.generation) == ("skipped", "j1", 7)  # type: ignore[attr-defined]


def test_a_deferred_copy_is_logged_without_a_generation_or_owner_it_does_not_have(
    job: LeasedTask, caplog: pytest.LogCaptureFixture
) -> None:
    observe._deferred(job, job_id="j1", reason="held", countdown=1.0, deferrals=1, holder="h:12:ab")
    assert _line(caplog).getMessage() == (
        "lease deferred: job=j1 task=None reason=held countdown=1.0 deferrals=1 holder=h:12:ab"
    )


def test_the_receiver_is_connected_when_the_signal_exists() -> None:
    skipped = getattr(signals, "lease_skipped", None)
    if skipped is None:
        pytest.skip("this task runner does not send lease_skipped yet")
    assert skipped.has_listeners()


def test_a_receiver_connected_for_a_sender_gets_the_sends_after_it_connects() -> None:
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
        signal.connect(second, sender=sender, weak=False)
        signal.send(sender=sender, lease=None, job_id="j", takeovers=0)
    finally:
        signal.disconnect(first, sender=sender)
        signal.disconnect(second, sender=sender)
    assert calls == ["first", "first", "second"]
    signal.send(sender=sender, lease=None, job_id="j", takeovers=0)
    assert calls == ["first", "first", "second"]
