"""``contrib.django.exactly_once``: ORM writes and the completion in one ``atomic()``.

Real ``celery -A shop worker`` processes run ``orders.tasks.ship``, which
creates one ``Shipment`` row per run inside the block; the tests hold a run
before or after its commit (``orders.tasks.hold``), SIGKILL or SIGSTOP the
worker there, and count the rows per job, which must end at exactly 1.
A redelivery is sent as the broker would: the same task id and send id.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
from celery.result import AsyncResult
from django.db import connection, transaction
from orders.models import Order, Shipment
from orders.tasks import ship

from celery_leases import LeaseConfigurationError, LeaseLost
from celery_leases.contrib.django.exactly_once import exactly_once
from celery_leases.lease import Lease
from celery_leases.sending import keeping_send_id
from celery_leases.settings import LeaseTiming
from celery_leases.stores import LeaseStore, open_store
from celery_leases.stores.base import Acquired, LeaseRecord, LeaseState
from tests.acceptance.harness import Worker, wait_until
from tests.django_app.conftest import StartWorker, url_of_this_database
from tests.proxy import Proxy

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 45


def send_ship(order: Order, hold_in: Path, job_id: str, send_id: str) -> AsyncResult:
    """One delivery of ``ship``; a second call with the same ids is a redelivery."""
    with keeping_send_id(send_id):
        return ship.apply_async((order.pk, str(hold_in)), task_id=job_id)


def shipments(job_id: str) -> list[int]:
    """The generations of the job's committed rows."""
    return list(Shipment.objects.filter(job_id=job_id).values_list("generation", flat=True))


def a_job(tmp_path: Path) -> tuple[Order, Path, str, str]:
    hold_in = tmp_path / f"hold-{uuid.uuid4().hex[:8]}"
    hold_in.mkdir()
    return Order.objects.create(), hold_in, f"ship-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex


