"""Lease events merged into Celery's and Flower's event state as task fields."""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import pytest
from celery.events.state import State

from celery_leases.flower import LeaseAttempts, LeaseTask, watch

_clock = itertools.count(1)


def send(
    state: State, type_: str, *, uuid: str = "t1", hostname: str = "a@h", **fields: Any
) -> None:
    tick = next(_clock)
    state.event(
        {
            "type": type_,
            "uuid": uuid,
            "hostname": hostname,
            "timestamp": 1_000_000.0 + tick,
            "local_received": 1_000_000.0 + tick,
            "clock": tick,
            **fields,
        }
    )


def claim(
    state: State, generation: int, subject: str = "claimed", hostname: str = "a@h", **fields: Any
) -> None:
    send(
        state,
        f"lease-{subject}",
        hostname=hostname,
        job_id="t1",
        generation=generation,
        **{"owner": f"{hostname}:1:abc", "lease_until": "2026-01-01T00:00:10+00:00", **fields},
    )


@pytest.fixture
def state() -> State:
    return watch(State())


def test_a_monitor_without_the_module_ignores_lease_events() -> None:
    plain = State()
    send(plain, "task-received", name="job")
    send(plain, "task-started")
    claim(plain, 7)
    claim(plain, 7, "renewed", renewals=1)
    assert plain.tasks["t1"].state == "STARTED"


def test_a_held_lease_keeps_the_task_started_with_its_fields(state: State) -> None:
    send(state, "task-received", name="job")
    send(state, "task-started")
    claim(state, 7, takeovers=0, renewals=0)
    claim(state, 7, "renewed", renewals=1, lease_until="2026-01-01T00:00:20+00:00")
    task = state.tasks["t1"]
    assert isinstance(task, LeaseTask)
    assert task.state == "STARTED"
    info = task.as_dict()
    assert info["lease_job_id"] == "t1"
    assert info["lease_generation"] == 7
    assert info["lease_owner"] == "a@h:1:abc"
    # as Flower writes its own times; each attempt keeps ISO 8601
    assert info["lease_until"] == "2026-01-01 00:00:20.000000 UTC"
    assert task.lease_attempts[0]["lease_until"] == "2026-01-01T00:00:20+00:00"
    assert info["lease_renewals"] == 1
    assert info["lease_fate"] == "held"
    assert info["lease_ran_on"] is None


def test_a_late_event_of_a_fenced_out_run_leaves_success_and_the_real_worker(
    state: State,
) -> None:
    send(state, "task-received", name="job")
    send(state, "task-started")
    claim(state, 7)
    claim(state, 7, "lost", reason="deadline")
    send(state, "task-started", hostname="b@h")
    claim(state, 8, hostname="b@h", takeovers=1)
    claim(state, 8, "completed", hostname="b@h")
    send(state, "task-succeeded", hostname="b@h", result="1", runtime=1.0)
    # the stale run wakes up after B finished
    claim(state, 7, "fenced-out", reason="stale")
    claim(state, 7, "renewed", renewals=3)
    task = state.tasks["t1"]
    assert task.state == "SUCCESS"
    assert task.worker.hostname == "b@h"
    assert task.lease_ran_on == "b@h"
    assert task.lease_generation == 8
    assert task.lease_takeovers == 1
    assert task.lease_fate == "completed by generation 8"
    stale, fresh = task.lease_attempts
    assert (stale["generation"], stale["worker"], stale["outcome"], stale["reason"]) == (
        7, "a@h", "fenced-out", "stale",
    )  # fmt: skip
    assert stale["renewals"] == 3
    assert (fresh["generation"], fresh["worker"], fresh["outcome"]) == (8, "b@h", "completed")
    assert str(task.lease_attempts) == (
        "generation 7 on a@h: fenced-out (stale); generation 8 on b@h: completed"
    )


def test_events_of_two_claims_in_any_order_sort_by_generation(state: State) -> None:
    claim(state, 9, hostname="b@h")
    claim(state, 8, "released", reason="failure")
    task = state.tasks["t1"]
    assert [entry["generation"] for entry in task.lease_attempts] == [8, 9]
    assert task.lease_generation == 9
    assert task.lease_fate == "held"


