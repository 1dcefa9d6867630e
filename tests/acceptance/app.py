"""The Celery app and the tasks that acceptance-test workers run.

A worker started with ``celery -A tests.acceptance.app worker`` reads its
configuration from ``LEASES_TEST_*`` environment variables (see
:func:`config_from_env`); the test process builds a client app on the same
broker with :func:`make_app`.

Tasks report what they did through a side channel, a Redis database on the
broker server (``LEASES_TEST_SIDE``), since the result backend only ever shows
the accepted run:

- ``side:events`` is a list of JSON events (``start``, ``done``, ``lost``,
  ``attempt``) with the job id, worker name, pid, generation and wall time;
- ``side:done:<job_id>`` counts bodies that reached their last step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery, Task

from celery_leases import LeasedTask, LeaseLost, StoreUnavailable, filesystem
from celery_leases import signals as lease_signals
from tests.green import unpatched_sleep

__all__ = ["AcceptanceConfig", "app", "config_from_env", "make_app"]

#: names of the tasks below, as the test process sends them
STEPS = "acceptance.steps"
WATCH = "acceptance.watch"
FAIL = "acceptance.fail"
RETRY_ONCE = "acceptance.retry_once"
PLAIN_STEPS = "acceptance.plain_steps"
EFFECTS = "acceptance.effects"
ECHO = "acceptance.echo"
HEADERS = "acceptance.headers"
SINGLETON = "acceptance.singleton"
HOG = "acceptance.hog"
SLOW_ONCE = "acceptance.slow_once"
HOLD_HUB = "acceptance.hold_hub"
BEAT = "acceptance.beat"
QUEUE_UNIQUE = "acceptance.queue_unique"
BEAT_QUEUED = "acceptance.beat_queued"


@dataclass(frozen=True)
class AcceptanceConfig:
    """Everything a worker (or the client in the test) needs to know.

    Args:
        broker: broker URL (Redis, or ``filesystem:///folder`` for the
            filesystem transport on that folder).
        backend: result backend URL.
        side: Redis URL of the side channel the tasks write events to.
        queue: the only queue this test's workers consume and tasks go to.
        store: lease store URL.
        store_options: options for the store (prefix, table_name).
        ttl: lease TTL in seconds.
        renew_interval: heartbeat interval, or None for the default (ttl/3).
        on_lost: what a worker does when a lease is lost.
        visibility_timeout: seconds before the broker hands an unacked
            message to another worker.
        soft_shutdown: seconds a cold shutdown waits for running tasks
            before it stops them (``worker_soft_shutdown_timeout``).
        clock_skew: seconds added to the worker's wall clock
            (``time.time``), to act as a worker whose clock is off.
        max_takeovers: ``leases_max_takeovers``, or None for the default.
        defer_max: ``leases_defer_max``, or None for the default.
        broker_write: ``broker_write_url`` (where the worker publishes), or
            None for the broker itself.
        kill_after_complete: the pool process kills itself (SIGKILL) right
            after its first accepted completion of a job, before Celery
            stores the result.
        pickle: the worker also accepts pickled messages (as root, Celery
            then needs ``C_FORCE_ROOT``, which this sets for that worker).
        consumer_timeout: ``leases_broker_consumer_timeout`` (RabbitMQ), or
            None for the default.
        acks_on_timeout: ``task_acks_on_timeout``, or None for Celery's default.
        keep_invisible: ``leases_broker_keep_invisible`` (renewals keep the
            running message invisible on a Redis or SQS broker).
        slow_claimed: a ``lease_claimed`` receiver that, given a lease
            already past its local deadline (a claim reply that came back
            late), waits until the heartbeat notices the loss, as a slow
            receiver would, and records a ``claimed-late`` event.
        timed_endings: a run's accepted completion records a ``completed``
            event, and a fenced-out run a ``fenced-out`` event, each with
            ``past_deadline``: how many seconds after the lease's local
            deadline the run got there (negative: before it).
        result_serializer: ``result_serializer`` of the worker and the
            client (the client also accepts results in it).
    """

    broker: str
    backend: str
    side: str
    queue: str
    store: str = "memory://"
    store_options: dict[str, Any] = field(default_factory=dict)
    ttl: float = 3.0
    renew_interval: float | None = None
    on_lost: str = "flag"
    visibility_timeout: float = 3600.0
    soft_shutdown: float = 0.0
    clock_skew: float = 0.0
    max_takeovers: int | None = None
    defer_max: float | None = None
    broker_write: str | None = None
    kill_after_complete: bool = False
    pickle: bool = False
    consumer_timeout: float | None = None
    acks_on_timeout: bool | None = None
    keep_invisible: bool = False
    slow_claimed: bool = False
    timed_endings: bool = False
    result_serializer: str = "json"

    def to_env(self) -> dict[str, str]:
        """This configuration as the environment variables a worker reads."""
        env = {
            "LEASES_TEST_BROKER": self.broker,
            "LEASES_TEST_BACKEND": self.backend,
            "LEASES_TEST_SIDE": self.side,
            "LEASES_TEST_QUEUE": self.queue,
            "LEASES_TEST_STORE": self.store,
            "LEASES_TEST_STORE_OPTIONS": json.dumps(self.store_options),
            "LEASES_TEST_TTL": str(self.ttl),
            "LEASES_TEST_ON_LOST": self.on_lost,
            "LEASES_TEST_VISIBILITY_TIMEOUT": str(self.visibility_timeout),
            "LEASES_TEST_SOFT_SHUTDOWN": str(self.soft_shutdown),
            "LEASES_TEST_CLOCK_SKEW": str(self.clock_skew),
        }
        if self.renew_interval is not None:
            env["LEASES_TEST_RENEW_INTERVAL"] = str(self.renew_interval)
        if self.max_takeovers is not None:
            env["LEASES_TEST_MAX_TAKEOVERS"] = str(self.max_takeovers)
        if self.defer_max is not None:
            env["LEASES_TEST_DEFER_MAX"] = str(self.defer_max)
        if self.broker_write is not None:
            env["LEASES_TEST_BROKER_WRITE"] = self.broker_write
        if self.kill_after_complete:
            env["LEASES_TEST_KILL_AFTER_COMPLETE"] = "1"
        if self.pickle:
            env["LEASES_TEST_PICKLE"] = env["C_FORCE_ROOT"] = "1"
        if self.consumer_timeout is not None:
            env["LEASES_TEST_CONSUMER_TIMEOUT"] = str(self.consumer_timeout)
        if self.acks_on_timeout is not None:
            env["LEASES_TEST_ACKS_ON_TIMEOUT"] = "1" if self.acks_on_timeout else "0"
        if self.keep_invisible:
            env["LEASES_TEST_KEEP_INVISIBLE"] = "1"
        if self.slow_claimed:
            env["LEASES_TEST_SLOW_CLAIMED"] = "1"
        if self.timed_endings:
            env["LEASES_TEST_TIMED_ENDINGS"] = "1"
        if self.result_serializer != "json":
            env["LEASES_TEST_RESULT_SERIALIZER"] = self.result_serializer
        return env


def config_from_env(environ: dict[str, str] | None = None) -> AcceptanceConfig:
    """Read an :class:`AcceptanceConfig` from ``LEASES_TEST_*`` variables.

    Without them (the module imported outside a test worker), the defaults
    point at a local Redis and the memory store, so importing never fails.
    """
    env = os.environ if environ is None else environ
    broker = env.get("LEASES_TEST_BROKER", "redis://127.0.0.1:6379/0")
    renew = env.get("LEASES_TEST_RENEW_INTERVAL")
    max_takeovers = env.get("LEASES_TEST_MAX_TAKEOVERS")
    defer_max = env.get("LEASES_TEST_DEFER_MAX")
    consumer_timeout = env.get("LEASES_TEST_CONSUMER_TIMEOUT")
    acks_on_timeout = env.get("LEASES_TEST_ACKS_ON_TIMEOUT")
    return AcceptanceConfig(
        broker=broker,
        backend=env.get("LEASES_TEST_BACKEND", broker),
        side=env.get("LEASES_TEST_SIDE", broker),
        queue=env.get("LEASES_TEST_QUEUE", "acceptance"),
        store=env.get("LEASES_TEST_STORE", "memory://"),
        store_options=json.loads(env.get("LEASES_TEST_STORE_OPTIONS", "{}")),
        ttl=float(env.get("LEASES_TEST_TTL", "3")),
        renew_interval=float(renew) if renew else None,
        on_lost=env.get("LEASES_TEST_ON_LOST", "flag"),
        visibility_timeout=float(env.get("LEASES_TEST_VISIBILITY_TIMEOUT", "3600")),
        soft_shutdown=float(env.get("LEASES_TEST_SOFT_SHUTDOWN", "0")),
        clock_skew=float(env.get("LEASES_TEST_CLOCK_SKEW", "0")),
        max_takeovers=int(max_takeovers) if max_takeovers else None,
        defer_max=float(defer_max) if defer_max else None,
        broker_write=env.get("LEASES_TEST_BROKER_WRITE") or None,
        kill_after_complete=env.get("LEASES_TEST_KILL_AFTER_COMPLETE") == "1",
        pickle=env.get("LEASES_TEST_PICKLE") == "1",
        consumer_timeout=float(consumer_timeout) if consumer_timeout else None,
        acks_on_timeout=None if acks_on_timeout is None else acks_on_timeout == "1",
        keep_invisible=env.get("LEASES_TEST_KEEP_INVISIBLE") == "1",
        slow_claimed=env.get("LEASES_TEST_SLOW_CLAIMED") == "1",
        timed_endings=env.get("LEASES_TEST_TIMED_ENDINGS") == "1",
        result_serializer=env.get("LEASES_TEST_RESULT_SERIALIZER", "json"),
    )


def make_app(config: AcceptanceConfig) -> Celery:
    """A Celery app on ``config``'s broker, backend and lease store."""
    celery_app = Celery("acceptance", broker=config.broker, backend=config.backend)
    celery_app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_default_queue=config.queue,
        task_track_started=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options=_transport_options(config),
        worker_soft_shutdown_timeout=config.soft_shutdown,
        leases_store=config.store,
        leases_store_options=config.store_options,
        leases_ttl=config.ttl,
        leases_on_lost=config.on_lost,
    )
    if config.renew_interval is not None:
        celery_app.conf.leases_renew_interval = config.renew_interval
    if config.max_takeovers is not None:
        celery_app.conf.leases_max_takeovers = config.max_takeovers
    if config.defer_max is not None:
        celery_app.conf.leases_defer_max = config.defer_max
        celery_app.conf.leases_defer_backoff = min(1.0, config.defer_max)
    if config.broker_write is not None:
        celery_app.conf.broker_write_url = config.broker_write
    if config.pickle:
        celery_app.conf.accept_content = ["json", "pickle"]
    if config.broker.startswith("amqp"):
        # a frozen worker's connection is closed within seconds, and its
        # unacked message goes to another worker
        celery_app.conf.broker_heartbeat = 2
    if config.broker.startswith("sqs"):
        celery_app.conf.worker_enable_remote_control = False  # SQS has no fanout
    if config.broker.startswith("filesystem"):
        celery_app.conf.broker_transport = filesystem.TRANSPORT
        celery_app.conf.worker_enable_remote_control = False  # no fanout there either
    if config.consumer_timeout is not None:
        celery_app.conf.leases_broker_consumer_timeout = config.consumer_timeout
    if config.acks_on_timeout is not None:
        celery_app.conf.task_acks_on_timeout = config.acks_on_timeout
    if config.keep_invisible:
        celery_app.conf.leases_broker_keep_invisible = True
    if config.result_serializer != "json":
        celery_app.conf.result_serializer = config.result_serializer
        celery_app.conf.result_accept_content = ["json", config.result_serializer]
    _register_tasks(celery_app, config)
    return celery_app


