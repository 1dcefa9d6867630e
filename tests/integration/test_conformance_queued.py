"""Conformance, queued marks (``lease_queue_unique``): every store kind.

Like ``test_conformance.py``, each test runs on memory, Redis (also on a
cluster), PostgreSQL, SQLite and MariaDB through the ``store`` fixture.
"""

from __future__ import annotations

import pytest

from celery_leases import Acquired, LeaseConfigurationError, LeaseStore
from celery_leases.stores.base import QueuedMark
from tests.integration.test_conformance import SHORT_TTL, wait_for_store_clock

# the fixture of every store kind, the cluster too
from tests.integration.test_conformance import store_kind as store_kind

JOB = "report-7"


def test_a_mark_on_a_free_key_is_the_callers(store: LeaseStore) -> None:
    before = store.now_ms()
    mark = store.mark_queued(JOB, "task-a", 30)
    assert mark.job_id == JOB
    assert mark.task_id == "task-a"
    assert before <= mark.queued_at_ms <= store.now_ms()
    assert mark.queued_until_ms == mark.queued_at_ms + 30_000
    assert store.queued(JOB) == mark


def test_a_second_mark_gets_the_first_one(store: LeaseStore) -> None:
    first = store.mark_queued(JOB, "task-a", 30)
    assert store.mark_queued(JOB, "task-b", 30) == first
    assert store.queued(JOB) == first


def test_a_mark_again_by_its_own_task_id_lasts_longer_and_keeps_queued_at(
    store: LeaseStore,
) -> None:
    first = store.mark_queued(JOB, "task-a", 5)
    again = store.mark_queued(JOB, "task-a", 600)
    assert again.task_id == "task-a"
    assert again.queued_at_ms == first.queued_at_ms
    assert again.queued_until_ms >= first.queued_at_ms + 600_000
    assert store.queued(JOB) == again
    assert store.mark_queued(JOB, "task-b", 30) == again


def test_a_mark_again_after_it_ran_out_starts_anew(store: LeaseStore) -> None:
    first = store.mark_queued(JOB, "task-a", SHORT_TTL)
    wait_for_store_clock(store, first.queued_until_ms)
    again = store.mark_queued(JOB, "task-a", 30)
    assert again.queued_at_ms >= first.queued_until_ms


def test_marks_of_other_keys_are_independent(store: LeaseStore) -> None:
    store.mark_queued(JOB, "task-a", 30)
    assert store.mark_queued("report-8", "task-b", 30).task_id == "task-b"
    assert store.queued("report-9") is None


def test_a_mark_that_ran_out_is_gone_and_the_next_sender_places_its_own(
    store: LeaseStore,
) -> None:
    first = store.mark_queued(JOB, "task-a", SHORT_TTL)
    wait_for_store_clock(store, first.queued_until_ms)
    assert store.queued(JOB) is None
    second = store.mark_queued(JOB, "task-b", 30)
    assert second.task_id == "task-b"
    assert second.queued_at_ms >= first.queued_until_ms
    assert not store.unmark_queued(JOB, "task-a")
    assert store.queued(JOB) == second


def test_unmark_takes_only_the_mark_of_its_task_id(store: LeaseStore) -> None:
    store.mark_queued(JOB, "task-a", 30)
    assert not store.unmark_queued(JOB, "task-b")
    assert store.queued(JOB) is not None
    assert store.unmark_queued(JOB, "task-a")
    assert store.queued(JOB) is None
    assert not store.unmark_queued(JOB, "task-a")
    assert store.mark_queued(JOB, "task-c", 30).task_id == "task-c"


def test_a_mark_leaves_the_lease_record_alone(store: LeaseStore) -> None:
    store.mark_queued(JOB, "task-a", 30)
    assert store.get(JOB) is None
    assert list(store.records()) == []
    claim = store.claim(JOB, "worker-a", 30)
    assert isinstance(claim, Acquired)
    assert store.queued(JOB) is not None  # the run takes it away, not the claim
    assert [r.job_id for r in store.records()] == [JOB]


def test_unusual_keys_and_task_ids_round_trip(store: LeaseStore) -> None:
    job_id, task_id = "ключ {x} * ? [a]", "täsk:{1}"
    assert store.mark_queued(job_id, task_id, 30).task_id == task_id
    assert store.queued(job_id) == store.mark_queued(job_id, "other", 30)
    assert isinstance(store.queued(job_id), QueuedMark)


@pytest.mark.parametrize(
    ("job_id", "task_id", "ttl", "word"),
    [
        ("", "task-a", 30, "job_id"),
        (JOB, "", 30, "task_id"),
        (JOB, None, 30, "task_id"),
        (JOB, "task-a", 0, "ttl"),
        (JOB, "task-a", float("inf"), "ttl"),
    ],
)
def test_bad_mark_arguments_are_configuration_errors(
    store: LeaseStore, job_id: object, task_id: object, ttl: object, word: str
) -> None:
    with pytest.raises(LeaseConfigurationError, match=word):
        store.mark_queued(job_id, task_id, ttl)  # type: ignore[arg-type]


def test_extend_makes_the_own_live_mark_last_longer_and_keeps_queued_at(
    store: LeaseStore,
) -> None:
    first = store.mark_queued(JOB, "task-a", 5)
    extended = store.extend_queued(JOB, "task-a", 600)
    assert extended is not None
    assert extended.task_id == "task-a"
    assert extended.queued_at_ms == first.queued_at_ms
    assert extended.queued_until_ms >= first.queued_at_ms + 600_000
    assert store.queued(JOB) == extended


def test_extend_places_no_mark_where_the_run_took_it_away(store: LeaseStore) -> None:
    store.mark_queued(JOB, "task-a", 30)
    assert store.unmark_queued(JOB, "task-a")  # its run claimed the job
    assert store.extend_queued(JOB, "task-a", 600) is None
    assert store.queued(JOB) is None
    assert store.mark_queued(JOB, "task-b", 30).task_id == "task-b"


def test_extend_leaves_another_task_ids_mark_and_a_ran_out_one_alone(
    store: LeaseStore,
) -> None:
    first = store.mark_queued(JOB, "task-a", SHORT_TTL)
    wait_for_store_clock(store, first.queued_until_ms)
    assert store.extend_queued(JOB, "task-a", 600) is None
    assert store.queued(JOB) is None
    other = store.mark_queued(JOB, "task-b", 30)
    assert store.extend_queued(JOB, "task-a", 600) == other
    assert store.queued(JOB) == other