def test_a_deferral_is_listed_between_the_claims_it_came_between(state: State) -> None:
    send(state, "task-received", name="job")
    claim(state, 7, timestamp=1.0)
    claim(state, 7, "lost", reason="deadline", timestamp=2.0)
    # the deferral's event arrives last, but it happened before the second claim
    claim(state, 8, hostname="b@h", timestamp=4.0)
    send(state, "lease-deferred", hostname="b@h", job_id="t1", reason="held", timestamp=3.0)
    task = state.tasks["t1"]
    assert [(e.get("generation"), e["outcome"]) for e in task.lease_attempts] == [
        (7, "lost"),
        (None, "deferred"),
        (8, "claimed"),
    ]
    assert str(task.lease_attempts) == (
        "generation 7 on a@h: lost (deadline); deferred (held) on b@h; generation 8 on b@h: claimed"
    )


@pytest.mark.parametrize(
    ("subject", "reason", "fate"),
    [
        ("lost", "deadline", "lost (deadline)"),
        ("fenced-out", "stale", "fenced-out (stale)"),
        ("released", "failure", "released (failure)"),
    ],
)
def test_the_fate_of_a_run_that_did_not_complete(
    state: State, subject: str, reason: str, fate: str
) -> None:
    claim(state, 7)
    claim(state, 7, subject, reason=reason)
    assert state.tasks["t1"].lease_fate == fate


def test_a_deferred_duplicate_and_a_skipped_copy_are_listed(state: State) -> None:
    claim(state, 7)
    send(state, "lease-deferred", hostname="b@h", job_id="t1", reason="held", deferrals=1)
    task = state.tasks["t1"]
    assert task.lease_fate == "held; deferred as a duplicate (held)"
    claim(state, 7, "completed")
    send(state, "lease-skipped", hostname="b@h", job_id="t1", generation=7)
    assert task.lease_fate == (
        "completed by generation 7; skipped (already completed by generation 7)"
    )
    assert [entry["outcome"] for entry in task.lease_attempts] == [
        "completed", "deferred", "skipped",
    ]  # fmt: skip
    assert str(task.lease_attempts).endswith("skipped (already completed by generation 7) on b@h")


def test_a_call_skipped_as_busy_names_the_run_that_holds_its_job(state: State) -> None:
    send(
        state, "lease-skipped", uuid="t2", hostname="b@h", job_id="beat", generation=7,
        reason="busy", holder_task_id="t1",
    )  # fmt: skip
    assert state.tasks["t2"].lease_fate == "skipped (busy: held by t1, generation 7)"


def test_a_queued_job_says_what_took_its_mark_away(state: State) -> None:
    send(state, "lease-unqueued", uuid="t3", hostname="a@h", job_id="reindex:42", reason="claimed")
    task = state.tasks["t3"]
    assert task.lease_queued == "the queued job of 'reindex:42', until its run claimed the lease"
    assert task.lease_attempts in (None, [])  # not a claim, deferral or skip
    send(state, "lease-unqueued", uuid="t4", hostname="a@h", job_id="reindex:42", reason="revoked")
    assert state.tasks["t4"].lease_queued.endswith("until its message was revoked")


def test_a_lease_event_before_any_task_event_makes_the_task(state: State) -> None:
    claim(state, 7)
    task = state.tasks["t1"]
    assert task.worker.hostname == "a@h"
    assert task.state == "PENDING"
    assert task.lease_generation == 7


def test_an_event_without_a_task_id_is_ignored(state: State) -> None:
    state.event({"type": "lease-claimed", "hostname": "a@h", "timestamp": 1.0, "clock": 1})
    assert len(state.tasks) == 0


def test_lease_fields_survive_a_saved_state() -> None:
    pytest.importorskip("flower")
    from flower.events import EventsState

    import celery_leases.flower

    assert EventsState is celery_leases.flower.LeaseEventsState  # type: ignore[attr-defined]
    saved = EventsState()
    send(saved, "task-received", name="job")
    claim(saved, 7)
    claim(saved, 7, "completed")
    loaded = pickle.loads(pickle.dumps(saved))  # noqa: S301  # our own data
    task = loaded.tasks["t1"]
    assert task.lease_fate == "completed by generation 7"
    assert isinstance(task.lease_attempts, LeaseAttempts)
    claim(loaded, 7, "renewed", renewals=2)  # the loaded state still merges lease events
    assert loaded.tasks["t1"].lease_attempts[0]["renewals"] == 2
