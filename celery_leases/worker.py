"""Worker integration: CLI options, a bootstep that checks the setup, shutdown.

:func:`install` runs when a :class:`~celery_leases.task.LeasedTask` is
first bound to an app (the runtime calls it through the bind hook this
module registers on import), so users need not call it, except for one thing:
``celery worker`` reads extra CLI options right after importing the app,
before tasks are bound. To use ``--leases-store`` / ``--leases-ttl`` /
``--leases-metrics-port``, call
``celery_leases.install(app)`` in the module that creates the app.

At worker start the bootstep applies those options to ``app.conf``, asks
the store once (:func:`check_store`) and checks every leased task; a mistake
stops the worker with a :class:`~celery_leases.errors.LeaseConfigurationError`
saying what to change. A store that cannot be reached now only gives a
warning: claims are deferred until it can.

On shutdown (``worker_shutdown`` in the main process, after the pool has
stopped, and ``worker_process_shutdown`` in each prefork child) the leases
this process still holds are marked lost and released, and the heartbeat
is stopped. A warm shutdown lets running tasks finish first, so normally
nothing is held by then.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import click
from celery import bootsteps
from celery.bin.base import CeleryOption
from celery.signals import worker_process_init, worker_process_shutdown, worker_shutdown

from celery_leases.broker_checks import (
    broker_warnings,
    filesystem_warnings,
    keep_invisible,
    visibility_source,
    visibility_timeout,
    visibility_transport,
    visibility_warnings,
)
from celery_leases.broker_visibility import enable, read_queue_visibility
from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.green_pools import check_green_on_lost, check_green_store, green_pool
from celery_leases.metrics import install_metrics, serve_metrics
from celery_leases.pool_sizing import most_tasks, size_task_pool
from celery_leases.queue_unique import queued_for
from celery_leases.redact import mask, secrets_of
from celery_leases.runtime import (
    add_bind_hook,
    forget_runtime,
    in_prefork_child,
    on_process_init,
    release_held_leases,
    settings_for,
)
from celery_leases.settings import LeaseSettings, check_defer_max
from celery_leases.spelling import as_spelled, misspelled_settings, misspelled_task_attributes
from celery_leases.stores import open_store
from celery_leases.task import LeasedTask

__all__ = [
    "SQLITE_PAUSE_WARNING",
    "STORE_CHECK_TIMEOUT",
    "LeasesStep",
    "WorkerStartRefused",
    "banner_lines",
    "check_app",
    "check_store",
    "in_prefork_child",
    "install",
    "release_held_leases",
]

logger = logging.getLogger("celery_leases")

#: seconds the start check waits for the store. Above the Redis store's own
#: 5 s socket timeouts, so their clearer StoreUnavailable arrives first.
STORE_CHECK_TIMEOUT = 10.0

_installed: weakref.WeakSet[Any] = weakref.WeakSet()

#: the worker's lease options: name, type, help
_OPTIONS = (
    ("--leases-store", str, "Lease store URL (overrides the leases_store setting)."),
    ("--leases-ttl", float, "Lease time in seconds (overrides the leases_ttl setting)."),
    (
        "--leases-metrics-port",
        int,
        "Serve Prometheus metrics on this port, 0 for a free one (shown in the "
        "banner); overrides the leases_metrics_port setting.",
    ),
)


def install(app: Any) -> None:
    """Add the CLI options and the bootstep to ``app``; idempotent per app."""
    if app in _installed:
        return
    _installed.add(app)
    for option, kind, help_text in _OPTIONS:
        app.user_options["worker"].add(
            CeleryOption(
                [option], type=kind, default=None, help=help_text, help_group="Lease Options"
            )
        )
    app.steps["worker"].add(LeasesStep)
    worker_process_init.connect(on_process_init, weak=False, dispatch_uid="celery_leases.init")
    worker_process_shutdown.connect(
        _on_shutdown, weak=False, dispatch_uid="celery_leases.process_shutdown"
    )
    worker_shutdown.connect(_on_shutdown, weak=False, dispatch_uid="celery_leases.shutdown")
    install_metrics(app, required=False)


def _on_shutdown(**_: Any) -> None:
    release_held_leases("shutdown")


class LeasesStep(bootsteps.Step):  # type: ignore[misc]  # celery ships no type hints
    """Worker bootstep: apply the CLI options, then check the lease setup.

    Raises:
        LeaseConfigurationError: from worker construction, when the setup is wrong.
    """

    label = "Leases"

    def __init__(
        self,
        parent: Any,
        leases_store: str | None = None,
        leases_ttl: float | None = None,
        leases_metrics_port: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(parent, **kwargs)
        app = parent.app
        if leases_store is not None:
            app.conf.leases_store = leases_store
        if leases_ttl is not None:
            app.conf.leases_ttl = leases_ttl
        if leases_metrics_port is not None:
            app.conf.leases_metrics_port = leases_metrics_port
        if leases_store is not None or leases_ttl is not None:
            forget_runtime(app)  # settings read before the options must be read again
        pool = str(getattr(parent, "pool_cls", "") or kwargs.get("pool", "") or "")
        try:
            tasks = most_tasks(int(parent.concurrency or 0), kwargs.get("autoscale"))
            widen = size_task_pool(app, pool, tasks)
            warnings = check_app(app, pool=pool) + ([widen] if widen else [])
            # before the pool starts, and before the banner that shows the port
            metrics_url = serve_metrics(app)
        except LeaseConfigurationError as exc:
            # the message says what to change; a 40-line traceback through
            # Celery's start would bury it, so it goes to the debug log only
            logger.debug("the lease setup check failed", exc_info=True)
            message = as_spelled(str(exc), app.conf)
            logger.error("celery-leases: the worker cannot start: %s", message)
            raise WorkerStartRefused(message) from None
        for warning in warnings:
            logger.warning(as_spelled(warning, app.conf))
        if keep_invisible(app):
            enable(app)  # before the pool forks: every pool process inherits it
        _add_to_banner(parent, banner_lines(settings_for(app), metrics_url=metrics_url))


def banner_lines(settings: LeaseSettings, *, metrics_url: str | None = None) -> list[str]:
    """The ``[leases]`` section of the worker's banner.

    The store (password masked), the ttl and, when served, the metrics page.
    """
    secrets = secrets_of(settings.store_url, settings.store_options)
    timing = settings.timing()
    lines = [
        "[leases]",
        f".> store:       {mask(settings.store_url, secrets=secrets)}",
        f".> ttl:         {timing.ttl:g} s, renewed every {round(timing.renew_interval, 2):g} s "
        "(a task's lease_ttl overrides it)",
    ]
    if metrics_url is not None:
        lines.append(f".> metrics:     {metrics_url}")
    return lines


def _add_to_banner(worker: Any, lines: list[str]) -> None:
    """Append ``lines`` to the banner ``celery worker`` prints after the start checks.

    Celery has no hook for the banner: the worker's ``startup_info`` is
    wrapped on this instance only (a programmatic worker has none).
    """
    startup_info = getattr(worker, "startup_info", None)
    if startup_info is None:
        return

    def with_leases(artlines: bool = True) -> str:
        indent = " " * 16 if artlines else ""  # the width of Celery's ASCII art
        return str(startup_info(artlines=artlines)) + "".join(f"{indent}{line}\n" for line in lines)

    worker.startup_info = with_leases


class WorkerStartRefused(LeaseConfigurationError, click.ClickException):
    """The lease setup stops the worker at start.

    A :class:`~celery_leases.errors.LeaseConfigurationError` that
    ``celery worker`` (a click program) prints as one line,
    ``Error: <what to change>``, exiting with status 1; the traceback is
    logged at debug level (``--loglevel DEBUG``).
    """

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)  # click's message and colour
        LeaseConfigurationError.__init__(self, message)


def check_app(
    app: Any,
    *,
    pool: str = "",
    store_timeout: float = STORE_CHECK_TIMEOUT,
    errors: list[str] | None = None,
) -> list[str]:
    """Check the lease settings, the store and every leased task of ``app``.

    Args:
        pool: the pool class name or alias, when known (for the ``stop`` check).
        store_timeout: seconds to wait for the store's answer (see :func:`check_store`).
        errors: if given, a task's or the store's mistake is appended here
            and the checks go on, instead of raising at the first one.

    Returns:
        Warnings worth logging.

    Raises:
        LeaseConfigurationError: a setting or a task cannot work; the message
            says what to change.
    """
    warnings = misspelled_settings(app.conf)
    try:
        settings = settings_for(app)
    except LeaseConfigurationError as exc:
        if not warnings:
            raise
        raise LeaseConfigurationError(f"{exc} ({'; '.join(warnings)})") from exc
    try:
        store_warning = check_store(settings, timeout=store_timeout)
    except LeaseConfigurationError as exc:
        if errors is None:
            raise
        errors.append(str(exc))
        store_warning = None
    if store_warning is not None:
        warnings.append(store_warning)
    # what an existing SQS queue really has, before anything reads the timeout
    warnings += read_queue_visibility(app)
    # with leases_broker_keep_invisible, renewals keep a run's message
    # invisible on Redis and SQS (not on the filesystem broker): a run may
    # outlast the visibility timeout there
    extended = keep_invisible(app) and visibility_transport(app) is not None
    visibility = None if extended else visibility_timeout(app)
    prefork = pool == "" or "prefork" in pool.lower()
    green = green_pool(pool)
    if green is not None:
        try:
            check_green_store(app, green)
        except LeaseConfigurationError as exc:
            if errors is None:
                raise
            errors.append(str(exc))
    for task in list(app.tasks.values()):
        if not isinstance(task, LeasedTask):
            continue
        warnings += misspelled_task_attributes(task, LeasedTask)
        try:
            warnings += _check_task(app, task, visibility, prefork, pool)
            if green is not None:
                check_green_on_lost(task.name, task.lease_on_lost_mode(), green)
        except LeaseConfigurationError as exc:
            if errors is None:
                raise
            errors.append(str(exc))
    leased = [task for task in list(app.tasks.values()) if isinstance(task, LeasedTask)]
    warnings.extend(broker_warnings(app, leased))
    warnings.extend(visibility_warnings(app, leased))
    warnings.extend(filesystem_warnings(app))
    return warnings


def _check_task(
    app: Any, task: Any, visibility: float | None, prefork: bool, pool: str
) -> list[str]:
    """Warnings about one leased task; raises LeaseConfigurationError for a mistake."""
    warnings: list[str] = []
    if not task.acks_late:
        raise LeaseConfigurationError(
            f"task {task.name!r} is leased but has acks_late=False: a worker lost mid-run "
            "would drop the job. Remove acks_late=False from the task (and check "
            "task_acks_late), or do not use LeasedTask for it"
        )
    try:
        timing = task.lease_timing()
    except LeaseConfigurationError as exc:
        raise LeaseConfigurationError(f"task {task.name!r}: {exc}") from exc
    mode = task.lease_on_lost_mode()
    task.lease_on_busy_mode()
    task.lease_takeover_limit()
    if task.lease_defer_max is not None:
        check_defer_max(task.lease_defer_max, f"{task.name}.lease_defer_max")
    queued_for(task)  # lease_queue_unique: a bound, and a lease_key to mark
    key = type(task).lease_key
    if key is not None and not isinstance(key, str) and not callable(key):
        raise LeaseConfigurationError(
            f"lease_key of task {task.name!r} must be None, a format string or a "
            f"callable, got {key!r}"
        )
    if visibility is not None and visibility < timing.ttl:
        warnings.append(
            f"the broker's visibility_timeout ({visibility:g} s) is shorter than the lease "
            f"ttl of task {task.name!r} ({timing.ttl:g} s): every long run is delivered "
            "again and deferred over and over; set leases_broker_keep_invisible = True "
            f"(Redis, SQS), or raise {visibility_source(app)} well above your longest run"
        )
    time_limit = task.time_limit or app.conf.task_time_limit
    if visibility is not None and time_limit and time_limit > visibility:
        warnings.append(
            f"task {task.name!r} may run for {time_limit:g} s (time_limit) but the "
            f"broker's visibility_timeout is {visibility:g} s: a run longer than that is "
            "delivered again while it runs; the copy is deferred, not run, but set "
            "leases_broker_keep_invisible = True (Redis, SQS), or raise "
            f"{visibility_source(app)} above the time limit"
        )
    if not task.reject_on_worker_lost:
        warnings.append(
            f"task {task.name!r} has reject_on_worker_lost=False: when a worker is "
            "killed mid-run its message is acknowledged and the job is lost"
        )
    if mode == "stop" and not prefork:
        warnings.append(
            f"task {task.name!r} uses lease_on_lost='stop' with the {pool} pool: a lost "
            "lease raises LeaseLost in the task instead (only prefork children can be "
            "stopped alone)"
        )
    return warnings


#: the start warning of an SQLite store: nothing bounds how long a paused
#: process holds its write lock
SQLITE_PAUSE_WARNING = (
    "the lease store is SQLite: a worker process paused (SIGSTOP, a frozen VM, swapped "
    "out) inside an exactly_once block, or inside any write, keeps the whole database's "
    "write lock until it runs again, and nothing can bound that: every claim, renewal and "
    "completion of every worker waits for it. Use PostgreSQL or MariaDB/MySQL where "
    "worker processes can be paused"
)


def check_store(settings: LeaseSettings, *, timeout: float = STORE_CHECK_TIMEOUT) -> str | None:
    """Open the lease store and ask it the time once, waiting at most ``timeout`` s.

    Opening checks the URL, the options and the driver; the question (one
    round trip) checks that the server takes this worker. A Redis store does
    not connect on open, so without it a wrong password showed only at the
    first task. The call runs in a daemon thread, so a store that never
    answers (a frozen server, a client without socket timeouts) cannot hold
    the worker's start; that thread closes the store when the call ends.

    Returns:
        A warning when the store cannot be reached now (claims are deferred
        until it can), or when it is SQLite (:data:`SQLITE_PAUSE_WARNING`),
        else None.

    Raises:
        LeaseConfigurationError: the store refuses this worker for good (bad
            URL or options, wrong password, missing database, no rights).
    """
    outcome: list[Exception | None] = []
    dialects: list[object] = []

    def ask() -> None:
        try:
            store = open_store(settings.store_url, **dict(settings.store_options))
            dialects.append(getattr(store, "dialect_name", None))
            try:
                store.now_ms()
            finally:
                store.close()
        except Exception as exc:  # every error goes to the waiting thread
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=ask, name="celery-leases-store-check", daemon=True)
    thread.start()
    thread.join(timeout)
    secrets = secrets_of(settings.store_url, settings.store_options)
    if not outcome:
        return (
            f"the lease store did not answer within {timeout:g} s; leased tasks are "
            "deferred until it can"
        )
    error = outcome[0]
    if error is None:
        return SQLITE_PAUSE_WARNING if dialects == ["sqlite"] else None
    if isinstance(error, StoreUnavailable):
        return mask(
            f"the lease store cannot be reached now ({error}); leased tasks are deferred "
            "until it can",
            secrets=secrets,
        )
    if isinstance(error, LeaseConfigurationError):
        message = mask(str(error), secrets=secrets)
        # a message that had to be cleaned must not come back in a traceback
        cause = error if message == str(error) else None
        raise LeaseConfigurationError(
            f"the lease store cannot be used: {message.rstrip('.')}. Change leases_store or "
            "leases_store_options (or --leases-store)"
        ) from cause
    raise error


# a LeasedTask bound to an app installs this module's options and bootstep
add_bind_hook(install)
