"""Optional Prometheus metrics of leased tasks (``pip install 'celery-leases[metrics]'``).

:func:`install_metrics` connects receivers to the signals of
:mod:`celery_leases.signals`. With the setting ``leases_metrics_port`` (or the
worker option ``--leases-metrics-port``; 0 picks a free port, shown in the
banner), each worker serves the metrics of all its processes over HTTP on
that port (``leases_metrics_address``, ``127.0.0.1`` by default): the main process
points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder before the pool
starts, so prefork children write their values there, and the server adds
them up (prometheus-client's multiprocess mode). Without the setting the
metrics go to prometheus-client's default registry, for an exporter of
your own; see :func:`metrics_registry`.

Labels are task names and reasons only: no job ids (unbounded) and no store
URLs (secrets).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from celery_leases import signals
from celery_leases.errors import LeaseConfigurationError
from celery_leases.values import is_whole

__all__ = [
    "DEFAULT_ADDRESS",
    "install_metrics",
    "metrics_registry",
    "observe_store_error",
    "serve_metrics",
]

logger = logging.getLogger("celery_leases")

_lock = threading.Lock()
_metrics: dict[str, Any] = {}
#: leases this process holds, by ``id(lease)``, with their task name, for
#: the ``held`` gauge; the lease is kept so its id is not reused meanwhile
_held: dict[int, tuple[Any, str]] = {}
#: how many of them each task holds: a claim or a finish moves one count,
#: without walking every held lease (a process may hold thousands)
_held_counts: dict[str, int] = {}
_owned_dir: str | None = None
#: the metrics HTTP server of this worker's main process, and that pid
_server: Any = None
_server_pid: int | None = None
#: where the metrics server listens unless ``leases_metrics_address`` says
#: otherwise: this host only, as the page names the tasks a worker runs
DEFAULT_ADDRESS = "127.0.0.1"
#: a metric's child per label values, made once: prometheus-client's
#: ``labels()`` checks and locks on every call, twice per trivial task
_children: dict[tuple[str, tuple[str, ...]], Any] = {}

#: deferral reasons that mean the claim itself did not get the lease
_CLAIM_OUTCOMES = {"held": "held", "store-unavailable": "store_unavailable"}
#: lost reasons that mean the store could not be asked
_STORE_ERROR_REASONS = ("unavailable", "heartbeat-error")


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise LeaseConfigurationError(
            "lease metrics need prometheus-client: pip install 'celery-leases[metrics]'"
        ) from exc
    return prometheus_client


def _get() -> dict[str, Any]:
    """The metric objects of this process, made on first use."""
    with _lock:
        if _metrics:
            return _metrics
        p = _prometheus()
        task = ["task"]
        _metrics.update(
            claims=p.Counter("celery_leases_claims", "Claims by outcome.", [*task, "outcome"]),
            renew=p.Histogram(
                "celery_leases_renew_seconds",
                "Time from sending a renewal to its acceptance.",
                task,
                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            ),
            held=p.Gauge(
                "celery_leases_held", "Leases held now.", task, multiprocess_mode="livesum"
            ),
            lost=p.Counter("celery_leases_lost", "Leases lost, by reason.", [*task, "reason"]),
            fenced_out=p.Counter(
                "celery_leases_fenced_out",
                "Runs whose result was not recorded because their lease was lost.",
                [*task, "reason"],
            ),
            deferred=p.Counter(
                "celery_leases_deferred",
                "Deliveries that did not run and were published again, by reason.",
                [*task, "reason"],
            ),
            skipped=p.Counter(
                "celery_leases_skipped",
                "Deliveries that did not run and were not published again, by reason.",
                [*task, "reason"],
            ),
            takeovers=p.Counter(
                "celery_leases_takeovers",
                "Claims that took over a lease whose holder let it run out.",
                task,
            ),
            store_errors=p.Counter(
                "celery_leases_store_errors",
                "Store operations that failed (the store could not be asked).",
                ["operation"],
            ),
        )
        return _metrics


def _child(name: str, *labels: str) -> Any:
    """The child of metric ``name`` with these label values."""
    key = (name, labels)
    child = _children.get(key)
    if child is None:
        child = _get()[name].labels(*labels)
        with _lock:
            child = _children.setdefault(key, child)
    return child


def observe_store_error(operation: str) -> None:
    """Count a failed store ``operation`` (``claim``, ``renew``, ...)."""
    _child("store_errors", operation).inc()


def _task(sender: Any, lease: Any) -> str:
    return str(getattr(sender, "name", None) or getattr(lease, "task_name", "") or "")


def _hold(lease: Any, task: str) -> int | None:
    """Count ``lease`` as held by ``task``; the new count, None if it was already."""
    with _lock:
        if id(lease) in _held:
            return None
        _held[id(lease)] = (lease, task)
        count = _held_counts[task] = _held_counts.get(task, 0) + 1
        return count


def _let_go(lease: Any) -> tuple[str, int] | None:
    """Stop counting ``lease``; its task and that task's new count, None if not held."""
    with _lock:
        entry = _held.pop(id(lease), None)
        if entry is None:
            return None
        task = entry[1]
        count = _held_counts[task] = _held_counts[task] - 1
        return task, count


