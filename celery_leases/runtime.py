"""The per-process runtime of an app: its settings, its store, its task options.

One owner for what a worker process keeps between runs. It is made anew in
a forked child (a child must not share the parent's sockets), and
:func:`stop` is the supported way to end this process's lease threads (for
test suites that check for lingering threads, and at shutdown).
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from celery_leases.settings import LeaseSettings, LeaseTiming, OnLost
from celery_leases.stores import LeaseStore, open_store

__all__ = ["TaskOptions", "forget_runtime", "settings_for", "stop", "store_for", "task_options"]


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


@dataclass
class _Runtime:
    settings: LeaseSettings
    pid: int
    store: LeaseStore | None = None
    #: resolved once per task name, so a run does not validate them again
    options: dict[str, TaskOptions] = field(default_factory=dict)


_runtimes: weakref.WeakKeyDictionary[Any, _Runtime] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _runtime(app: Any) -> _Runtime:
    runtime = _runtimes.get(app)  # the common case, without the lock
    if runtime is not None and runtime.pid == os.getpid():
        return runtime
    with _lock:
        runtime = _runtimes.get(app)
        if runtime is None or runtime.pid != os.getpid():
            runtime = _Runtime(LeaseSettings.from_conf(app.conf), os.getpid())
            _runtimes[app] = runtime
        return runtime


def settings_for(app: Any) -> LeaseSettings:
    """The validated lease settings of ``app`` (read once per process).

    Raises:
        LeaseConfigurationError: a ``leases_*`` setting is missing or invalid.
    """
    return _runtime(app).settings


def store_for(app: Any) -> LeaseStore:
    """The lease store of ``app`` in this process, opened on first use.

    Raises:
        StoreUnavailable: the store could not be reached to open it (a SQL
            store creates its table on first use).
        LeaseConfigurationError: the URL or options are wrong.
    """
    runtime = _runtime(app)
    with _lock:
        if runtime.store is None:
            runtime.store = open_store(
                runtime.settings.store_url, **dict(runtime.settings.store_options)
            )
        return runtime.store


def task_options(app: Any, name: str, resolve: Any) -> TaskOptions:
    """The options of task ``name``, made by ``resolve()`` on first use per process."""
    runtime = _runtime(app)
    options = runtime.options.get(name)
    if options is None:
        options = resolve()
        runtime.options[name] = options
    return options


def forget_runtime(app: Any) -> None:
    """Drop the cached settings and store of ``app`` (after a config change)."""
    with _lock:
        runtime = _runtimes.pop(app, None)
    if runtime is not None and runtime.store is not None and runtime.pid == os.getpid():
        runtime.store.close()


def stop() -> int:
    """Release the leases this process holds and stop its lease threads.

    Idempotent; the next leased run starts the threads again. Runs still
    going see their lease lost. Use it at the end of a test, or before a
    process that used leased tasks exits without a worker shutdown.

    Returns:
        How many leases were released in the store.
    """
    from celery_leases import events
    from celery_leases.notify import process_notifier
    from celery_leases.worker import release_held_leases

    released = release_held_leases("stopped")
    process_notifier().stop()  # its last notices may queue events
    events.stop()
    return released