def test_a_kill_before_the_commit_leaves_nothing_and_the_job_runs_again(
    tmp_path: Path, start_worker: StartWorker, django_store: LeaseStore
) -> None:
    order, hold_in, job_id, send_id = a_job(tmp_path)
    first = start_worker()
    send_ship(order, hold_in, job_id, send_id)
    first.wait_for_log(rf"job {re.escape(job_id)} held at before-commit", timeout=WAIT)
    held = django_store.get(job_id)
    assert held is not None
    first.kill()
    assert shipments(job_id) == []
    assert Order.objects.get(pk=order.pk).status == "open"
    (hold_in / "after-commit.go").touch()  # the next run does not wait
    second = start_worker()
    value = send_ship(order, hold_in, job_id, send_id).get(timeout=WAIT)
    second.kill()  # faster than a warm shutdown; nothing runs any more
    record = django_store.get(job_id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert record.generation > held.generation
    assert value == {"order": order.pk, "generation": record.generation}
    assert shipments(job_id) == [record.generation]
    assert Order.objects.get(pk=order.pk).status == "shipped"


def test_a_kill_after_the_commit_is_answered_from_the_kept_outcome(
    tmp_path: Path, start_worker: StartWorker, django_store: LeaseStore
) -> None:
    order, hold_in, job_id, send_id = a_job(tmp_path)
    (hold_in / "before-commit.go").touch()  # held after the commit only
    first = start_worker()
    send_ship(order, hold_in, job_id, send_id)
    first.wait_for_log(rf"job {re.escape(job_id)} held at after-commit", timeout=WAIT)
    first.kill()
    record = django_store.get(job_id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert shipments(job_id) == [record.generation]
    second = start_worker()
    value = send_ship(order, hold_in, job_id, send_id).get(timeout=WAIT)
    second.kill()
    assert value == {"order": order.pk, "generation": record.generation}
    assert shipments(job_id) == [record.generation]
    assert "lease claimed" not in second.log()  # answered from the record: the body did not run


class HeldRun(NamedTuple):
    """A run of ``ship`` held inside its block, before the commit."""

    order: Order
    hold_in: Path
    job_id: str
    worker: Worker
    result: AsyncResult
    held: LeaseRecord


def held_before_commit(
    tmp_path: Path, start_worker: StartWorker, django_store: LeaseStore
) -> HeldRun:
    order, hold_in, job_id, send_id = a_job(tmp_path)
    (hold_in / "after-commit.go").touch()  # held before the commit only
    worker = start_worker()  # CELERY_LEASES_TTL = 3
    result = send_ship(order, hold_in, job_id, send_id)
    worker.wait_for_log(rf"job {re.escape(job_id)} held at before-commit", timeout=WAIT)
    held = django_store.get(job_id)
    assert held is not None
    return HeldRun(order, hold_in, job_id, worker, result, held)


def test_a_holder_stopped_past_its_lease_is_refused_and_its_rows_roll_back(
    tmp_path: Path, start_worker: StartWorker, django_store: LeaseStore
) -> None:
    _, hold_in, job_id, worker, _, held = held_before_commit(tmp_path, start_worker, django_store)
    worker.freeze()
    time.sleep(4)  # past the lease
    worker.thaw()
    worker.wait_for_log(rf"lease lost: job={re.escape(job_id)}", timeout=WAIT)
    (hold_in / "before-commit.go").touch()
    worker.wait_for_log(rf"lease fenced-out: job={re.escape(job_id)}", timeout=WAIT)
    # the message is published again, and the next run commits
    wait_until(
        lambda: (r := django_store.get(job_id)) is not None and r.state is LeaseState.COMPLETED,
        timeout=WAIT,
        message="the next run's commit",
    )
    record = django_store.get(job_id)
    assert record is not None
    worker.kill()
    assert record.generation > held.generation
    assert shipments(job_id) == [record.generation]


def test_a_block_longer_than_the_lease_commits_once(
    tmp_path: Path, start_worker: StartWorker, django_store: LeaseStore
) -> None:
    order, hold_in, job_id, worker, result, held = held_before_commit(
        tmp_path, start_worker, django_store
    )
    time.sleep(4.5)  # the block stays open longer than the lease
    (hold_in / "before-commit.go").touch()
    value = result.get(timeout=WAIT)
    record = django_store.get(job_id)
    worker.kill()
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    # the same run committed, with the renewals made in its transaction
    assert record.generation == held.generation
    assert record.renew_count >= 2
    assert value == {"order": order.pk, "generation": held.generation}
    assert shipments(job_id) == [held.generation]


# -- refusals, in this process, on a lease of the test database ---------------


class _Task(SimpleNamespace):
    def lease_options(self) -> Any:
        return SimpleNamespace(result_serializer="json", result_max_bytes=65536)


def held_by_this_process(store: LeaseStore) -> _Task:
    job_id = f"local-{uuid.uuid4().hex[:8]}"
    claim = store.claim(job_id, "owner-1", 30.0)
    assert isinstance(claim, Acquired)
    lease = Lease(
        job_id=job_id,
        owner="owner-1",
        generation=claim.generation,
        lease_until_ms=claim.lease_until_ms,
        started_at=time.monotonic(),
        store=store,
        timing=LeaseTiming(ttl=30.0, renew_interval=10.0, drift_margin=1.0),
    )
    return _Task(lease=lease)


def ship_here(task: _Task, order: Order | None = None, *, roll_back: bool = False) -> None:
    """``orders.tasks.ship``'s block, in this process; ``roll_back`` marks it for rollback."""
    with exactly_once(task) as tx:
        if order is not None:
            Shipment.objects.create(order=order, job_id=task.lease.job_id, generation=1)
        if roll_back:
            transaction.set_rollback(True)
        tx.complete("shipped")


def test_a_block_commits_its_rows_with_the_completion_in_this_process(
    django_store: LeaseStore,
) -> None:
    task = held_by_this_process(django_store)
    order = Order.objects.create()
    with exactly_once(task) as tx:
        Shipment.objects.create(order=order, job_id=task.lease.job_id, generation=1)
        with transaction.atomic():  # a savepoint of the block's transaction
            Order.objects.filter(pk=order.pk).update(status="shipped")
        tx.complete("shipped")
    assert task.lease.completed_in_transaction
    record = django_store.get(task.lease.job_id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED
    assert shipments(task.lease.job_id) == [1]
    assert connection.get_autocommit()  # Django's connection is as it was


def test_a_block_inside_an_atomic_block_is_refused(django_store: LeaseStore) -> None:
    task = held_by_this_process(django_store)
    order = Order.objects.create()
    with (
        transaction.atomic(),
        pytest.raises(LeaseConfigurationError, match=r"inside an atomic\(\) block"),
    ):
        ship_here(task, order)
    assert django_store.get(task.lease.job_id).state is LeaseState.HELD  # type: ignore[union-attr]
    assert shipments(task.lease.job_id) == []


def test_a_block_marked_for_rollback_is_refused_and_rolled_back(
    django_store: LeaseStore,
) -> None:
    task = held_by_this_process(django_store)
    order = Order.objects.create()
    with pytest.raises(LeaseConfigurationError, match="marked for rollback"):
        ship_here(task, order, roll_back=True)
    assert not task.lease.completed_in_transaction
    assert django_store.get(task.lease.job_id).state is LeaseState.HELD  # type: ignore[union-attr]
    assert shipments(task.lease.job_id) == []
    assert connection.get_autocommit()


def test_a_lease_taken_over_is_refused_before_any_row(django_store: LeaseStore) -> None:
    task = held_by_this_process(django_store)
    django_store.force_release(task.lease.job_id, by="test", reason="stuck")
    with pytest.raises(LeaseLost):
        ship_here(task)
    assert django_store.get(task.lease.job_id).state is LeaseState.RELEASED  # type: ignore[union-attr]


def test_a_store_on_another_database_is_refused(tmp_path: Path) -> None:
    other = open_store(f"sqlite:///{tmp_path / 'other.sqlite3'}")
    try:
        task = held_by_this_process(other)
        with pytest.raises(LeaseConfigurationError, match="needs the lease store on the database"):
            ship_here(task)
        assert other.get(task.lease.job_id).state is LeaseState.HELD  # type: ignore[union-attr]
    finally:
        other.close()


def test_a_store_url_of_the_same_database_written_otherwise_is_taken() -> None:
    url = url_of_this_database()
    if connection.vendor == "mysql":
        # MariaDB's own dialect name, and the default port left out
        url = url.set(drivername="mariadb+pymysql")
        if url.port == 3306:
            url = url.set(port=None)
    store = open_store(url.render_as_string(hide_password=False), create_table=False)
    try:
        task = held_by_this_process(store)
        ship_here(task, Order.objects.create())
        assert shipments(task.lease.job_id) == [1]
        assert store.get(task.lease.job_id).state is LeaseState.COMPLETED  # type: ignore[union-attr]
    finally:
        store.close()


def test_an_error_in_the_block_rolls_its_rows_back_and_passes_through(
    django_store: LeaseStore,
) -> None:
    task = held_by_this_process(django_store)
    order = Order.objects.create()

    def fail_after_a_row() -> None:
        with exactly_once(task):
            Shipment.objects.create(order=order, job_id=task.lease.job_id, generation=1)
            raise ValueError("the carrier said no")

    with pytest.raises(ValueError, match="the carrier said no"):
        fail_after_a_row()
    assert shipments(task.lease.job_id) == []
    assert django_store.get(task.lease.job_id).state is LeaseState.HELD  # type: ignore[union-attr]
    assert not task.lease.lost
    assert connection.get_autocommit()


def test_a_connection_refused_as_the_block_opens_loses_the_lease() -> None:
    """Django's connection is refused as the block opens (``atomic()``
    connects): the lease reads as lost with reason ``"unavailable"``, so the
    run is fenced out and published again rather than failed."""
    # tests/integration/test_django.py leaves it out of the SQLite run
    assert connection.vendor != "sqlite", "a refused connection needs a database over the network"
    settings = connection.settings_dict
    saved = settings["HOST"], settings["PORT"]
    with Proxy(settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 0)) as proxy:
        connection.close()
        settings["HOST"], settings["PORT"] = "127.0.0.1", str(proxy.port)
        store = open_store("django://default")  # the same database, through the proxy
        try:
            task = held_by_this_process(store)
            proxy.refuse()
            connection.close()
            with pytest.raises(LeaseLost) as lost:
                ship_here(task)
        finally:
            store.close()
            connection.close()
            settings["HOST"], settings["PORT"] = saved
    assert lost.value.reason == "unavailable"
    assert "could not begin" in str(lost.value)
    assert task.lease.lost