def _on_claimed(sender: Any = None, lease: Any = None, **kwargs: Any) -> None:
    task = _task(sender, lease)
    _child("claims", task, "acquired").inc()
    # a ``takeover`` flag names this claim exactly; ``takeovers`` counts the
    # job's takeovers so far, so it also stays above 0 on later claims
    takeover = kwargs.get("takeover")
    if takeover is None:
        takeover = int(kwargs.get("takeovers") or 0) > 0
    if takeover:
        _child("takeovers", task).inc()
    if lease is not None:
        count = _hold(lease, task)
        if count is not None:
            _child("held", task).set(count)


def _on_finished(sender: Any = None, lease: Any = None, **_: Any) -> None:
    if lease is None:
        return
    released = _let_go(lease)
    if released is not None:
        task, count = released
        _child("held", task).set(count)


def _on_renewed(sender: Any = None, lease: Any = None, **kwargs: Any) -> None:
    round_trip = kwargs.get("round_trip")
    if round_trip is None and lease is not None:
        # the local deadline is counted from when the renewal was sent
        round_trip = time.monotonic() - (lease.deadline - lease.timing.safe_duration)
    if round_trip is not None and round_trip >= 0:
        _child("renew", _task(sender, lease)).observe(round_trip)


def _on_lost(sender: Any = None, lease: Any = None, reason: Any = None, **_: Any) -> None:
    _child("lost", _task(sender, lease), str(reason or "unknown")).inc()
    if reason in _STORE_ERROR_REASONS:
        observe_store_error("renew")
    _on_finished(sender, lease)


def _on_fenced_out(sender: Any = None, lease: Any = None, reason: Any = None, **_: Any) -> None:
    _child("fenced_out", _task(sender, lease), str(reason or "unknown")).inc()
    _on_finished(sender, lease)


def _on_deferred(sender: Any = None, lease: Any = None, reason: Any = None, **_: Any) -> None:
    task = _task(sender, lease)
    _child("deferred", task, str(reason or "unknown")).inc()
    outcome = _CLAIM_OUTCOMES.get(str(reason))
    if outcome is not None and lease is None:
        _child("claims", task, outcome).inc()
    if reason == "store-unavailable":
        observe_store_error("claim")


def _on_skipped(sender: Any = None, reason: Any = None, **_: Any) -> None:
    task = _task(sender, None)
    _child("skipped", task, str(reason or "unknown")).inc()
    if reason == "busy":
        _child("claims", task, "held").inc()


_RECEIVERS = (
    (signals.lease_claimed, _on_claimed),
    (signals.lease_renewed, _on_renewed),
    (signals.lease_lost, _on_lost),
    (signals.lease_fenced_out, _on_fenced_out),
    (signals.lease_completed, _on_finished),
    (signals.lease_released, _on_finished),
    (signals.duplicate_deferred, _on_deferred),
    (signals.lease_skipped, _on_skipped),
)


def _port(app: Any) -> int | None:
    port = app.conf.get("leases_metrics_port")
    if port is not None and not is_whole(port, 0, 65535):
        raise LeaseConfigurationError(
            "leases_metrics_port must be a TCP port number (1-65535), 0 for a free port, "
            f"or None, got {port!r}"
        )
    return port


def _connect_receivers() -> None:
    for signal, receiver in _RECEIVERS:
        signal.connect(receiver, weak=False, dispatch_uid=f"celery_leases.metrics.{receiver}")


