"""``celery inspect leases``: the leases each running worker holds now.

The command runs in each worker's main process. Leases of the main process
(solo, threads, gevent and eventlet pools) come from its heartbeat, with the
time left before their local safe deadline. Prefork children hold theirs in
their own memory, so for them the main process reads the store: the held
records whose owner token names this host and one of its pool processes,
with the time left by the store's clock, and the task id of the request the
main process handed to that child. That read goes through every
record in the store (one ``SCAN`` or ``SELECT``): inspect rarely, purge
often.

Importing this module registers the command. The package imports it, and
the ``celery`` program imports it through the ``celery leases`` entry point,
so workers and the ``celery inspect`` client both know it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from celery.worker import state as worker_state
from celery.worker.control import inspect_command

from celery_leases.errors import LeaseError
from celery_leases.runtime import process_leases, store_for
from celery_leases.stores.base import LeaseState, ms_to_datetime

__all__ = ["held_leases", "leases", "process_leases"]


def _pool_pids(state: Any) -> list[int]:
    pool = getattr(getattr(state, "consumer", None), "pool", None)
    try:
        info = pool.info if pool is not None else {}
    except Exception:  # a pool that is starting or stopping
        return []
    processes = info.get("processes", []) if isinstance(info, dict) else []
    return [int(pid) for pid in processes if int(pid) != os.getpid()]


def held_leases(state: Any) -> list[dict[str, Any]]:
    """Describe every lease held by this worker's processes, oldest claim first."""
    rows: list[dict[str, Any]] = []
    for lease in process_leases():
        rows.append(
            {
                "job_id": lease.job_id,
                "task_id": getattr(lease, "task_id", None),
                "task_name": lease.task_name,
                "generation": lease.generation,
                "pid": os.getpid(),
                "lease_until": lease.lease_until.isoformat(),
                "remaining": round(lease.remaining(), 3),
                "lost": lease.lost,
            }
        )
    pids = _pool_pids(state)
    if pids:
        rows.extend(_child_leases(state.app, pids))
    return rows


def _running_task_ids() -> dict[int, str]:
    """The task id each pool process runs now, by pid, as the main process knows it.

    A prefork child runs one task at a time; the main process keeps the
    request it handed to each child (``worker_pid`` is set once the child
    accepted it).
    """
    running = {}
    for request in list(worker_state.active_requests):
        pid = getattr(request, "worker_pid", None)
        if pid is not None:
            running[int(pid)] = str(request.id)
    return running


def _child_leases(app: Any, pids: list[int]) -> list[dict[str, Any]]:
    host = socket.gethostname()
    prefixes = {f"{host}:{pid}:": pid for pid in pids}
    store = store_for(app)
    rows = []
    for record in store.records(state=LeaseState.HELD):
        pid = prefixes.get(record.owner.rsplit(":", 1)[0] + ":")
        if pid is None:
            continue
        rows.append((record, pid))
    now = store.now_ms()
    running = _running_task_ids()
    return [
        {
            "job_id": record.job_id,
            "task_id": record.task_id or running.get(pid),
            "task_name": record.task_name,
            "generation": record.generation,
            "pid": pid,
            "lease_until": ms_to_datetime(record.lease_until_ms).isoformat(),
            "remaining": round(max(0, record.lease_until_ms - now) / 1000, 3),
            "lost": not record.is_live(now),
        }
        for record, pid in sorted(rows, key=lambda item: item[0].claimed_at_ms or 0)
    ]


@inspect_command(name="leases", default_timeout=5.0)  # type: ignore[untyped-decorator]  # celery ships no type hints
def leases(state: Any, **_: Any) -> dict[str, Any]:
    """List the leases this worker holds now, with the seconds left."""
    try:
        return {"ok": held_leases(state)}
    except LeaseError as exc:
        return {"error": str(exc)}
