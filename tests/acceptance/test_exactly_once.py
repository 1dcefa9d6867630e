"""Exactly-once database effects with real workers, kills, pauses and duplicates.

Each job of ``acceptance.once`` inserts one row in a table of the lease
store's own database (PostgreSQL, SQLite or MariaDB), inside ``exactly_once``. The
pool process SIGKILLs itself once per job at every step (before the
transaction, inside it, after the commit, after Celery stored the result),
each message is delivered twice, and a worker is frozen past its lease; the
check is the count of rows per job, which must be exactly 1. The variant
that commits the row and the completion apart must be caught by the same
count.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from celery.result import AsyncResult

from celery_leases import LeaseState
from celery_leases.sending import keeping_send_id
from tests.acceptance.conftest import Cluster, StoreTarget
from tests.acceptance.harness import wait_until
from tests.acceptance.once_app import ONCE, STEPS, effects_table, engine_for

# Every test here runs on PostgreSQL, SQLite and MariaDB; on PostgreSQL and
# MariaDB, with partitions and store restarts besides, in the chaos harness's
# once profile too (tests/chaos/test_chaos_run.py)
EVERY_DATABASE = pytest.mark.parametrize(
    "lease_store_target", ["postgres", "sqlite", "mysql"], indirect=True
)

ONCE_APP = "tests.acceptance.once_app"


@pytest.fixture
def effects(cluster: Cluster, lease_store_target: StoreTarget) -> Iterator[sa.Table]:
    table = effects_table(f"{lease_store_target.options['table_name']}_effects")
    engine = engine_for(lease_store_target.url)
    table.create(engine)
    cluster.store.now_ms()  # the lease table exists before the first worker
    yield table
    engine.dispose()


def effects_per_job(target: StoreTarget, table: sa.Table, jobs: list[str]) -> dict[str, int]:
    """How many rows each job applied (the checker of this file)."""
    engine = engine_for(target.url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(table.c.job_id, sa.func.count()).group_by(table.c.job_id)
            ).all()
    finally:
        engine.dispose()
    counted = {job_id: int(count) for job_id, count in rows}
    return {job: counted.get(job, 0) for job in jobs}


def not_once(counts: dict[str, int]) -> dict[str, int]:
    """The jobs whose effect was not applied exactly once."""
    return {job: count for job, count in counts.items() if count != 1}


def once_env(target: StoreTarget, table: sa.Table, *, mode: str, kill_at: str) -> dict[str, str]:
    return {
        "LEASES_TEST_ONCE_TABLE": table.name,
        "LEASES_TEST_ONCE_MODE": mode,
        "LEASES_TEST_ONCE_KILL_AT": kill_at,
    }


def kills(cluster: Cluster) -> dict[str, int]:
    return {step: int(cluster.side.client.get(f"side:once-kills:{step}") or 0) for step in STEPS}


@EVERY_DATABASE
def test_every_effect_is_applied_once_under_duplicates_and_a_kill_at_every_step(
    cluster: Cluster, lease_store_target: StoreTarget, effects: sa.Table
) -> None:
    jobs = [f"once-{uuid.uuid4().hex[:8]}" for _ in range(4)]
    cluster.worker(
        "a",
        concurrency=2,
        app=ONCE_APP,
        env=once_env(lease_store_target, effects, mode="together", kill_at=",".join(STEPS)),
    )
    for job in jobs:
        send_id = uuid.uuid4().hex
        for _ in range(2):  # the broker delivering each message twice
            with keeping_send_id(send_id):
                cluster.send(ONCE, task_id=job)
    values = [AsyncResult(job, app=cluster.client).get(timeout=120) for job in jobs]
    # the last kill (after the result) is answered by one more delivery
    wait_until(lambda: kills(cluster)["after-result"] == len(jobs), timeout=60,
               message="a kill after each job's result")  # fmt: skip
    counts = effects_per_job(lease_store_target, effects, jobs)
    print(f"exactly-once, {lease_store_target.kind}: jobs {len(jobs)}, kills {kills(cluster)}, "
          f"effects per job {sorted(Counter(counts.values()).items())}")  # fmt: skip
    assert kills(cluster) == dict.fromkeys(STEPS, len(jobs))
    assert not_once(counts) == {}
    for job, value in zip(jobs, values, strict=True):
        record = cluster.record(job)
        assert record is not None
        assert record.state is LeaseState.COMPLETED
        assert value == {"job_id": job, "generation": record.generation}


@EVERY_DATABASE
def test_the_checker_catches_writes_committed_apart_from_the_completion(
    cluster: Cluster, lease_store_target: StoreTarget, effects: sa.Table
) -> None:
    jobs = [f"apart-{uuid.uuid4().hex[:8]}"]
    cluster.worker(
        "a",
        app=ONCE_APP,
        env=once_env(lease_store_target, effects, mode="separate", kill_at="after-commit"),
    )
    for result in [cluster.send(ONCE, task_id=job) for job in jobs]:
        result.get(timeout=60)
    assert kills(cluster)["after-commit"] == len(jobs)
    assert not_once(effects_per_job(lease_store_target, effects, jobs)) == dict.fromkeys(jobs, 2)


@EVERY_DATABASE
def test_a_worker_frozen_past_its_lease_applies_nothing(
    cluster: Cluster, lease_store_target: StoreTarget, effects: sa.Table
) -> None:
    """A is frozen before its transaction; B takes the redelivered message
    over once A's lease ran out and commits; A, thawed, is refused."""
    cluster.configure(visibility_timeout=3.0)
    env = once_env(lease_store_target, effects, mode="together", kill_at="")
    frozen = cluster.worker("a", app=ONCE_APP, env=env)
    job = f"frozen-{uuid.uuid4().hex[:8]}"
    result = cluster.send(ONCE, 1.0, task_id=job)
    wait_until(lambda: cluster.record(job), timeout=30, message="A's claim")
    frozen.freeze()
    cluster.worker("b", app=ONCE_APP, env=env)
    value = result.get(timeout=60)
    frozen.thaw()
    wait_until(lambda: f"lease fenced-out: job={job}" in frozen.log(), timeout=30,
               message="A fenced out")  # fmt: skip
    record = cluster.record(job)
    assert record is not None
    assert value["generation"] == record.generation
    assert not_once(effects_per_job(lease_store_target, effects, [job])) == {}