def install_metrics(app: Any, *, required: bool = True) -> None:
    """Count lease signals in Prometheus metrics; serve them if configured.

    Idempotent. ``leases_metrics_port`` (an int, 0 for a free port, or None
    for no server) and ``leases_metrics_address`` are read when the worker
    starts.

    Args:
        required: with True (a call of your own) the metrics are on and
            prometheus-client must be installed. With False (the call the
            library makes on every app) the metrics stay off, and cost a
            task nothing, unless ``leases_metrics_port`` is set; a port set
            without prometheus-client stops the worker with an error saying
            what to install.

    Raises:
        LeaseConfigurationError: prometheus-client is missing (and
            ``required``), or the port is not a valid port number.
    """
    from celery.signals import (
        worker_init,
        worker_process_init,
        worker_process_shutdown,
        worker_ready,
        worker_shutdown,
    )

    _port(app)
    if required:
        _prometheus()
        _connect_receivers()

    def prepare(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", app) is app:
            _prepare(app)

    def serve(sender: Any = None, **_: Any) -> None:
        # the worker's bootstep serves before the banner; this is for a
        # worker without it
        if getattr(sender, "app", app) is app:
            try:
                serve_metrics(app)
            except LeaseConfigurationError as exc:
                logger.error("lease metrics: %s", exc)

    uid = f"celery_leases.metrics.{id(app)}"
    worker_init.connect(prepare, weak=False, dispatch_uid=f"{uid}.init")
    worker_ready.connect(serve, weak=False, dispatch_uid=f"{uid}.ready")
    worker_process_init.connect(_close_inherited_server, weak=False, dispatch_uid=f"{uid}.fork")
    worker_process_shutdown.connect(_process_gone, weak=False, dispatch_uid=f"{uid}.child")
    worker_shutdown.connect(_remove_dir, weak=False, dispatch_uid=f"{uid}.shutdown")


def _prepare(app: Any) -> int | None:
    """With a port set: the receivers on, the multiprocess folder chosen; the port."""
    port = _port(app)
    if port is not None:
        _prometheus()  # a configured port without the package: say what to install
        _connect_receivers()
        _use_multiprocess_dir()
    return port


def serve_metrics(app: Any) -> str | None:
    """Serve the worker's metrics, if ``leases_metrics_port`` is set; idempotent.

    Call it in the worker's main process before the pool starts (the
    bootstep does, so the banner can show the address).

    Returns:
        The URL of the metrics page (with the port the system chose, for
        port 0), or None without a port.

    Raises:
        LeaseConfigurationError: the port is invalid, prometheus-client is
            missing, or the address cannot be listened on (port taken).
    """
    global _server, _server_pid
    port = _prepare(app)
    if port is None:
        return None
    address = str(app.conf.get("leases_metrics_address") or DEFAULT_ADDRESS)
    with _lock:
        if _server is None or _server_pid != os.getpid():
            try:
                _server, _ = _prometheus().start_http_server(
                    port, addr=address, registry=metrics_registry()
                )
            except OSError as exc:
                raise LeaseConfigurationError(
                    f"the metrics server cannot listen on {address}:{port} ({exc}): choose "
                    "another leases_metrics_port, or --leases-metrics-port 0 for a free one"
                ) from exc
            _server_pid = os.getpid()
            logger.info("lease metrics served on %s", _url(_server.server_address))
        return _url(_server.server_address)


def _url(server_address: tuple[Any, ...]) -> str:
    host, port = str(server_address[0]), int(server_address[1])
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


def _close_inherited_server(**_: Any) -> None:
    """In a forked pool process: close the copy of the listening socket."""
    global _server
    with _lock:
        if _server is not None and _server_pid != os.getpid():
            _server.socket.close()
            _server = None


def _use_multiprocess_dir() -> None:
    """Point prometheus-client at a fresh folder, before any pool process exists."""
    global _owned_dir
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    _owned_dir = tempfile.mkdtemp(prefix="celery-leases-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _owned_dir
    from prometheus_client import values

    # prometheus-client picks its value class when it is imported; pick again
    # now that the folder is set (metrics are made later, on first use)
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    with _lock:
        _metrics.clear()
        _children.clear()


def metrics_registry() -> Any:
    """A registry with the lease metrics of every process of this worker.

    In multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set) a fresh registry
    that reads the folder; else prometheus-client's default registry.
    """
    p = _prometheus()
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return p.REGISTRY
    from prometheus_client import multiprocess

    registry = p.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


def _process_gone(**_: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and "prometheus_client" in sys.modules:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def _remove_dir(**_: Any) -> None:
    if _owned_dir is not None:
        shutil.rmtree(_owned_dir, ignore_errors=True)