def _transport_options(config: AcceptanceConfig) -> dict[str, Any]:
    if config.broker.startswith("amqp"):
        return {}
    if config.broker.startswith("filesystem"):
        # filesystem:///path: the test's broker folder (kombu reads no URL there)
        folder = Path(urlsplit(config.broker).path)
        for name in ("messages", "processed", "control"):
            (folder / name).mkdir(parents=True, exist_ok=True)
        return {
            "data_folder_in": str(folder / "messages"),
            "data_folder_out": str(folder / "messages"),
            "store_processed": True,
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"),
            "visibility_timeout": config.visibility_timeout,
            "polling_interval": 0.1,
        }
    options: dict[str, Any] = {"visibility_timeout": config.visibility_timeout}
    if config.broker.startswith("sqs"):
        # the local server speaks plain HTTP; poll often, so a test waits little
        options.update(
            region="us-east-1", is_secure=False, wait_time_seconds=1, polling_interval=0.1
        )
    else:
        # kombu sweeps unacked messages every interval * throttle seconds
        # (100 s by default): make a short visibility timeout take effect
        options.update(unacked_restore_interval=1, unacked_restore_throttle=1)
    return options


_side_clients: dict[tuple[int, str], redis.Redis] = {}


def side_channel(url: str) -> redis.Redis:
    """A Redis client for the side channel, one per process (fork-safe)."""
    key = (os.getpid(), url)
    if key not in _side_clients:
        _side_clients[key] = redis.Redis.from_url(url)
    return _side_clients[key]


