"""A run's completion and release tell the store how long it may wait.

The store reads the deadline with
:func:`~celery_leases.stores.deadline.time_left` (the SQL store bounds its
waits by it, the Redis store its wait for a reply); these tests record what
the store was told. Real waits on real servers: tests/integration
(test_redis_faults.py) and tests/acceptance (test_lost_completion.py).
"""

from __future__ import annotations

import pytest

from celery_leases import LeaseTiming, StoreUnavailable
from celery_leases.run_steps import complete, release, release_after_loss
from celery_leases.stores.base import Completed, CompleteResult, ReleaseResult
from celery_leases.stores.deadline import time_left
from celery_leases.stores.memory import MemoryStore
from tests.leases import StepTask, claimed_lease

TIMING = LeaseTiming(ttl=10.0, renew_interval=3.0, drift_margin=1.0)


class TimedStore(MemoryStore):
    """A memory store that records the time each call was given; its
    completions fail with StoreUnavailable, once applied, while ``lose_replies``."""

    lose_replies = False

    def __init__(self) -> None:
        super().__init__()
        self.given: list[tuple[str, float | None]] = []

    def _complete(
        self, job_id: str, owner: str, generation: int, outcome: bytes | None
    ) -> CompleteResult:
        self.given.append(("complete", time_left()))
        result = super()._complete(job_id, owner, generation, outcome)
        if self.lose_replies:
            raise StoreUnavailable("the reply was lost (test)")
        return result

    def _release(self, job_id: str, owner: str, generation: int) -> ReleaseResult:
        self.given.append(("release", time_left()))
        return super()._release(job_id, owner, generation)


@pytest.fixture
def store() -> TimedStore:
    return TimedStore()


def _within(given: float | None, most: float) -> bool:
    return given is not None and most - 1.0 < given <= most


def test_a_completion_waits_no_longer_than_the_lease_has_left(store: TimedStore) -> None:
    lease = claimed_lease(store, "job", TIMING)
    assert complete(StepTask(), lease, None) is not None
    [(call, given)] = store.given
    assert call == "complete"
    assert _within(given, TIMING.safe_duration), given


def test_a_release_waits_no_longer_than_the_lease_has_left(store: TimedStore) -> None:
    lease = claimed_lease(store, "job", TIMING)
    assert release(StepTask(), lease, "failure")
    [(call, given)] = store.given
    assert call == "release"
    assert _within(given, TIMING.safe_duration), given


def test_a_completion_unanswered_at_the_deadline_asks_once_within_the_drift_margin(
    store: TimedStore,
) -> None:
    now = [1000.0]
    lease = claimed_lease(store, "job", TIMING, clock=lambda: now[0])
    now[0] = lease.deadline  # no time left: no second try, only the question
    store.lose_replies = True
    # the store applied the completion: the question finds this run's own
    assert complete(StepTask(), lease, None) == Completed("job", lease.generation)
    [(first, _), (question, given)] = store.given
    assert (first, question) == ("complete", "release")
    assert _within(given, TIMING.drift_margin), given


def test_a_release_after_a_loss_waits_at_most_the_drift_margin(store: TimedStore) -> None:
    lease = claimed_lease(store, "job", TIMING)
    release_after_loss(StepTask(), lease)
    [(call, given)] = store.given
    assert call == "release"
    assert _within(given, TIMING.drift_margin), given


def test_a_release_after_the_deadline_waits_at_most_the_drift_margin(store: TimedStore) -> None:
    # a body that raised Ignore or Reject after its lease ran out: the store
    # may still name this run for the drift margin, and the release frees the job
    now = [1000.0]
    lease = claimed_lease(store, "job", TIMING, clock=lambda: now[0])
    now[0] = lease.deadline
    assert lease.lost
    release(StepTask(), lease, "ignored")
    [(call, given)] = store.given
    assert call == "release"
    assert _within(given, TIMING.drift_margin), given
