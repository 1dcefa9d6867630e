"""The peers benchmark's Celery app: one task per kind, set up as each library's README shows.

``bench/peers.py`` imports :func:`make_app` to enqueue (celery-once and
celery-singleton take their lock in ``apply_async``, so the client must use
the task's own class), and the worker imports this module as ``peer_tasks``
(``celery -A peer_tasks worker`` run inside ``bench/``), which builds the
same app from ``BENCH_*`` environment variables.

Every kind runs the same body: ``job(n)`` sleeps ``BENCH_WORK`` seconds (0 for
the trivial workload) and returns ``n``. Each task gets its own ``n``, so the
libraries that key their lock on the arguments see distinct jobs.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import redis
from celery import Celery, Task

TASK_NAME = "bench.job"

#: every kind the benchmark knows, in table order
KINDS = (
    "plain",
    "plain-acks-late",
    "leases-redis",
    "leases-postgres",
    "leases-sqlite",
    "floor",
    "floor-postgres",
    "floor-sqlite",
    "celery-once",
    "celery-singleton",
    "fencekit",
    "relier",
)

#: what each kind guarantees: fencing token, renewal, lost-lease notice,
#: fenced completion, completed-job skip (read from each library's docs and code)
GUARANTEES: dict[str, tuple[bool, bool, bool, bool, bool]] = {
    "plain": (False, False, False, False, False),
    "plain-acks-late": (False, False, False, False, False),
    "leases-redis": (True, True, True, True, True),
    "leases-postgres": (True, True, True, True, True),
    "leases-sqlite": (True, True, True, True, True),
    "floor": (True, False, False, True, True),
    "floor-postgres": (True, False, False, True, True),
    "floor-sqlite": (True, False, False, True, True),
    "celery-once": (False, False, False, False, False),
    "celery-singleton": (False, False, False, False, False),
    "fencekit": (True, False, False, False, True),
    "relier": (True, True, False, True, True),
}
GUARANTEE_NAMES = (
    "fencing token",
    "renewal",
    "lost-lease notice",
    "fenced completion",
    "completed-job skip",
)

# The floor: the least a fenced lease can cost a task, two round trips. The
# claim refuses a job that is held or completed and returns a new generation;
# the complete marks the job done only while the caller's token holds it.
# KEYS[1] the job's key, KEYS[2] its generation counter; ARGV[1] owner,
# ARGV[2] ttl in ms. Returns the generation, or 0 when held or completed.
FLOOR_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local generation = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. generation, 'PX', ARGV[2])
return generation
"""
# KEYS[1] the job's key; ARGV[1] the token the claim wrote. Returns 1 when
# completed, 0 when the token no longer holds the job.
FLOOR_COMPLETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], 'done', 'EX', 86400)
return 1
"""


class _FloorScripts:
    """The floor's Redis client and scripts, one set per process (pool children fork)."""

    def __init__(self, url: str) -> None:
        self.pid = os.getpid()
        self.client = redis.Redis.from_url(url)
        self.claim = self.client.register_script(FLOOR_CLAIM)
        self.complete = self.client.register_script(FLOOR_COMPLETE)


_floor: _FloorScripts | None = None


class FloorTask(Task):  # type: ignore[misc]
    """One claim script before the body, one complete script after it, nothing else."""

    floor_url = ""
    floor_ttl_ms = 30000

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _floor
        if _floor is None or _floor.pid != os.getpid():
            _floor = _FloorScripts(self.floor_url)
        key = f"floor:{self.request.id}"
        owner = f"{os.getpid()}-{threading.get_ident()}"
        generation = _floor.claim(keys=[key, key + ":gen"], args=[owner, self.floor_ttl_ms])
        if not generation:
            return None
        result = super().__call__(*args, **kwargs)
        _floor.complete(keys=[key], args=[f"{owner}:{int(generation)}"])
        return result


# The SQL floor: the same two steps as the Redis floor, each one plain
# statement in autocommit on the database the SQL store would use, through
# the same driver stack as the store (SQLAlchemy Core, no pre-ping). The
# claim inserts the job's row and returns its token, or nothing when the row
# exists (held or completed); the complete marks it done while the token
# still holds it.
SQL_FLOOR_CLAIM = (
    "INSERT INTO bench_floor (job_id, token, done) VALUES (:job_id, :token, 0) "
    "ON CONFLICT (job_id) DO NOTHING RETURNING token"
)
SQL_FLOOR_COMPLETE = (
    "UPDATE bench_floor SET done = 1 WHERE job_id = :job_id AND token = :token AND done = 0"
)


class _SqlFloor:
    """The SQL floor's engine, one per process (pool children fork)."""

    def __init__(self, url: str) -> None:
        import sqlalchemy as sa

        self.pid = os.getpid()
        self.engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        self.claim, self.complete = sa.text(SQL_FLOOR_CLAIM), sa.text(SQL_FLOOR_COMPLETE)


