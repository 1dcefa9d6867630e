"""One call of each store operation that talks to the server, for outage tests."""

from __future__ import annotations

from collections.abc import Callable

from celery_leases import LeaseStore, RenewRequest


def every_operation(
    store: LeaseStore, job_id: str, owner: str, generation: int, ttl: float
) -> dict[str, Callable[[], object]]:
    """Calls of every public operation on ``job_id``, held by ``owner`` with
    ``generation``, keyed by the operation's name."""
    return {
        "claim": lambda: store.claim(job_id, "someone-else", ttl),
        "claim of a new job": lambda: store.claim(f"{job_id}-new", "someone-else", ttl),
        "renew": lambda: store.renew(job_id, owner, generation, ttl),
        "renew_many": lambda: store.renew_many([RenewRequest(job_id, owner, generation, ttl)]),
        "complete": lambda: store.complete(job_id, owner, generation),
        "release": lambda: store.release(job_id, owner, generation),
        "get": lambda: store.get(job_id),
        "records": lambda: list(store.records()),
        "purge": lambda: store.purge(60),
        "now_ms": store.now_ms,
    }
