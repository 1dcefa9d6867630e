"""The per-process runtime: settings, store, heartbeat, held leases, forks.

One owner for what a worker process keeps between runs: each app's
settings, store and resolved task options (made anew in a forked child,
which must not share the parent's sockets), the heartbeat and the leases it
holds, whether this process is a prefork pool child, releasing what it
holds, and :func:`stop`, the supported way to end this process's lease
threads (for test suites that check for lingering threads, and at shutdown).

The run (:mod:`celery_leases.task`) and the worker integration
(:mod:`celery_leases.worker`) sit above it and use it; it imports neither.
A :class:`~celery_leases.task.LeasedTask` bound to an app calls
:func:`app_bound`, and the worker integration, imported by the package,
registers its ``install`` with :func:`add_bind_hook`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import billiard.process

from celery_leases import broker_visibility, events
from celery_leases.errors import LeaseLost, StoreUnavailable
from celery_leases.heartbeat import process_heartbeat
from celery_leases.lease import Lease
from celery_leases.notify import process_notifier
from celery_leases.per_process import ProcessLocalByKey
from celery_leases.settings import LeaseSettings, LeaseTiming, OnBusy, OnLost
from celery_leases.stores import LeaseStore, open_store
from celery_leases.stores.base import Released

__all__ = [
    "CLOSE_FLUSH",
    "TaskOptions",
    "add_bind_hook",
    "app_bound",
    "close_after_notices",
    "forget_runtime",
    "in_prefork_child",
    "on_process_init",
    "process_heartbeat",
    "process_leases",
    "release_held_leases",
    "settings_for",
    "stop",
    "store_for",
    "task_options",
]

logger = logging.getLogger("celery_leases")


@dataclass(frozen=True)
class TaskOptions:
    """A task's lease options with the app's settings applied, validated."""

    timing: LeaseTiming
    on_lost: OnLost
    takeover_limit: int | None
    defer_max: float
    #: how outcomes are kept with a completion: the app's result serializer
    #: and ``leases_result_max_bytes``
    result_serializer: str
    result_max_bytes: int
    #: a call whose job another send holds: wait for it, or skip
    on_busy: OnBusy = "wait"


@dataclass
class _Runtime:
    settings: LeaseSettings
    store: LeaseStore | None = None
    #: resolved once per task name, so a run does not validate them again
    options: dict[str, TaskOptions] = field(default_factory=dict)


#: each app's runtime in this process: a forked child must not share the
#: parent's sockets
_runtimes: ProcessLocalByKey[Any, _Runtime] = ProcessLocalByKey(
    lambda app: _Runtime(LeaseSettings.from_conf(app.conf))
)
_lock = threading.Lock()
_prefork_child_pid: int | None = None
#: called with every app a leased task is bound to (the worker's ``install``)
_bind_hooks: list[Callable[[Any], None]] = []
_bound_apps: weakref.WeakSet[Any] = weakref.WeakSet()


def settings_for(app: Any) -> LeaseSettings:
    """The validated lease settings of ``app`` (read once per process).

    Raises:
        LeaseConfigurationError: a ``leases_*`` setting is missing or invalid.
    """
    return _runtimes.get(app).settings


def store_for(app: Any) -> LeaseStore:
    """The lease store of ``app`` in this process, opened on first use.

    Raises:
        StoreUnavailable: the store could not be reached to open it (a SQL
            store creates its table on first use).
        LeaseConfigurationError: the URL or options are wrong.
    """
    runtime = _runtimes.get(app)
    store = runtime.store  # the common case, without the lock
    if store is not None:
        return store
    with _lock:
        if runtime.store is None:
            runtime.store = open_store(
                runtime.settings.store_url, **dict(runtime.settings.store_options)
            )
        return runtime.store


def task_options(app: Any, name: str, resolve: Any) -> TaskOptions:
    """The options of task ``name``, made by ``resolve()`` on first use per process."""
    runtime = _runtimes.get(app)
    options = runtime.options.get(name)
    if options is None:
        options = resolve()
        runtime.options[name] = options
    return options


#: seconds the notices already queued may take before a store is closed
CLOSE_FLUSH = 5.0


def forget_runtime(app: Any) -> None:
    """Drop the cached settings and store of ``app`` (after a config change).

    The notices already queued run first (up to :data:`CLOSE_FLUSH` s): a
    run's end takes its waiters on the notifier, and a closed SQL store's
    engine would open a connection for it that nothing ever closes.
    """
    runtime = _runtimes.forget(app)
    if runtime is not None and runtime.store is not None:
        close_after_notices(runtime.store)


def close_after_notices(store: LeaseStore) -> None:
    """Close ``store`` once the notices queued in this process have run
    (up to :data:`CLOSE_FLUSH` s; none are waited for on the notifier itself)."""
    notifier = process_notifier()
    if notifier.running and threading.current_thread().name != notifier.name:
        notifier.flush(CLOSE_FLUSH)
    store.close()


def in_prefork_child() -> bool:
    """Whether this process is a prefork pool child (stopping it is safe)."""
    return _prefork_child_pid == os.getpid()


def on_process_init(**_: Any) -> None:
    """Note whether this process is a prefork pool child (``worker_process_init``)."""
    global _prefork_child_pid
    # the solo pool sends this signal in the worker's own process: stopping
    # that one would stop the whole worker, so only a forked child counts
    if billiard.process.current_process().name != "MainProcess":
        _prefork_child_pid = os.getpid()


def release_held_leases(reason: str = "shutdown") -> int:
    """Mark lost and release every lease this process still holds; stop the heartbeat.

    Returns:
        How many leases were released in the store.
    """
    heartbeat = process_heartbeat()
    released = 0
    for lease in heartbeat.held():
        heartbeat.remove(lease)
        lease.mark_lost(
            LeaseLost(
                f"the worker is shutting down while job {lease.job_id!r} (generation "
                f"{lease.generation}) still runs; its lease is released",
                job_id=lease.job_id,
                owner=lease.owner,
                generation=lease.generation,
                reason=reason,
            )
        )
        try:
            result = lease.store.release(lease.job_id, lease.owner, lease.generation)
        except StoreUnavailable as exc:
            logger.warning("could not release job %r on %s: %s", lease.job_id, reason, exc)
            continue
        released += isinstance(result, Released)
    heartbeat.stop()
    return released


def process_leases() -> list[Lease]:
    """The leases this process holds (the one place that knows where they live)."""
    return process_heartbeat().held()


def add_bind_hook(hook: Callable[[Any], None]) -> None:
    """Call ``hook(app)`` for every app a leased task is bound to, past and future.

    The worker integration registers its ``install`` here when it is
    imported, so binding a task needs no import of the layer above.
    """
    with _lock:
        _bind_hooks.append(hook)
        apps = list(_bound_apps)
    for app in apps:
        hook(app)


def app_bound(app: Any) -> None:
    """Note that a leased task was bound to ``app``: run the bind hooks for it."""
    with _lock:
        _bound_apps.add(app)
        hooks = list(_bind_hooks)
    for hook in hooks:
        hook(app)


def stop() -> int:
    """Release the leases this process holds and stop its lease threads.

    Idempotent; the next leased run starts the threads again. Runs still
    going see their lease lost. Use it at the end of a test, or before a
    process that used leased tasks exits without a worker shutdown.

    Returns:
        How many leases were released in the store.
    """
    released = release_held_leases("stopped")
    process_notifier().stop()  # its last notices may queue events
    events.stop()
    broker_visibility.stop()
    return released
