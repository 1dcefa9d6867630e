"""A run's release after its local deadline, on every store.

A body that raises ``Ignore`` or ``Reject`` after its lease ran out locally
still releases: for the drift margin the store's own lease names this run,
and the release frees the job for the next run at once (a requeued message
need not wait a whole TTL). The store is given the drift margin for it, not
the nothing the lease has left.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.task import Context

from celery_leases import LeaseState, LeaseTiming
from celery_leases.notify import process_notifier
from celery_leases.run_steps import UNKNOWN_COMPLETION, release
from celery_leases.stores.base import LeaseStore
from tests.integration.conftest import WAIT
from tests.leases import StepTask, claimed_lease

#: a drift margin long enough for a reply on a loaded machine
TIMING = LeaseTiming(ttl=20.0, renew_interval=5.0, drift_margin=5.0)


def test_a_release_after_the_local_deadline_frees_the_job(store: LeaseStore) -> None:
    now = [1000.0]
    lease = claimed_lease(store, "job", TIMING, clock=lambda: now[0])
    now[0] = lease.deadline  # the store's lease lasts the drift margin more
    assert lease.lost
    assert release(StepTask(), lease, "ignored")
    assert lease.finished  # the store answered: released
    record = store.get("job")
    assert record is not None
    assert record.state is LeaseState.RELEASED


class WaitingCopyTask(StepTask):
    """A copy of a waiting send (``lease_on_busy="wait"``) at its run's end."""

    request = Context(
        id="copy", called_directly=False, retries=0,
        leases_waiting=True, leases_send_id="send-1",
    )  # fmt: skip

    def lease_options(self) -> Any:
        return SimpleNamespace(defer_max=60.0)


@pytest.mark.parametrize(
    ("reason", "marked"),
    [
        ("failure", True),
        ("retry", True),
        ("replaced", True),
        # the send runs again: a mark would make its next copy release the
        # job without running it, and the job would be lost
        ("fenced-out", False),
        (UNKNOWN_COMPLETION, False),
        ("ignored", False),
    ],
)
def test_a_waiting_copy_marks_its_send_only_when_its_run_ended_the_send(
    store: LeaseStore, reason: str, marked: bool
) -> None:
    lease = claimed_lease(store, "job", TIMING)
    assert release(WaitingCopyTask(), lease, reason)
    assert process_notifier().flush(WAIT)  # the run's end wakes on the notifier
    marks = [entry for entry in store.waiters("job") if entry.is_mark]
    assert bool(marks) is marked, marks