def create_sql_floor_table(url: str) -> None:
    """Create the SQL floor's table (the driver does this before a worker starts)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE TABLE IF NOT EXISTS bench_floor "
            "(job_id VARCHAR(200) PRIMARY KEY, token VARCHAR(200) NOT NULL, done INTEGER NOT NULL)"
        ))  # fmt: skip
    engine.dispose()


_sql_floor: _SqlFloor | None = None


class SqlFloorTask(Task):  # type: ignore[misc]
    """One claim statement before the body, one complete statement after it."""

    floor_url = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _sql_floor
        if _sql_floor is None or _sql_floor.pid != os.getpid():
            _sql_floor = _SqlFloor(self.floor_url)
        job = {"job_id": f"floor:{self.request.id}"}
        token = f"{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        with _sql_floor.engine.connect() as conn:
            if conn.execute(_sql_floor.claim, {**job, "token": token}).first() is None:
                return None
        result = super().__call__(*args, **kwargs)
        with _sql_floor.engine.connect() as conn:
            conn.execute(_sql_floor.complete, {**job, "token": token})
        return result


def make_app(
    kind: str,
    *,
    broker: str,
    backend: str,
    store: str,
    queue: str,
    work: float,
    ttl: float,
    prefetch: int = 1,
) -> tuple[Celery, Task]:
    """The app and its one task for ``kind``; ``prefetch`` is the workers'
    ``worker_prefetch_multiplier``."""
    app = Celery(f"bench-{kind}", broker=broker, backend=backend)
    app.conf.update(
        worker_prefetch_multiplier=prefetch,
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
    )
    options: dict[str, Any] = {"name": TASK_NAME, "shared": False}

    def body(n: int) -> int:
        if work:
            time.sleep(work)
        return n

    if kind == "plain":
        pass
    elif kind in ("plain-acks-late", "floor"):
        app.conf.task_acks_late = True
        if kind == "floor":
            options["base"] = type("Floor", (FloorTask,), {
                "floor_url": store, "floor_ttl_ms": int(ttl * 1000),
            })  # fmt: skip
    elif kind in ("floor-postgres", "floor-sqlite"):
        app.conf.task_acks_late = True
        options["base"] = type("SqlFloor", (SqlFloorTask,), {"floor_url": store})
    elif kind.startswith("leases-"):
        from celery_leases import LeasedTask

        app.conf.update(task_acks_late=True, leases_store=store, leases_ttl=ttl)
        if store.startswith("redis"):
            app.conf.leases_store_options = {"prefix": "bench:"}
        options["base"] = LeasedTask
    elif kind == "celery-once":
        # as its README: base=QueueOnce, the ONCE setting, the default timeout
        from celery_once import QueueOnce

        app.conf.ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": store, "default_timeout": 60 * 60},
        }
        options["base"] = QueueOnce
    elif kind == "celery-singleton":
        # as its README: base=Singleton, singleton_backend_url
        from celery_singleton import Singleton

        app.conf.singleton_backend_url = store
        options["base"] = Singleton
    elif kind == "fencekit":
        # as its README: a bound task under idempotent_task(guard, lock, ...)
        from fencekit import DistributedLock, IdempotencyGuard, idempotency_key
        from fencekit.celery import idempotent_task

        app.conf.task_acks_late = True
        client = redis.Redis.from_url(store, decode_responses=True)
        guard, lock = IdempotencyGuard(client), DistributedLock(client)
        runs = idempotent_task(
            guard,
            lock,
            key=lambda n: idempotency_key({"n": n, "run": queue}, namespace="bench"),
            lock_resource=lambda n: f"bench:{queue}:{n}",
            idempotency_ttl=timedelta(hours=24),
            lock_ttl=timedelta(minutes=5),
        )

        def bound(self: Task, n: int) -> int:
            return body(n)

        task = app.task(bind=True, **options)(runs(bound))
        return app, task
    elif kind == "relier":
        # as its README: the worker runs its own app (relier.tasks.app), settings
        # come from RELIER_* variables, the task is an async function under
        # @rl_task(idempotent=True, hard_timeout=30) on its "default" queue
        os.environ["RELIER_REDIS_URL"] = store  # its own state, in the store
        os.environ["RELIER_LOG_LEVEL"] = "WARNING"  # as the worker's --loglevel
        from relier import rl_task
        from relier.tasks.app import celery_app

        # its app takes broker and backend from RELIER_REDIS_URL: point them at ours
        celery_app.conf.update(broker_url=broker, result_backend=backend)

        @rl_task(idempotent=True, hard_timeout=30, name=TASK_NAME)
        async def job(n: int) -> int:
            if work:
                await asyncio.sleep(work)
            return n

        return celery_app, celery_app.tasks[TASK_NAME]
    else:
        raise ValueError(f"this benchmark cannot run {kind!r}")
    task = app.task(**options)(body)
    return app, task


def _from_env() -> tuple[Celery, Task]:
    return make_app(
        os.environ.get("BENCH_KIND", "plain"),
        broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0"),
        backend=os.environ.get("BENCH_BACKEND", "redis://127.0.0.1:6379/1"),
        store=os.environ.get("BENCH_STORE", "redis://127.0.0.1:6379/2"),
        queue=os.environ.get("BENCH_QUEUE", "bench"),
        work=float(os.environ.get("BENCH_WORK", "0")),
        ttl=float(os.environ.get("BENCH_TTL", "30")),
        prefetch=int(os.environ.get("BENCH_PREFETCH", "1")),
    )


if os.environ.get("BENCH_KIND"):
    app, job = _from_env()
else:  # imported by the driver: no app until it asks for one
    app = Celery(f"bench-idle-{uuid.uuid4().hex[:6]}")