def _event(config: AcceptanceConfig, task: Task, kind: str, **fields: Any) -> None:
    lease = getattr(task, "lease", None)
    record = {
        "event": kind,
        "job": task.request.id,
        "worker": task.request.hostname,
        "pid": os.getpid(),
        "generation": getattr(lease, "generation", None),
        "at": time.time(),
        **fields,
    }
    side_channel(config.side).rpush("side:events", json.dumps(record))


def _sleep_steps(seconds: float, step: float) -> None:
    # time.monotonic, so a worker frozen past the end finishes at once on resume
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(step, max(deadline - time.monotonic(), 0.0)))


def _kill_after_first_completion(config: AcceptanceConfig) -> None:
    """SIGKILL this process once per job, right after its completion is accepted."""

    def kill(sender: Any, job_id: str, **_: Any) -> None:
        if side_channel(config.side).set(f"side:killed:{job_id}", 1, nx=True):
            _event(config, sender, "killed")
            os.kill(os.getpid(), signal.SIGKILL)

    lease_signals.lease_completed.connect(kill, weak=False)


def _wait_for_loss_when_claimed_late(config: AcceptanceConfig) -> None:
    """A slow ``lease_claimed`` receiver: a lease that came back past its
    local deadline is held here until the heartbeat has marked it lost."""

    def wait(sender: Any, lease: Any, **_: Any) -> None:
        if lease.remaining() > 0:
            return  # claimed in time: nothing to wait for
        end = time.monotonic() + 30.0
        while lease.loss is None and time.monotonic() < end:
            time.sleep(0.01)
        _event(config, sender, "claimed-late", noticed=lease.loss is not None)

    lease_signals.lease_claimed.connect(wait, weak=False)


