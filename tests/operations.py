"""One call of each store operation that talks to the server, for outage
tests; calls made at once from many threads, for races."""

from __future__ import annotations

import threading
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


def at_once(count: int, call: Callable[[int], object], timeout: float = 60) -> list[object]:
    """Run ``call(n)`` for n in range(``count``) on as many threads released
    together; what each returned or raised, in the order they finished."""
    start = threading.Barrier(count)
    outcomes: list[object] = []

    def run(n: int) -> None:
        start.wait()
        try:
            outcomes.append(call(n))
        except BaseException as exc:  # handed to the test
            outcomes.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return outcomes
