"""A run's release after its local deadline, on every store.

A body that raises ``Ignore`` or ``Reject`` after its lease ran out locally
still releases: for the drift margin the store's own lease names this run,
and the release frees the job for the next run at once (a requeued message
need not wait a whole TTL). The store is given the drift margin for it, not
the nothing the lease has left.
"""

from __future__ import annotations

from celery_leases import LeaseState, LeaseTiming
from celery_leases.run_steps import release
from celery_leases.stores.base import LeaseStore
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