def _time_endings(config: AcceptanceConfig) -> None:
    """Record when each run's completion was accepted or the run fenced
    out, against its lease's local deadline."""

    def ended(kind: str) -> Any:
        def record(sender: Any, lease: Any, **fields: Any) -> None:
            past = time.monotonic() - lease.deadline
            _event(config, sender, kind, past_deadline=past, reason=fields.get("reason"))

        return record

    lease_signals.lease_completed.connect(ended("completed"), weak=False)
    lease_signals.lease_fenced_out.connect(ended("fenced-out"), weak=False)


def _gated(config: AcceptanceConfig, task: Task, key: str, value: Any) -> Any:
    """Report the start, wait until ``side:gate:<key>`` exists, return ``value``."""
    _event(config, task, "start", value=value)
    side = side_channel(config.side)
    deadline = time.monotonic() + 120
    while not side.exists(f"side:gate:{key}") and time.monotonic() < deadline:
        time.sleep(0.05)
    side.incr(f"side:done:{task.request.id}")
    return value


def _register_tasks(celery_app: Celery, config: AcceptanceConfig) -> None:
    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=STEPS)
    def steps(self: Any, seconds: float, step: float = 0.05) -> dict[str, Any]:
        """Sleep in small steps, then report who ran it with which token."""
        _event(config, self, "start")
        _sleep_steps(seconds, step)
        side_channel(config.side).incr(f"side:done:{self.request.id}")
        _event(config, self, "done")
        return {"worker": self.request.hostname, "generation": self.lease.generation}

    @celery_app.task(
        base=LeasedTask, bind=True, shared=False, name=BEAT, lease_key="beat",
        lease_on_busy="skip",
    )  # fmt: skip
    def beat(self: Any, seconds: float, step: float = 0.05) -> dict[str, Any]:
        """``steps`` as one job whatever the call (a beat entry's task): a call
        while another runs is skipped (``lease_on_busy="skip"``)."""
        _event(config, self, "start")
        _sleep_steps(seconds, step)
        _event(config, self, "done")
        return {"worker": self.request.hostname, "generation": self.lease.generation}

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=WATCH)
    def watch(self: Any, seconds: float, step: float = 0.02) -> None:
        """Poll ``lease.check()``; record the last local deadline and LeaseLost.

        The ``ok`` events carry ``deadline`` = wall time + ``remaining()``,
        the local deadline as the lease saw it at that moment.
        """
        _event(config, self, "start")
        end = time.monotonic() + seconds
        last_ok = 0.0
        while time.monotonic() < end:
            try:
                self.lease.check()
            except LeaseLost as exc:
                _event(config, self, "lost", reason=exc.reason)
                raise
            now = time.time()
            if now - last_ok >= 0.1:
                _event(config, self, "ok", deadline=now + self.lease.remaining())
                last_ok = now
            time.sleep(step)

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=FAIL)
    def fail(self: Any, seconds: float = 0.2) -> None:
        """Run a little, then fail."""
        _event(config, self, "start")
        _sleep_steps(seconds, 0.05)
        raise ValueError("this task always fails")

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=RETRY_ONCE)
    def retry_once(self: Any, countdown: float = 2.0) -> int:
        """Retry once with ``countdown``; the second attempt returns its token."""
        _event(config, self, "attempt", retries=self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=countdown, max_retries=1)
        return int(self.lease.generation)

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=EFFECTS)
    def effects(self: Any, seconds: float, step: float = 0.05) -> None:
        """Produce an effect every ``step`` seconds without ever checking the lease.

        Only the worker can stop it in time (``lease_on_lost`` "stop" or "raise").
        """
        _event(config, self, "start")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            _event(config, self, "effect")
            time.sleep(step)

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=HOG)
    def hog(self: Any, seconds: float, threads: int) -> int:
        """Read the job's record through the worker's store from ``threads``
        threads, over and over, as that many busy tasks would: the tasks'
        connections are all in use. Returns how often none was free."""
        _event(config, self, "start")
        end = time.monotonic() + seconds
        store, job_id = self.lease.store, self.request.id
        full: list[int] = []

        def read() -> None:
            count = 0
            while time.monotonic() < end:
                try:
                    store.get(job_id)
                except StoreUnavailable:
                    count += 1
                    time.sleep(0.001)
            full.append(count)

        readers = [threading.Thread(target=read) for _ in range(threads)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        return sum(full)

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=ECHO)
    def echo(self: Any, value: Any) -> dict[str, Any]:
        """Return ``value`` (any type its serializer carries) and the deferrals seen."""
        _event(config, self, "start")
        if isinstance(value, (set, frozenset)):
            value = sorted(value)  # a JSON result backend stores lists
        return {"value": value, "deferrals": self.request.get("leases_deferrals")}

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=HEADERS)
    def headers(self: Any, *names: str) -> dict[str, Any]:
        """The message headers ``names`` as the body sees them, and the deferrals."""
        _event(config, self, "start")
        seen = self.request.headers or {}
        return {
            "headers": {name: seen.get(name) for name in names},
            "attributes": {name: self.request.get(name) for name in names},
            "deferrals": self.request.get("leases_deferrals"),
        }

    @celery_app.task(
        base=LeasedTask, bind=True, shared=False, name=SINGLETON, lease_key="singleton-{key}"
    )
    def singleton(self: Any, key: str, value: Any, seconds: float = 0.0) -> Any:
        """Return ``value`` after ``seconds``; one job per ``key`` (a custom lease_key)."""
        _event(config, self, "start")
        _sleep_steps(seconds, 0.05)
        side_channel(config.side).incr(f"side:done:{self.request.id}")
        return value

    @celery_app.task(
        base=LeasedTask, bind=True, shared=False, name=QUEUE_UNIQUE,
        lease_key="queued-{key}", lease_queue_unique=True,
    )  # fmt: skip
    def queue_unique(self: Any, key: str, value: Any) -> Any:
        """Return ``value`` once ``side:gate:<key>`` exists; one queued job per ``key``."""
        return _gated(config, self, key, value)

    @celery_app.task(
        base=LeasedTask, bind=True, shared=False, name=BEAT_QUEUED,
        lease_key="beat-queued-{key}", lease_queue_unique=True, lease_on_busy="skip",
    )  # fmt: skip
    def beat_queued(self: Any, key: str, value: Any) -> Any:
        """``queue_unique`` that is skipped, not deferred, while its key is held."""
        return _gated(config, self, key, value)

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=SLOW_ONCE)
    def slow_once(self: Any, seconds: float) -> dict[str, Any]:
        """Sleep ``seconds`` on the job's first run only; report who ran it."""
        runs = side_channel(config.side).incr(f"side:runs:{self.request.id}")
        _event(config, self, "start", run=runs)
        if runs == 1:
            _sleep_steps(seconds, 0.05)
        side_channel(config.side).incr(f"side:done:{self.request.id}")
        return {"run": runs, "generation": self.lease.generation}

    @celery_app.task(base=LeasedTask, bind=True, shared=False, name=HOLD_HUB)
    def hold_hub(self: Any, spin: float, block: float) -> None:
        """Never yield: spin in a tight loop for ``spin`` seconds, then sleep
        ``block`` seconds in the unpatched ``time.sleep`` (a blocking C call).

        On a green pool every other greenlet of the worker waits meanwhile.
        """
        _event(config, self, "start")
        end = time.monotonic() + spin
        while time.monotonic() < end:
            pass
        unpatched_sleep()(block)
        _event(config, self, "done")

    @celery_app.task(bind=True, shared=False, name=PLAIN_STEPS)
    def plain_steps(self: Any, seconds: float, step: float = 0.05) -> dict[str, Any]:
        """The same body as ``steps`` without a lease (harness checks)."""
        _event(config, self, "start")
        _sleep_steps(seconds, step)
        side_channel(config.side).incr(f"side:done:{self.request.id}")
        _event(config, self, "done")
        return {"worker": self.request.hostname}


def skew_wall_clock(seconds: float) -> None:
    """Shift this process's ``time.time`` and ``time.time_ns`` by ``seconds``.

    Code that imported the functions by name (``from time import time``)
    keeps the true clock; everything that calls ``time.time()`` sees the
    skewed one. Lease timing must not depend on it: it uses the store's
    clock and ``time.monotonic``.
    """
    true_time, true_time_ns = time.time, time.time_ns
    offset_ns = round(seconds * 1e9)
    time.time = lambda: true_time() + seconds
    time.time_ns = lambda: true_time_ns() + offset_ns


_config = config_from_env()
if _config.clock_skew:
    skew_wall_clock(_config.clock_skew)
app = make_app(_config)
if _config.kill_after_complete:
    # only in a worker started with the variable: a receiver connected in the
    # test process would kill the test run at its next completion
    _kill_after_first_completion(_config)
if _config.slow_claimed:
    _wait_for_loss_when_claimed_late(_config)
if _config.timed_endings:
    _time_endings(_config)
