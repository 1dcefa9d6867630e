"""The claimed and completed signals of a run: always sent, through Celery's ``Signal.send``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

import celery_leases
from celery_leases import LeasedTask, signals
from celery_leases.task import forget_runtime


@pytest.fixture
def job() -> Iterator[LeasedTask]:
    """A leased task of a fresh app on the memory store, its events off."""
    app = Celery("observe-send", set_as_current=False)
    app.conf.leases_store = "memory://"
    app.conf.worker_send_task_events = False

    @app.task(shared=False, base=LeasedTask, bind=True, name="observe_send.job")
    def leased(self: LeasedTask) -> str:
        return "done"

    try:
        yield leased
    finally:
        celery_leases.stop()
        forget_runtime(app)
        app.close()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the claimed and completed signals each time they are really sent."""
    names: list[str] = []
    for signal in (signals.lease_claimed, signals.lease_completed):
        real = signal.send

        def spy(*args: Any, _real: Any = real, _name: str = signal.name, **kwargs: Any) -> Any:
            names.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(signal, "send", spy)
    return names


@pytest.fixture
def quiet_log() -> Iterator[None]:
    transitions = logging.getLogger("celery_leases.transitions")
    level = transitions.level
    transitions.setLevel(logging.WARNING)
    try:
        yield
    finally:
        transitions.setLevel(level)


def test_a_run_nobody_observes_still_sends_both_signals(
    job: LeasedTask, sent: list[str], quiet_log: None
) -> None:
    assert job.apply().get() == "done"
    assert sent == ["lease_claimed", "lease_completed"]


def test_the_transition_log_at_info_gets_both_signals_and_their_lines(
    job: LeasedTask, sent: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_leases.transitions")
    assert job.apply().get() == "done"
    assert sent == ["lease_claimed", "lease_completed"]
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_leases.transitions"]
    assert [line.split(":")[0] for line in lines] == ["lease claimed", "lease completed"]


def test_an_app_that_sends_task_events_gets_both_signals(
    job: LeasedTask, sent: list[str], quiet_log: None
) -> None:
    job.app.conf.worker_send_task_events = True
    job.apply().get()
    assert sent == ["lease_claimed", "lease_completed"]


def test_a_receiver_of_the_users_gets_every_signal_though_nothing_is_logged(
    job: LeasedTask, quiet_log: None
) -> None:
    got: list[tuple[str, int]] = []

    def receiver(sender: Any = None, signal: Any = None, lease: Any = None, **_: Any) -> None:
        got.append((signal.name, lease.generation))

    signals.lease_claimed.connect(receiver, weak=False)
    signals.lease_completed.connect(receiver, weak=False)
    try:
        job.apply().get()
    finally:
        signals.lease_claimed.disconnect(receiver)
        signals.lease_completed.disconnect(receiver)
    assert [name for name, _ in got] == ["lease_claimed", "lease_completed"]
    assert got[0][1] == got[1][1] > 0
