"""The beat job of docs/howto/no-overlap.md, which tests/docs/test_no_overlap_example.py runs.

The test points the app at its own broker, result backend and lease store
before it starts a worker; the page shows the part between the markers.
"""

from __future__ import annotations

import time

from celery import Celery

from celery_leases import LeasedTask, LeaseSkipped

# --8<-- [start:app]
app = Celery("prices", broker="redis://localhost:6379/0", backend="redis://localhost:6379/0")
app.conf.leases_store = "redis://localhost:6379/1"
app.conf.leases_ttl = 30  # renewed every 10 s while a run goes on
app.conf.beat_schedule = {
    "refresh-prices": {"task": "prices.refresh", "schedule": 60.0},
}


@app.task(
    base=LeasedTask,
    bind=True,
    name="prices.refresh",
    lease_key="refresh-prices",  # every call is the same job
    lease_on_busy="skip",  # a call made while a run goes on is not run
)
def refresh_prices(self, seconds=300.0):
    time.sleep(seconds)  # the work; fence its writes with self.lease.generation
    return {"generation": self.lease.generation}


# --8<-- [end:app]


# --8<-- [start:client]
def refresh_now(timeout=30.0):
    """Refresh the prices now, unless a run goes on already."""
    try:
        return refresh_prices.delay(0.0).get(timeout=timeout)
    except LeaseSkipped as skipped:
        return f"not run: {skipped}"


# --8<-- [end:client]
