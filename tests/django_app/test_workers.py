"""Real ``celery -A shop worker`` processes on the Django test database.

A run of ``orders.tasks.pack`` writes the order ("picking"), waits for a
file the test makes, then writes it again ("packed"), both through
``fenced_update`` on the ORM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from orders.models import Order
from orders.tasks import pack

from celery_leases.contrib.django.fencing import fenced_update
from celery_leases.contrib.django.models import Lease
from celery_leases.stores import LeaseStore
from celery_leases.stores.base import Acquired, LeaseState
from tests.acceptance.harness import wait_until
from tests.django_app.conftest import SHOP, StartWorker

pytestmark = pytest.mark.django_db(transaction=True)


def start_pack(tmp_path: Path) -> tuple[Order, Path, str]:
    """Send ``pack`` for a new order; wait until its run has written "picking"."""
    order = Order.objects.create()
    go = tmp_path / f"go-{order.pk}"
    job_id = pack.delay(order.pk, str(go)).id
    wait_until(
        lambda: Order.objects.get(pk=order.pk).status == "picking",
        timeout=30,
        message="the run's first write",
    )
    return order, go, job_id


def test_an_orm_write_of_a_stale_generation_is_refused(
    tmp_path: Path, start_worker: StartWorker, django_store: LeaseStore
) -> None:
    # a long lease: the holder's own deadline is far away, so only the
    # fence in the row can stop its second write
    worker = start_worker("--leases-ttl", "60")
    order, go, job_id = start_pack(tmp_path)
    held = django_store.get(job_id)
    assert held is not None
    assert held.state is LeaseState.HELD
    # an operator takes the lease away and a new run writes the row
    django_store.force_release(job_id, by="test", reason="stuck")
    newer = django_store.claim(job_id, "the-next-run", 30)
    assert isinstance(newer, Acquired)
    fenced_update(Order.objects.filter(pk=order.pk), newer, status="rerun")
    go.touch()
    refused = worker.wait_for_log(rf"order {order.pk} not packed: (.*)", timeout=30)[1]
    assert f"generation {held.generation} was refused" in refused
    assert f"it has accepted generation {newer.generation}" in refused
    worker.wait_for_log(rf"lease fenced-out: job={re.escape(job_id)}", timeout=30)
    order.refresh_from_db()
    assert (order.status, order.fence_generation) == ("rerun", newer.generation)


def test_a_forced_release_from_the_admin_fences_the_live_holder_out(
    tmp_path: Path, start_worker: StartWorker, django_store: LeaseStore
) -> None:
    worker = start_worker()  # CELERY_LEASES_TTL = 3: renewed every second
    order, go, job_id = start_pack(tmp_path)
    held = django_store.get(job_id)
    assert held is not None
    user = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw")
    client = Client()
    client.force_login(user)
    changelist = "/admin/celery_leases/lease/"
    listed = client.get(changelist, {"state__exact": "held", "q": job_id})
    assert listed.status_code == 200
    assert job_id in listed.content.decode()
    chosen = {"action": "force_release", "_selected_action": [job_id]}
    asked = client.post(changelist, chosen)
    assert asked.status_code == 200
    assert 'name="reason"' in asked.content.decode()
    done = client.post(changelist, {**chosen, "apply": "1", "reason": "host-3 is stuck"})
    assert done.status_code == 302
    released = Lease.objects.get(pk=job_id)
    assert (released.state, released.release_reason) == ("released", "host-3 is stuck")
    assert released.released_by == "ops (django admin)"
    assert released.generation > held.generation
    # the holder's next renewal is refused: it stops before its next write
    worker.wait_for_log(rf"lease lost: job={re.escape(job_id)}", timeout=30)
    go.touch()
    worker.wait_for_log(rf"lease fenced-out: job={re.escape(job_id)}", timeout=30)
    order.refresh_from_db()
    assert order.status == "picking"
    assert django_store.get(job_id).state is LeaseState.RELEASED  # type: ignore[union-attr]


def test_the_admin_shows_leases_read_only(django_store: LeaseStore) -> None:
    django_store.claim("job-shown", "owner", 30, task_name="orders.tasks.charge")
    django_store.claim("job-other", "owner", 30, task_id="celery-task-other")
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("ops", "o@example.com", "pw"))
    page = client.get("/admin/celery_leases/lease/", {"task_name": "orders.tasks.charge"})
    assert "job-shown" in page.content.decode()
    assert "job-other" not in page.content.decode()
    found = client.get("/admin/celery_leases/lease/", {"q": "celery-task-other"}).content.decode()
    assert "job-other" in found
    assert "job-shown" not in found
    assert client.get("/admin/celery_leases/lease/add/").status_code == 403
    detail = client.get("/admin/celery_leases/lease/job-shown/change/").content.decode()
    assert 'name="_save"' not in detail


def test_a_misspelled_setting_is_named_at_worker_start(
    tmp_path: Path, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "misspelled_settings.py").write_text(
        "from shop.settings import *  # noqa: F403\nCELERY_LEASES_TLL = 5\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    worker = start_worker(env={"DJANGO_SETTINGS_MODULE": "misspelled_settings"})
    assert "'CELERY_LEASES_TLL' is not a celery-leases setting" in worker.log()
    assert "did you mean 'CELERY_LEASES_TTL'?" in worker.log()


def test_celery_leases_ls_opens_the_django_store(django_store: LeaseStore) -> None:
    django_store.claim("job-listed", "owner", 30, task_name="orders.tasks.charge")
    listed = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "shop", "leases", "ls", "--json"],
        cwd=SHOP,
        env={
            **os.environ,
            "SHOP_DB_NAME": str(connection.settings_dict["NAME"]),
            "PYTHONPATH": os.pathsep.join(sys.path),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert [r["job_id"] for r in json.loads(listed.stdout)["records"]] == ["job-listed"]


def test_the_admin_does_not_release_a_completed_job(django_store: LeaseStore) -> None:
    claimed = django_store.claim("job-done", "owner", 30)
    assert isinstance(claimed, Acquired)
    django_store.complete("job-done", "owner", claimed.generation)
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("ops", "o@example.com", "pw"))
    page = client.post(
        "/admin/celery_leases/lease/",
        {
            "action": "force_release",
            "_selected_action": ["job-done"],
            "apply": "1",
            "reason": "by mistake",
        },
        follow=True,
    )
    assert "a completed job is not released" in page.content.decode()
    assert Lease.objects.get(pk="job-done").state == "completed"
