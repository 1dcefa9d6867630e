"""One chaos run: servers, workers, jobs, the nemesis, then the checker."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from celery.result import AsyncResult

from celery_leases import LeaseRecord, LeaseState, open_store
from celery_leases.sending import keeping_send_id
from chaos.checker import Report, check
from chaos.config import JOB, ChaosConfig, make_app
from chaos.history import History, read_history
from chaos.nemesis import Nemesis, StoreControl
from chaos.once import count_effects, create_effects, kills
from chaos.targets import RedisTarget, SqlTarget
from tests.acceptance.harness import Worker
from tests.broker_servers import RabbitServer
from tests.proxy import Proxy
from tests.servers import MariadbServer, PostgresServer, RedisServer

__all__ = ["PROFILES", "STORE_KINDS", "Profile", "run"]

#: the lease stores a run can use: a Redis server, PostgreSQL, MariaDB
STORE_KINDS = ("redis", "postgres", "mysql")

#: workers: (pool, concurrency, clock) per worker; clock skews the wall clock
#: ("" none, "+300" / "-300" seconds, "x2" twice as fast; see chaos.app)
WORKERS = (("prefork", 2, ""), ("threads", 2, "+300"), ("prefork", 1, "-300"))

#: the RabbitMQ node's consumer timeout (its own default): no fault here
#: keeps a delivery that long, so the node never closes a worker's channel
RABBIT_CONSUMER_TIMEOUT = 1800.0


@dataclasses.dataclass(frozen=True)
class Profile:
    jobs: int
    seconds: float  # how long jobs are submitted and faults injected
    interval: float  # mean time between faults
    budget: dict[str, int]
    ttl: float = 1.5
    workers: tuple[tuple[str, int, str], ...] = WORKERS
    drain: float = 90.0  # the most time to let every job finish after the faults
    #: jobs end with an exactly-once effect in the store's database (chaos.once)
    once: bool = False


PROFILES = {
    "ci": Profile(
        jobs=24,
        seconds=45,
        interval=2.0,
        budget={
            "pause-child": 4,
            "pause-worker": 3,
            "kill-child": 2,
            "kill-worker": 1,
            "duplicate": 4,
            "partition": 2,
            "store-restart": 1,
        },
    ),
    "variant": Profile(
        jobs=10,
        seconds=20,
        interval=1.0,
        budget={"pause-child": 6, "pause-worker": 6, "duplicate": 6},
        workers=(("prefork", 2, ""), ("threads", 2, "+300")),
        drain=40.0,
    ),
    "once": Profile(
        jobs=10,
        seconds=16,
        interval=1.6,
        budget={
            "pause-child": 2,
            "pause-worker": 1,
            "kill-child": 1,
            "duplicate": 3,
            "partition": 1,
            "store-restart": 1,
        },
        # prefork only: a job's pool process kills itself at its step (chaos.once)
        workers=(("prefork", 2, ""), ("prefork", 1, "+300")),
        drain=45.0,
        once=True,
    ),
    # the ci profile's faults, shorter, on workers without pool processes:
    # for ``pool="gevent"`` (or "eventlet"), every run holds the hub (chaos.app).
    # No worker kill: a green worker consumes without kombu's event loop, so
    # the Redis transport puts a dead worker's unacknowledged messages back
    # only when a worker starts after their visibility timeout (a kill just
    # after a delivery leaves the job waiting for the next worker start)
    "green": Profile(
        jobs=14,
        seconds=22,
        interval=1.6,
        budget={
            "pause-worker": 2,
            "duplicate": 3,
            "partition": 2,
            "store-restart": 1,
        },
        workers=(("gevent", 4, ""), ("gevent", 4, "+300")),
        drain=45.0,
    ),
    "long": Profile(
        jobs=1000,
        seconds=1200,
        interval=1.1,
        budget={
            "pause-child": 150,
            "pause-worker": 80,
            "kill-child": 40,
            "kill-worker": 20,
            "duplicate": 200,
            "partition": 30,
            "store-restart": 12,
        },
        workers=(
            ("prefork", 2, ""),
            ("threads", 2, "+300"),
            ("prefork", 2, "-300"),
            ("threads", 2, "x2"),
        ),
        drain=300.0,
    ),
}


class _DurablePostgres(PostgresServer):
    """PostgreSQL that keeps every acknowledged commit across a kill (a lease
    store must keep its data, PROTOCOL "What it does not promise")."""

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 "
            f"-c unix_socket_directories={self.root} -c fsync=off "
            "-c max_connections=200 -c synchronous_commit=on"
        )
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.root / "postgres.log"), "-w", "-t", "60", "start",
        )  # fmt: skip


def run(
    profile: Profile,
    *,
    store_kind: str,
    seed: int,
    out: Path,
    variant: str = "",
    broker_kind: str = "redis",
    pool: str = "",
    log: Any = print,
) -> Report:
    """Run one chaos profile and return the checker's report (also in ``out``).

    ``broker_kind`` ``"amqp"`` puts the broker on a private RabbitMQ node;
    results and the Redis target stay on the Redis server. ``pool``
    (``prefork``, ``threads``, ``gevent``, ``eventlet``) puts every worker of
    the profile on that pool; "" keeps the profile's pools.
    """
    if pool:
        profile = dataclasses.replace(
            profile, workers=tuple((pool, n, clock) for _, n, clock in profile.workers)
        )
    if store_kind not in STORE_KINDS:
        raise ValueError(f"unknown store kind {store_kind!r}: one of {', '.join(STORE_KINDS)}")
    if profile.once and store_kind == "redis":
        raise ValueError("the once profile needs a SQL store (postgres, mysql) for its rows")
    out.mkdir(parents=True, exist_ok=True)
    (out / "history").mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        broker = RedisServer()
        stack.callback(broker.close)
        broker_url = broker.url.replace("/0", "/1")
        if broker_kind == "amqp":
            rabbit = RabbitServer(consumer_timeout=RABBIT_CONSUMER_TIMEOUT)
            stack.callback(rabbit.close)
            broker_url = rabbit.url
        elif broker_kind != "redis":
            raise ValueError(f"unknown broker kind {broker_kind!r}: 'redis' or 'amqp'")
        target_pg = PostgresServer()
        stack.callback(target_pg.close)
        store_server: RedisServer | MariadbServer | _DurablePostgres
        if store_kind == "redis":
            store_server = RedisServer()
            control = StoreControl(kill=store_server.kill, start=store_server.start)
        elif store_kind == "mysql":
            # SIGKILL of the server alone keeps every acknowledged commit: InnoDB
            # wrote it to the log (in the OS's cache) before the reply
            store_server = MariadbServer()
            control = StoreControl(kill=store_server.kill, start=store_server.start)
        else:
            pg = store_server = _DurablePostgres()
            control = StoreControl(kill=lambda: pg.stop("immediate"), start=pg.start)
        stack.callback(store_server.close)
        proxy = Proxy("127.0.0.1", store_server.port)
        stack.callback(proxy.close)
        direct_url = store_server.url
        store_url = direct_url.replace(f":{store_server.port}/", f":{proxy.port}/")
        options = {"prefix": "chaos:"} if store_kind == "redis" else {"table_name": "chaos_leases"}
        config = ChaosConfig(
            broker=broker_url,
            backend=broker.url.replace("/0", "/1"),
            consumer_timeout=RABBIT_CONSUMER_TIMEOUT,
            queue="chaos",
            store=store_url,
            store_options=options,
            ttl=profile.ttl,
            visibility_timeout=max(2 * profile.ttl, 3.0),
            history=str(out / "history"),
            sql_target=target_pg.url,
            redis_target=broker.url.replace("/0", "/2"),
            variant=variant,
            once_table="chaos_once" if profile.once else "",
        )
        jobs = [f"job-{seed}-{i}" for i in range(profile.jobs)]
        sql, redis_target = SqlTarget(config.sql_target), RedisTarget(config.redis_target)
        stack.callback(sql.close)
        stack.callback(redis_target.close)
        sql.create(jobs)
        client = make_app(config)
        stack.callback(client.close)
        store = open_store(direct_url, **options)
        stack.callback(store.close)
        store.now_ms()  # a SQL store makes its table now, before any worker
        if profile.once:
            create_effects(direct_url, config.once_table)
        history = History(out / "history")
        workers: list[Worker] = []

        def stop_workers() -> None:
            for worker in workers:
                worker.stop()

        stack.callback(stop_workers)
        names = iter(f"w{n}" for n in range(10_000))

        def start(pool: str, concurrency: int, clock: str) -> Worker:
            env = config.to_env()
            if clock:
                env["CHAOS_CLOCK"] = clock
            worker = Worker(
                f"{next(names)}-{seed}", env, out, pool=pool, concurrency=concurrency,
                queue=config.queue, app="chaos.app",
            )  # fmt: skip
            worker.spec = (pool, concurrency, clock)  # type: ignore[attr-defined]
            worker.start(ready_timeout=90)
            return worker

        for spec in profile.workers:
            workers.append(start(*spec))
        log(
            f"chaos: {len(workers)} workers up ({', '.join(w.pool for w in workers)}); "
            f"broker {broker_kind}, store {store_kind}, seed {seed}, variant {variant or '-'}"
        )

        send_ids: dict[str, str] = {}

        def send(job: str, send_id: str) -> None:
            with keeping_send_id(send_id):
                client.send_task(JOB, args=(rng.uniform(0.5, 2.5) * profile.ttl, 3), task_id=job)

        rng = random.Random(seed)

        def duplicate(choose: random.Random) -> bool:
            if not send_ids:
                return False
            job = choose.choice(sorted(send_ids))
            history.record("duplicate", job=job)
            send(job, send_ids[job])
            return True

        nemesis = Nemesis(
            seed=seed, ttl=profile.ttl, budget=profile.budget, workers=workers,
            replace=lambda w: start(*w.spec),  # type: ignore[attr-defined]
            proxy=proxy, store=control, duplicate=duplicate, log=log,
        )  # fmt: skip
        import threading

        chaos = threading.Thread(target=nemesis.run, args=(profile.seconds, profile.interval))
        chaos.start()
        started = time.monotonic()
        for i, job in enumerate(jobs):
            time.sleep(max(0.0, started + i * profile.seconds / len(jobs) - time.monotonic()))
            send_ids[job] = uuid.uuid4().hex
            history.record("submit", job=job)
            send(job, send_ids[job])
        chaos.join()
        for worker in workers:
            worker.thaw()
        final = _drain(store, jobs, profile.drain)
        results = {job: _answer(AsyncResult(job, app=client)) for job in jobs}
        for worker in workers:
            worker.stop()
        report = check(
            read_history(out / "history"),
            jobs=jobs,
            targets={"sql": sql.accepted(), "redis": redis_target.accepted(jobs)},
            final=final,
            results=results,
            nemesis=nemesis.counts,
            effects=count_effects(direct_url, config.once_table, jobs) if profile.once else None,
        )
        if profile.once:
            for step, count in kills(config.broker).items():
                report.counts[f"self-kills {step}"] = count
        report.counts["workers started"] = len(workers)
        (out / "report.txt").write_text(report.format() + "\n")
        return report
    raise AssertionError("unreachable")


def _answer(result: AsyncResult) -> str:
    """The client's answer: its state, and the error's class for a failure."""
    state = str(result.state)
    if state == "FAILURE":
        return f"FAILURE:{type(result.result).__name__}"
    return state


def _drain(store: Any, jobs: list[str], timeout: float) -> dict[str, LeaseRecord | None]:
    deadline = time.monotonic() + timeout
    while True:
        final: dict[str, LeaseRecord | None] = {}
        for job in jobs:
            with contextlib.suppress(Exception):
                final[job] = store.get(job)
        if all(r is not None and r.state is LeaseState.COMPLETED for r in final.values()):
            return final
        if time.monotonic() > deadline:
            return {job: final.get(job) for job in jobs}
        time.sleep(0.5)


def counts_line(counts: Counter[str]) -> Iterator[str]:
    yield from (f"{k}={v}" for k, v in sorted(counts.items()))
