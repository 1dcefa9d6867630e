"""The queue-unique guide's task and sender, which the tests run.

The broker and the lease store come from environment variables (the tests
set them): ``QUEUE_UNIQUE_BROKER`` (a Redis URL, also the result backend)
and ``QUEUE_UNIQUE_STORE`` (the lease store URL). The task is
``shared=False``: the tests load this module next to other apps.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_leases import LeasedTask

BROKER = os.environ.get("QUEUE_UNIQUE_BROKER", "redis://localhost:6379/0")

# --8<-- [start:task]
app = Celery("search", broker=BROKER, backend=BROKER)
app.conf.leases_store = os.environ.get("QUEUE_UNIQUE_STORE", "redis://localhost:6379/1")


@app.task(
    base=LeasedTask,
    bind=True,
    shared=False,
    lease_key="reindex:{user_id}",
    # at most one queued job per key; a mark that nobody takes away
    # lasts 15 minutes at most (True: one hour)
    lease_queue_unique=900,
)
def reindex(self, user_id):
    """Rebuild one user's search index from the database as it is now."""
    return f"reindexed {user_id} (generation {self.lease.generation})"


# --8<-- [end:task]


# --8<-- [start:send]
def on_profile_saved(user_id):
    """Called on every save: a burst of saves queues one reindex."""
    result = reindex.delay(user_id)
    if result.lease_coalesced:
        # nothing was published: the job queued before this call runs
        # after it and reads the database then, this save included
        print(f"user {user_id}: reindex already queued as {result.id}")
    else:
        print(f"user {user_id}: reindex queued as {result.id}")
    return result


# --8<-- [end:send]
