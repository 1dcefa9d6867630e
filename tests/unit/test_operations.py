"""The parts of the operator tools that need no server: durations, secret
masking, the purge schedule, and what each signal does to the metrics."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import click
import pytest
from celery import Celery, beat
from prometheus_client import REGISTRY

from celery_leases import LeaseConfigurationError, LeaseTiming, signals
from celery_leases.display import parse_duration
from celery_leases.lease import Lease
from celery_leases.metrics import install_metrics
from celery_leases.purge import BEAT_ENTRY_NAME, PURGE_TASK_NAME, schedule_purge
from celery_leases.redact import mask, secrets_of
from celery_leases.stores.memory import MemoryStore

TIMING = LeaseTiming(ttl=10.0, renew_interval=3.0, drift_margin=1.0)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("15m", 900.0), ("12h", 43200.0), ("7d", 604800.0),
     ("1w", 604800.0), ("1.5h", 5400.0)],
)  # fmt: skip
def test_parse_duration_reads_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5m", "7 days", "1e3"])
def test_parse_duration_refuses_anything_else(text: str) -> None:
    with pytest.raises(click.BadParameter, match="not a duration"):
        parse_duration(text)


def test_mask_hides_a_password_plain_quoted_or_in_the_query() -> None:
    url = "redis://user:p%40ss@host:6379/0"
    assert mask("failed at redis://user:p%40ss@host (p@ss)", secrets=secrets_of(url)) == (
        "failed at redis://user:***@host (***)"
    )
    query = "redis://host/0?password=hunter2"
    assert "hunter2" not in mask(f"cannot open {query!r}", secrets=secrets_of(query))
    assert mask("nothing secret", secrets=secrets_of("memory://")) == "nothing secret"


def test_schedule_purge_registers_the_task_and_one_beat_entry() -> None:
    app = Celery("purge-test", set_as_current=False)
    app.conf.beat_schedule = {"other": {"task": "x", "schedule": 10.0}}
    entry = schedule_purge(app, every=timedelta(hours=2), older_than=3 * 86400)
    assert PURGE_TASK_NAME in app.tasks
    assert app.conf.beat_schedule[BEAT_ENTRY_NAME] == entry
    assert "other" in app.conf.beat_schedule
    assert (entry["schedule"], entry["args"]) == (7200.0, (259200.0,))
    schedule_purge(app, every=3600, older_than=86400)  # again: replaces the entry
    assert app.conf.beat_schedule[BEAT_ENTRY_NAME]["args"] == (86400.0,)


@pytest.mark.parametrize(
    ("every", "older_than"), [(10, 86400), (3600, 30), (3600, float("nan")), ("1h", 86400)]
)
def test_schedule_purge_refuses_too_short_periods(every: Any, older_than: Any) -> None:
    app = Celery("purge-test", set_as_current=False)
    with pytest.raises(LeaseConfigurationError, match="at least"):
        schedule_purge(app, every=every, older_than=older_than)


# --- metrics -------------------------------------------------------------------


class FakeTask:
    """Stands for the task object that sends the signals."""

    name = "metrics.unit"


@pytest.fixture
def metrics() -> None:
    app = Celery("metrics-test", set_as_current=False)
    install_metrics(app)
    return


def value(name: str, **labels: str) -> float:
    found = REGISTRY.get_sample_value(name, {"task": FakeTask.name, **labels})
    return 0.0 if found is None else found


def _lease(store: MemoryStore, job_id: str, started_at: float | None = None) -> Lease:
    claim = store.claim(job_id, "host:1:abc", TIMING.ttl, task_name=FakeTask.name)
    return Lease(
        job_id=job_id, owner="host:1:abc", generation=claim.generation,
        lease_until_ms=claim.lease_until_ms, store=store,
        started_at=time.monotonic() if started_at is None else started_at,
        timing=TIMING, task_name=FakeTask.name,
    )  # fmt: skip


def test_claims_and_completions_move_the_counters_and_the_held_gauge(metrics: None) -> None:
    store = MemoryStore()
    acquired = value("celery_leases_claims_total", outcome="acquired")
    takeovers = value("celery_leases_takeovers_total")
    first, second = _lease(store, "m1"), _lease(store, "m2")
    signals.lease_claimed.send(sender=FakeTask, lease=first, job_id="m1", takeovers=0)
    signals.lease_claimed.send(sender=FakeTask, lease=second, job_id="m2", takeovers=1)
    assert value("celery_leases_claims_total", outcome="acquired") == acquired + 2
    assert value("celery_leases_takeovers_total") == takeovers + 1
    assert value("celery_leases_held") == 2
    signals.lease_completed.send(sender=FakeTask, lease=first, job_id="m1")
    signals.lease_released.send(sender=FakeTask, lease=second, job_id="m2", reason="failure")
    assert value("celery_leases_held") == 0


def test_a_renewal_is_timed_from_when_it_was_sent(metrics: None) -> None:
    store = MemoryStore()
    lease = _lease(store, "m3", started_at=time.monotonic() - 2)
    count = value("celery_leases_renew_seconds_count")
    total = value("celery_leases_renew_seconds_sum")
    sent = time.monotonic()
    lease.apply_renewal(sent - 0.2, store.renew("m3", lease.owner, lease.generation, TIMING.ttl))
    signals.lease_renewed.send(sender=FakeTask, lease=lease, job_id="m3")
    assert value("celery_leases_renew_seconds_count") == count + 1
    assert 0.2 <= value("celery_leases_renew_seconds_sum") - total < 5


def test_lost_fenced_out_and_deferred_runs_are_counted_by_reason(metrics: None) -> None:
    store = MemoryStore()
    lease = _lease(store, "m4")
    before = {
        "lost": value("celery_leases_lost_total", reason="heartbeat-error"),
        "fenced": value("celery_leases_fenced_out_total", reason="lost"),
        "held": value("celery_leases_claims_total", outcome="held"),
        "deferred": value("celery_leases_deferred_total", reason="held"),
        "store": REGISTRY.get_sample_value("celery_leases_store_errors_total",
                                           {"operation": "renew"}) or 0.0,
    }  # fmt: skip
    signals.lease_claimed.send(sender=FakeTask, lease=lease, job_id="m4", takeovers=0)
    signals.lease_lost.send(sender=FakeTask, lease=lease, job_id="m4", reason="heartbeat-error")
    assert value("celery_leases_held") == 0
    signals.lease_fenced_out.send(sender=FakeTask, lease=lease, job_id="m4", reason="lost")
    signals.duplicate_deferred.send(
        sender=FakeTask, lease=None, job_id="m4", reason="held", countdown=1.0, deferrals=1
    )
    assert value("celery_leases_lost_total", reason="heartbeat-error") == before["lost"] + 1
    assert value("celery_leases_fenced_out_total", reason="lost") == before["fenced"] + 1
    assert value("celery_leases_claims_total", outcome="held") == before["held"] + 1
    assert value("celery_leases_deferred_total", reason="held") == before["deferred"] + 1
    assert (
        REGISTRY.get_sample_value("celery_leases_store_errors_total", {"operation": "renew"})
        == before["store"] + 1
    )


def test_a_port_that_is_not_a_port_is_a_configuration_error() -> None:
    app = Celery("metrics-test", set_as_current=False)
    app.conf.leases_metrics_port = "9100"
    with pytest.raises(LeaseConfigurationError, match="leases_metrics_port"):
        install_metrics(app)


def test_without_prometheus_client_metrics_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    app = Celery("metrics-test", set_as_current=False)
    with pytest.raises(LeaseConfigurationError, match=r"pip install 'celery-leases\[metrics\]'"):
        install_metrics(app)
    install_metrics(app, required=False)  # off, quietly, for a call made on every app


def test_metrics_are_off_until_asked_for_even_with_prometheus_client_installed() -> None:
    """Every app gets ``install_metrics(app, required=False)``: that alone
    connects nothing, so a task pays nothing for metrics nobody reads."""
    script = textwrap.dedent(
        """
        from celery import Celery
        from celery_leases import LeasedTask, signals
        from celery_leases.metrics import install_metrics

        def connected():
            return any("metrics" in repr(key) for key, _ in signals.lease_claimed.receivers)

        app = Celery("metrics-off", set_as_current=False)

        @app.task(base=LeasedTask, shared=False, name="off.job")
        def job():
            pass

        app.finalize()
        install_metrics(app, required=False)
        before = connected()
        install_metrics(app)
        print(before, connected())
        """
    )
    reply = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert reply.stdout.split() == ["False", "True"]


def test_beat_reads_the_purge_entry_as_an_hourly_interval() -> None:
    app = Celery("purge-beat-test", set_as_current=False)
    schedule_purge(app, every=3600, older_than=86400)
    scheduler = beat.Scheduler(app=app, lazy=True)
    scheduler.merge_inplace(app.conf.beat_schedule)
    entry = scheduler.schedule[BEAT_ENTRY_NAME]
    assert (entry.task, entry.args) == (PURGE_TASK_NAME, (86400.0,))
    assert entry.schedule.run_every == timedelta(hours=1)
    due, next_check = entry.is_due()
    assert not due  # a fresh entry runs one period after beat starts
    assert 0 < next_check <= 3600


def test_skipped_calls_are_counted_by_reason_and_a_busy_one_as_a_held_claim(
    metrics: None,
) -> None:
    before = {
        "busy": value("celery_leases_skipped_total", reason="busy"),
        "completed": value("celery_leases_skipped_total", reason="completed"),
        "held": value("celery_leases_claims_total", outcome="held"),
    }
    signals.lease_skipped.send(
        sender=FakeTask, lease=None, job_id="m5", generation=7, task_id="t2", reason="busy",
        holder="host:1:abc", holder_task_id="t1",
    )  # fmt: skip
    signals.lease_skipped.send(
        sender=FakeTask, lease=None, job_id="m5", generation=7, task_id="t1", reason="completed"
    )
    assert value("celery_leases_skipped_total", reason="busy") == before["busy"] + 1
    assert value("celery_leases_skipped_total", reason="completed") == before["completed"] + 1
    assert value("celery_leases_claims_total", outcome="held") == before["held"] + 1
