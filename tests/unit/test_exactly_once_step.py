"""The run's own completion after a body that completed in its transaction."""

from __future__ import annotations

import time
from types import SimpleNamespace

from celery.app.task import Context

from celery_leases import Acquired, Completed, LeaseState, MemoryStore
from celery_leases.lease import Lease
from celery_leases.run_steps import complete_run
from celery_leases.runtime import TaskOptions
from celery_leases.settings import LeaseTiming


def held_lease(store: MemoryStore) -> Lease:
    started = time.monotonic()
    claim = store.claim("job", "owner-1", 30.0)
    assert isinstance(claim, Acquired)
    return Lease(
        job_id="job",
        owner="owner-1",
        generation=claim.generation,
        lease_until_ms=claim.lease_until_ms,
        started_at=started,
        store=store,
        timing=LeaseTiming(ttl=30.0, renew_interval=10.0, drift_margin=1.0),
    )


def test_a_run_completed_in_its_transaction_is_not_completed_again() -> None:
    store = MemoryStore()
    lease = held_lease(store)
    lease.completed_in_transaction = True
    options = TaskOptions(lease.timing, "flag", None, 60.0, "json", 65536)
    result = complete_run(SimpleNamespace(request=Context(id="job")), lease, "value", options)
    assert result == Completed("job", lease.generation)
    record = store.get("job")
    assert record is not None
    assert record.state is LeaseState.HELD  # the store was not asked to complete it
