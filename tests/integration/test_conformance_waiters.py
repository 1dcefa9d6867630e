"""Conformance, waiters (``lease_on_busy="wait"``): every store kind.

Like ``test_conformance.py``, each test runs on memory, Redis (also on a
cluster), PostgreSQL, SQLite and MariaDB through the ``store`` fixture.
"""

from __future__ import annotations

import threading

import pytest

from celery_leases import Acquired, LeaseConfigurationError, LeaseStore
from celery_leases.stores.base import MAX_WAITERS
from celery_leases.stores.waiters import MAX_WAITER_BYTES
from tests.integration.test_conformance import SHORT_TTL, wait_for_store_clock

# the fixture of every store kind, the cluster too
from tests.integration.test_conformance import store_kind as store_kind

JOB = "report-7"
#: a payload with every byte value, as a pickled message may have
PAYLOAD = bytes(range(256)) * 3


def test_a_waiter_is_kept_with_its_payload_and_times(store: LeaseStore) -> None:
    before = store.now_ms()
    assert store.add_waiter(JOB, "send-a", "task-a", PAYLOAD, 30) is True
    (waiter,) = store.waiters(JOB)
    assert (waiter.job_id, waiter.send_id, waiter.task_id) == (JOB, "send-a", "task-a")
    assert waiter.payload == PAYLOAD
    assert before <= waiter.waiting_since_ms <= store.now_ms()
    assert waiter.waiting_until_ms == waiter.waiting_since_ms + 30_000


def test_take_returns_the_waiters_in_order_and_deletes_them(store: LeaseStore) -> None:
    for name in ("a", "b", "c"):
        store.add_waiter(JOB, f"send-{name}", f"task-{name}", name.encode(), 30)
    taken = store.take_waiters(JOB)
    assert [w.send_id for w in taken] == ["send-a", "send-b", "send-c"]
    assert [w.payload for w in taken] == [b"a", b"b", b"c"]
    assert store.waiters(JOB) == []
    assert store.take_waiters(JOB) == []


def test_a_send_registered_again_is_one_waiter_with_the_new_payload(store: LeaseStore) -> None:
    store.add_waiter(JOB, "send-a", "task-a", b"first", 5)
    store.add_waiter(JOB, "send-a", "task-a2", b"second", 60)
    (waiter,) = store.waiters(JOB)
    assert (waiter.task_id, waiter.payload) == ("task-a2", b"second")
    assert waiter.waiting_until_ms >= waiter.waiting_since_ms + 60_000


def test_a_waiter_that_ran_out_is_neither_read_nor_taken(store: LeaseStore) -> None:
    store.add_waiter(JOB, "send-old", "task-old", b"old", SHORT_TTL)
    (old,) = store.waiters(JOB)
    store.add_waiter(JOB, "send-new", "task-new", b"new", 30)
    wait_for_store_clock(store, old.waiting_until_ms)
    assert [w.send_id for w in store.waiters(JOB)] == ["send-new"]
    assert [w.send_id for w in store.take_waiters(JOB)] == ["send-new"]


def test_waiters_of_other_jobs_are_independent(store: LeaseStore) -> None:
    store.add_waiter(JOB, "send-a", "task-a", b"a", 30)
    store.add_waiter("report-8", "send-a", "task-a", b"b", 30)
    assert [w.payload for w in store.take_waiters(JOB)] == [b"a"]
    assert [w.payload for w in store.waiters("report-8")] == [b"b"]


def test_waiters_leave_the_lease_record_alone(store: LeaseStore) -> None:
    claim = store.claim(JOB, "owner-a", 30)
    assert isinstance(claim, Acquired)
    store.add_waiter(JOB, "send-a", "task-a", b"a", 30)
    store.take_waiters(JOB)
    record = store.get(JOB)
    assert record is not None
    assert (record.owner, record.generation) == ("owner-a", claim.generation)
    assert [r.job_id for r in store.records()] == [JOB]


def test_a_job_takes_at_most_max_waiters_of_other_sends(store: LeaseStore) -> None:
    for n in range(MAX_WAITERS):
        assert store.add_waiter(JOB, f"send-{n}", "t", b"", 30) is True
    assert store.add_waiter(JOB, "send-late", "t", b"", 30) is False
    # a send already waiting registers again
    assert store.add_waiter(JOB, "send-0", "t", b"again", 30) is True
    assert len(store.waiters(JOB)) == MAX_WAITERS


def test_a_full_job_takes_a_waiter_once_others_ran_out(store: LeaseStore) -> None:
    for n in range(MAX_WAITERS):
        store.add_waiter(JOB, f"send-{n}", "t", b"", SHORT_TTL)
    last = max(w.waiting_until_ms for w in store.waiters(JOB))
    wait_for_store_clock(store, last)
    assert store.add_waiter(JOB, "send-late", "t", b"", 30) is True
    assert [w.send_id for w in store.waiters(JOB)] == ["send-late"]


def test_of_two_takers_at_once_each_waiter_goes_to_one(store: LeaseStore) -> None:
    sends = [f"send-{n}" for n in range(40)]
    for send in sends:
        store.add_waiter(JOB, send, "t", b"x", 30)
    taken: list[list[str]] = [[], []]
    start = threading.Barrier(2)

    def take(slot: int) -> None:
        start.wait()
        taken[slot] = [w.send_id for w in store.take_waiters(JOB)]

    threads = [threading.Thread(target=take, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(taken[0] + taken[1]) == sorted(sends)


def test_unusual_keys_and_send_ids_round_trip(store: LeaseStore) -> None:
    job, send = "ключ {x}:*?", "task:ид-1"
    store.add_waiter(job, send, "задача", b"\x00:\xff", 30)
    (waiter,) = store.take_waiters(job)
    assert (waiter.job_id, waiter.send_id, waiter.task_id) == (job, send, "задача")
    assert waiter.payload == b"\x00:\xff"


def test_the_largest_payload_round_trips(store: LeaseStore) -> None:
    payload = b"\xfe" * MAX_WAITER_BYTES
    store.add_waiter(JOB, "send-a", "task-a", payload, 30)
    (waiter,) = store.take_waiters(JOB)
    assert waiter.payload == payload


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((JOB, "", "t", b"", 30), "send_id"),
        ((JOB, "s", "t", "text", 30), "payload must be bytes"),
        ((JOB, "s", "t", b"x" * (MAX_WAITER_BYTES + 1), 30), "limit"),
        ((JOB, "s", "t", b"", 0), "ttl"),
        (("", "s", "t", b"", 30), "job_id"),
    ],
)
def test_bad_waiter_arguments_are_configuration_errors(
    store: LeaseStore, arguments: tuple[object, ...], message: str
) -> None:
    with pytest.raises(LeaseConfigurationError, match=message):
        store.add_waiter(*arguments)  # type: ignore[arg-type]
    assert store.waiters(JOB) == []


def test_take_leaves_a_mark_which_runs_out_by_itself(store: LeaseStore) -> None:
    store.add_waiter(JOB, "ran:send-a", "task-a", b"", SHORT_TTL)
    store.add_waiter(JOB, "send-b", "task-b", b"b", 30)
    assert [w.send_id for w in store.take_waiters(JOB)] == ["send-b"]
    [mark] = store.waiters(JOB)
    assert (mark.send_id, mark.payload) == ("ran:send-a", b"")
    assert store.take_waiters(JOB) == []
    wait_for_store_clock(store, mark.waiting_until_ms)
    assert store.waiters(JOB) == []
