"""Helpers for tests that use the store directly: claiming a lease outside a task,
and waiting for a store that fails over."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery.app.task import Context

from celery_leases import LeaseTiming, StoreUnavailable
from celery_leases.lease import Lease, make_owner
from celery_leases.stores.base import Acquired, LeaseStore


def claimed_lease(
    store: LeaseStore,
    job_id: str,
    timing: LeaseTiming,
    *,
    on_lost: Callable[[Lease], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Lease:
    """Claim ``job_id`` with a new owner token and wrap the claim in a :class:`Lease`.

    The local clock is read before the claim is sent, as a worker does.
    """
    owner = make_owner()
    started = clock()
    result = store.claim(job_id, owner, timing.ttl)
    assert isinstance(result, Acquired), result
    return Lease(
        job_id=job_id,
        owner=owner,
        generation=result.generation,
        lease_until_ms=result.lease_until_ms,
        started_at=started,
        store=store,
        timing=timing,
        task_name="tests.job",
        on_lost=on_lost,
        clock=clock,
    )


T = TypeVar("T")


def until_reachable(call: Callable[[], T], timeout: float = 30.0) -> T:
    """``call()`` once the store answers again (after a failover, say).

    Raises:
        StoreUnavailable: the store still did not answer after ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class StepTask:
    """What the run steps read of a task: its name, and the running request
    (a run's end looks at it for waiters to wake)."""

    name = "tests.job"
    request = Context(id="job")


def drop_foreign_tasks(app: Any, keep: str) -> None:
    """Leave ``app`` only its task ``keep`` and Celery's own: Celery adds
    every shared task defined in this process (another test's module, e.g.
    a docs example's) to each app it finalizes."""
    for name in [n for n in app.tasks if n != keep and not n.startswith("celery.")]:
        app.tasks.unregister(name)
