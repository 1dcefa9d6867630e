"""An exactly_once block against the lease's time, with real workers.

A block that lasts longer than the lease commits once: the heartbeat renews
the lease in the block's own transaction, which holds the record's lock. A
worker frozen (``SIGSTOP``) inside its block holds the job for about one
lease on PostgreSQL and MariaDB, whose servers end a transaction idle that
long; SQLite cannot end it, and the worker says so at start.
"""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from celery_leases import LeaseRecord, LeaseState
from celery_leases.worker import SQLITE_PAUSE_WARNING
from tests.acceptance.conftest import Cluster, StoreTarget
from tests.acceptance.harness import wait_until
from tests.acceptance.once_app import ONCE
from tests.acceptance.test_exactly_once import (
    EVERY_DATABASE,
    ONCE_APP,
    effects,
    effects_per_job,
    once_env,
)

__all__ = ["effects"]  # the fixture, used by name

#: seconds the block stays open after its row was written: more than twice
#: the lease's 2 s
LONG_BLOCK = 5.0


def block_env(target: StoreTarget, table: sa.Table, inside: float) -> dict[str, str]:
    env = once_env(target, table, mode="together", kill_at="")
    return {**env, "LEASES_TEST_ONCE_INSIDE": str(inside)}


def counter(cluster: Cluster, key: str) -> int:
    return int(cluster.side.client.get(key) or 0)


def newer(cluster: Cluster, job: str, generation: int) -> LeaseRecord | None:
    """The job's record once a claim took it over from ``generation``."""
    record = cluster.record(job)
    return record if record is not None and record.generation > generation else None


@EVERY_DATABASE
def test_a_block_longer_than_the_lease_commits_once(
    cluster: Cluster, lease_store_target: StoreTarget, effects: sa.Table
) -> None:
    assert cluster.config.ttl < LONG_BLOCK / 2
    cluster.worker("a", app=ONCE_APP, env=block_env(lease_store_target, effects, LONG_BLOCK))
    job = f"long-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    value = cluster.send(ONCE, task_id=job).get(timeout=60)
    took = time.monotonic() - started
    record = cluster.record(job)
    assert record is not None
    runs = counter(cluster, f"side:once-runs:{job}")
    rows = effects_per_job(lease_store_target, effects, [job])[job]
    print(f"long block, {lease_store_target.kind}: block {LONG_BLOCK:g} s, ttl "
          f"{cluster.config.ttl:g} s: runs {runs}, rows {rows}, renewals in the block "
          f"{record.renew_count}, answer after {took:.1f} s")  # fmt: skip
    assert runs == 1
    assert rows == 1
    assert record.state is LeaseState.COMPLETED
    assert value == {"job_id": job, "generation": record.generation}
    # renewed in the block's transaction, and committed with the completion
    assert record.renew_count >= 2


@pytest.mark.parametrize("lease_store_target", ["postgres", "mysql"], indirect=True)
def test_a_worker_frozen_inside_its_block_holds_the_job_for_about_one_lease(
    cluster: Cluster, lease_store_target: StoreTarget, effects: sa.Table
) -> None:
    """A is frozen inside its block (row written, not committed); the
    database ends A's idle transaction, so B claims the job, commits its
    row, and A's row is never committed."""
    cluster.configure(visibility_timeout=3.0)
    b = cluster.worker("b", app=ONCE_APP, env=block_env(lease_store_target, effects, 0.0))
    b.freeze()  # started now, so its start-up is not counted; it runs once A is frozen
    frozen = cluster.worker("a", app=ONCE_APP, env=block_env(lease_store_target, effects, 15.0))
    job = f"paused-{uuid.uuid4().hex[:8]}"
    result = cluster.send(ONCE, task_id=job)
    wait_until(lambda: counter(cluster, f"side:once-inside:{job}"), timeout=60,
               message="A inside its block")  # fmt: skip
    held = cluster.record(job)
    assert held is not None
    frozen.freeze()
    frozen_at = time.monotonic()
    b.thaw()
    taken = wait_until(lambda: newer(cluster, job, held.generation), timeout=60,
                       message="B's claim")  # fmt: skip
    claimed_after = time.monotonic() - frozen_at
    value = result.get(timeout=60)
    answered_after = time.monotonic() - frozen_at
    frozen.thaw()
    rows = effects_per_job(lease_store_target, effects, [job])[job]
    print(f"frozen in the block, {lease_store_target.kind}: ttl {cluster.config.ttl:g} s: "
          f"B claimed {claimed_after:.1f} s and answered {answered_after:.1f} s after the "
          f"freeze; rows {rows}")  # fmt: skip
    assert taken.generation > held.generation
    assert value["generation"] == taken.generation
    assert rows == 1
    frozen.wait_for_log(rf"lease fenced-out: job={job}", timeout=90)
    assert effects_per_job(lease_store_target, effects, [job])[job] == 1


@pytest.mark.parametrize("lease_store_target", ["sqlite"], indirect=True)
def test_a_worker_on_an_sqlite_store_warns_that_a_pause_holds_the_database(
    cluster: Cluster, lease_store_target: StoreTarget
) -> None:
    worker = cluster.worker("a")
    worker.wait_for_log(r"the lease store is SQLite", timeout=30)
    assert SQLITE_PAUSE_WARNING in " ".join(worker.log().split())
