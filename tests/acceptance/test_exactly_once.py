"""Exactly-once database effects with real workers, kills, pauses and duplicates.

Each job of ``acceptance.once`` inserts one row in a table of the lease
store's own database (PostgreSQL, SQLite or MariaDB), inside ``exactly_once``. The
pool process SIGKILLs itself once per job at every step (before the
transaction, inside it, after the commit, after Celery stored the result),
each message is delivered twice, and a worker is frozen past its lease; the
check is the count of rows per job, which must be exactly 1. The variant
that commits the row and the completion apart must be caught by the same
count. A database that refuses the task's connections as its block opens,
a task role without rights on the lease table and ``retry()`` inside the
block each end the job in a bounded time: run again, failed at once with a
configuration error, refused at once.
"""

from __future__ import annotations

import re
import time
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
from tests.proxy import Proxy
from tests.servers import MariadbServer

# Every test here runs on PostgreSQL, SQLite and MariaDB; on PostgreSQL and
# MariaDB, with partitions and store restarts besides, in the chaos harness's
# once profile too (tests/chaos/test_chaos_run.py)
EVERY_DATABASE = pytest.mark.parametrize(
    "lease_store_target", ["postgres", "sqlite", "mysql"], indirect=True
)

# the databases a task connects to over the network, with roles of their own
NETWORK_DATABASES = pytest.mark.parametrize(
    "lease_store_target", ["postgres", "mysql"], indirect=True
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


def runs(cluster: Cluster, job: str) -> int:
    """How many bodies of the job started."""
    return int(cluster.side.client.get(f"side:once-runs:{job}") or 0)


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


@NETWORK_DATABASES
def test_a_connection_refused_as_the_block_opens_runs_the_job_again(
    cluster: Cluster, lease_store_target: StoreTarget, effects: sa.Table
) -> None:
    """The database refuses the task's connections as its block opens (the
    engine's connect): the run is fenced out and published again, and the
    next run, once connections pass, commits the one row."""
    database = sa.make_url(lease_store_target.url)
    assert database.port is not None
    with Proxy("127.0.0.1", database.port) as proxy:
        proxy.refuse()
        through = database.set(host="127.0.0.1", port=proxy.port)
        env = {
            **once_env(lease_store_target, effects, mode="together", kill_at=""),
            "LEASES_TEST_ONCE_URL": through.render_as_string(hide_password=False),
        }
        worker = cluster.worker("a", app=ONCE_APP, env=env)
        job = f"refused-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        result = cluster.send(ONCE, task_id=job)
        worker.wait_for_log(rf"lease fenced-out: job={re.escape(job)}", timeout=60)
        proxy.heal()
        value = result.get(timeout=60)
        seconds = time.monotonic() - started
    record = cluster.record(job)
    assert record is not None
    print(f"connection refused as the block opens, {lease_store_target.kind}: runs "
          f"{runs(cluster, job)}, rows {effects_per_job(lease_store_target, effects, [job])}, "
          f"answered in {seconds:.1f} s")  # fmt: skip
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert runs(cluster, job) == 2
    assert not_once(effects_per_job(lease_store_target, effects, [job])) == {}


def role_without_lease_rights(
    request: pytest.FixtureRequest, target: StoreTarget, effects: sa.Table
) -> str:
    """A URL of the lease store's database with a new role that may write the
    effects table but has no rights on the lease table."""
    role = f"lowly_{uuid.uuid4().hex[:8]}"
    url = sa.make_url(target.url)
    if target.kind == "postgres":
        engine = engine_for(target.url)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
                conn.exec_driver_sql(f"GRANT SELECT, INSERT ON {effects.name} TO {role}")
                conn.exec_driver_sql(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}")
        finally:
            engine.dispose()
        return url.set(username=role).render_as_string(hide_password=False)
    server: MariadbServer = request.getfixturevalue("mariadb_server")
    server.sql(
        f"CREATE USER '{role}'@'127.0.0.1' IDENTIFIED BY '{role}';"
        f"GRANT SELECT, INSERT ON {url.database}.{effects.name} TO '{role}'@'127.0.0.1';"
    )
    return url.set(username=role, password=role).render_as_string(hide_password=False)


@NETWORK_DATABASES
def test_a_role_without_rights_on_the_lease_table_fails_the_job_at_once(
    request: pytest.FixtureRequest,
    cluster: Cluster,
    lease_store_target: StoreTarget,
    effects: sa.Table,
) -> None:
    """Missing rights are a configuration, not an outage: the job fails with
    LeaseConfigurationError after one run, never published again."""
    env = {
        **once_env(lease_store_target, effects, mode="together", kill_at=""),
        "LEASES_TEST_ONCE_URL": role_without_lease_rights(request, lease_store_target, effects),
    }
    cluster.worker("a", app=ONCE_APP, env=env)
    fails_once_with_nothing_written(
        cluster, lease_store_target, effects, "no rights on the lease table",
        match=r"permission denied|command denied",
    )  # fmt: skip


def fails_once_with_nothing_written(
    cluster: Cluster, target: StoreTarget, effects: sa.Table, what: str, *, match: str
) -> None:
    """Send one job: it fails with LeaseConfigurationError (its message
    matching ``match``) after one run, its lease released and no row written."""
    job = f"refused-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    result = cluster.send(ONCE, task_id=job)
    with pytest.raises(Exception, match=match) as failed:
        result.get(timeout=60)
    seconds = time.monotonic() - started
    record = cluster.record(job)
    assert record is not None
    print(f"{what}, {target.kind}: runs {runs(cluster, job)}, "
          f"{type(failed.value).__name__} in {seconds:.1f} s")  # fmt: skip
    assert type(failed.value).__name__ == "LeaseConfigurationError"
    assert runs(cluster, job) == 1
    assert record.state is LeaseState.RELEASED
    assert effects_per_job(target, effects, [job]) == {job: 0}


@pytest.mark.parametrize("lease_store_target", ["postgres", "sqlite"], indirect=True)
def test_retry_inside_the_block_is_refused_at_once(
    cluster: Cluster, lease_store_target: StoreTarget, effects: sa.Table
) -> None:
    """``self.retry()`` inside the block would wait for the record's lock its
    own transaction holds: it is refused with LeaseConfigurationError, the
    block rolls back and the lease is released at once."""
    env = once_env(lease_store_target, effects, mode="retry-inside", kill_at="")
    worker = cluster.worker("a", app=ONCE_APP, env=env)
    fails_once_with_nothing_written(
        cluster, lease_store_target, effects, "retry() inside the block",
        match=r"self\.retry\(\) was called inside",
    )  # fmt: skip
    assert "could not release" not in worker.log()


@pytest.mark.parametrize("lease_store_target", ["postgres", "sqlite"], indirect=True)
def test_retry_after_the_block_runs_the_job_again_at_once(
    cluster: Cluster, lease_store_target: StoreTarget, effects: sa.Table
) -> None:
    """The way the docs advise: raise inside the block (it rolls back), call
    ``self.retry()`` after it. The release does not wait, and the retry
    claims the job at once and commits the one row."""
    env = once_env(lease_store_target, effects, mode="retry-after", kill_at="")
    worker = cluster.worker("a", app=ONCE_APP, env=env)
    job = f"retried-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    value = cluster.send(ONCE, task_id=job).get(timeout=60)
    seconds = time.monotonic() - started
    record = cluster.record(job)
    assert record is not None
    print(f"retry() after the block, {lease_store_target.kind}: runs {runs(cluster, job)}, "
          f"answered in {seconds:.1f} s")  # fmt: skip
    assert (record.state, record.generation) == (LeaseState.COMPLETED, value["generation"])
    assert runs(cluster, job) == 2
    assert not_once(effects_per_job(lease_store_target, effects, [job])) == {}
    assert "could not release" not in worker.log()
