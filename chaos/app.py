"""The Celery app of the chaos workers (``celery -A chaos.app worker``).

Configured from ``CHAOS_*`` environment variables (see :class:`ChaosConfig`).
Every worker process records in the history: each store operation (through
:class:`~chaos.recording.RecordingStore`, installed in place of the store
the library opens), the start and end of each body, each target write
before it is sent and after its answer, and the lease signals.

``CHAOS_VARIANT`` selects a broken variant (see ``chaos.variants``).

On the gevent or eventlet pool each run first holds the hub for
:data:`HOLD_TTLS` TTLs (a blocking C call: the unpatched ``time.sleep``),
longer than the lease's safe duration: only a heartbeat that renews
outside the hub keeps the lease, and a ``hold`` record tells whether a
renewal landed meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import redis

import celery_leases.runtime
from celery_leases import LeasedTask, LeaseLost, LeaseStore, StaleFencingToken, open_store
from celery_leases import signals as lease_signals
from celery_leases.fencing import FencingToken, Token
from celery_leases.unpatched import green_library
from chaos.config import JOB, ChaosConfig, make_app
from chaos.history import History
from chaos.once import OnceEffects
from chaos.recording import RecordingStore
from chaos.targets import RedisTarget, SqlTarget
from tests.green import unpatched_sleep

__all__ = ["JOB", "ChaosConfig", "app", "make_app"]

#: variants the task body implements (the store variants live in chaos.recording)
BODY_VARIANTS = frozenset({"unfenced-target", "ignore-deadline", "separate-commit"})

#: how long (in TTLs) a run on a green pool holds the hub before its first slice
HOLD_TTLS = 1.2


def skew_wall_clock(spec: str) -> None:
    """Make this process's ``time.time`` run off: ``"+300"``/``"-300"`` seconds, or ``"x2"``.

    libfaketime would do this for the whole process, but with
    ``DONT_FAKE_MONOTONIC=1`` (needed: the history and the lease deadlines
    use the monotonic clock) it makes Python 3.11's ``time.sleep`` fail with
    EINVAL, so the wall clock is shifted in Python instead. The lease code
    must not care: it uses the store's clock and ``time.monotonic``.
    """
    true_time, true_time_ns = time.time, time.time_ns
    if spec.startswith("x"):
        rate, start = float(spec[1:]), true_time()
        time.time = lambda: start + rate * (true_time() - start)
        time.time_ns = lambda: round(time.time() * 1e9)
    else:
        offset = float(spec)
        time.time = lambda: true_time() + offset
        time.time_ns = lambda: true_time_ns() + round(offset * 1e9)


config = ChaosConfig.from_env()
if os.environ.get("CHAOS_CLOCK"):
    skew_wall_clock(os.environ["CHAOS_CLOCK"])
history = History(config.history)
app = make_app(config)
_side: dict[int, redis.Redis] = {}
_targets: dict[int, tuple[SqlTarget | None, RedisTarget | None]] = {}
_once = OnceEffects(config) if config.once_table else None


def _expiring_counter(job_id: str, ttl_ms: int) -> int:
    # the "generation kept in an expiring key" bug: the counter vanishes with the lease
    client = _side.setdefault(os.getpid(), redis.Redis.from_url(config.redis))
    key = f"chaos:expiring-generation:{job_id}"
    pipe = client.pipeline()
    pipe.incr(key)
    pipe.pexpire(key, ttl_ms)
    return int(pipe.execute()[0])


def _open_recording_store(url: str, **options: Any) -> LeaseStore:
    return RecordingStore(open_store(url, **options), history, config.variant, _expiring_counter)


# every store the library opens in a worker process is recorded
celery_leases.runtime.open_store = _open_recording_store  # type: ignore[attr-defined]


def _targets_here() -> tuple[SqlTarget | None, RedisTarget | None]:
    pid = os.getpid()
    if pid not in _targets:  # made after fork: no shared sockets
        _targets[pid] = (
            SqlTarget(config.sql_target) if config.sql_target else None,
            RedisTarget(config.redis_target) if config.redis_target else None,
        )
    return _targets[pid]


def _write(lease: Any, step: int, *, late_remaining: float | None = None) -> None:
    """Write ``step`` to every target, recording before and after each write.

    ``late_remaining``: the write left before the deadline (that much time
    was left then) and arrives only now, as a request delayed on the wire.
    """
    late = late_remaining is not None or config.variant == "ignore-deadline"
    token: FencingToken = Token(lease.job_id, lease.generation) if late else lease
    fenced = config.variant != "unfenced-target"
    for name, target in zip(("sql", "redis"), _targets_here(), strict=True):
        if target is None:
            continue
        remaining = lease.remaining() if late_remaining is None else late_remaining
        call = history.record(
            "write", target=name, job=lease.job_id, generation=lease.generation,
            owner=lease.owner, step=step, remaining=remaining, late=late_remaining is not None,
        )  # fmt: skip
        try:
            target.write(token, step, os.getpid(), fenced=fenced)
        except StaleFencingToken:
            history.record("write-result", call=call, outcome="refused")
        except LeaseLost:
            history.record("write-result", call=call, outcome="lost")
            raise
        except Exception as exc:
            history.record("write-result", call=call, outcome="error", error=type(exc).__name__)
        else:
            history.record("write-result", call=call, outcome="accepted")


@app.task(base=LeasedTask, bind=True, name=JOB, shared=False)  # type: ignore[untyped-decorator]
def job(self: Any, seconds: float, writes: int) -> dict[str, Any]:
    """Run ``seconds`` in ``writes`` slices, writing every target after each slice."""
    lease = self.lease
    history.record(
        "body", job=lease.job_id, generation=lease.generation, owner=lease.owner,
        remaining=lease.remaining(),
    )  # fmt: skip
    step, remaining = 0, lease.remaining()
    if green_library() is not None:
        _hold_hub(lease, HOLD_TTLS * config.ttl)
    try:
        for step in range(1, writes + 1):
            end = time.monotonic() + seconds / writes
            while time.monotonic() < end:
                if config.variant != "ignore-deadline":
                    lease.check()
                    remaining = lease.remaining()
                time.sleep(min(0.05, max(end - time.monotonic(), 0.0)))
            _write(lease, step)
    except LeaseLost:
        _late_requests(self, lease, max(step, 1), remaining)
        raise
    history.record("body-end", job=lease.job_id, generation=lease.generation, owner=lease.owner)
    if _once is not None:
        return _once.apply(self, lease)
    return {"generation": lease.generation}


def _hold_hub(lease: Any, seconds: float) -> None:
    """Block this process's hub for ``seconds``; record the time left before and after.

    The lease's deadline moved on (``after`` above ``before - held``) only if
    a renewal landed while no greenlet could run.
    """
    before, start = lease.remaining(), time.monotonic()
    unpatched_sleep()(seconds)
    history.record(
        "hold", job=lease.job_id, generation=lease.generation, owner=lease.owner,
        held=time.monotonic() - start, before=before, after=lease.remaining(),
    )  # fmt: skip


def _late_requests(task: Any, lease: Any, step: int, remaining: float) -> None:
    """Requests a stale run had on the wire arrive after another run took over.

    A pause can fall between a worker's last check and the moment its
    request reaches the store or a target: the store and the fenced targets
    must refuse such a request on their own. The library's local checks
    make that window small, so a short run would rarely show it; here a run
    that lost its lease sends its next write, a renewal and a completion
    once the store names another holder (within 4 TTLs, else nothing is
    sent). A correct store and fenced targets refuse all three.
    """
    store = celery_leases.runtime.store_for(task.app)

    def deliver() -> None:
        deadline = time.monotonic() + 4 * config.ttl
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                record = store.get(lease.job_id)
                if record is not None and record.owner not in ("", lease.owner):
                    break
            time.sleep(0.1)
        else:
            return
        history.record("late", job=lease.job_id, generation=lease.generation, owner=lease.owner)
        _write(lease, step, late_remaining=remaining)
        with contextlib.suppress(Exception):
            store.renew(lease.job_id, lease.owner, lease.generation, config.ttl)
        with contextlib.suppress(Exception):
            store.complete(lease.job_id, lease.owner, lease.generation)

    threading.Thread(target=deliver, name="chaos-late", daemon=True).start()


def _signal_recorder(kind: str) -> Any:
    def receive(sender: Any = None, lease: Any = None, job_id: str = "", **extra: Any) -> None:
        fields = {k: v for k, v in extra.items() if k in ("reason", "countdown", "deferrals")}
        history.record(
            kind, job=job_id, generation=getattr(lease, "generation", None),
            owner=getattr(lease, "owner", None), **fields,
        )  # fmt: skip

    return receive


for _name in ("lease_lost", "lease_fenced_out", "duplicate_deferred", "lease_skipped"):
    getattr(lease_signals, _name).connect(_signal_recorder(_name), weak=False)
