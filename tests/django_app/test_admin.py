"""The lease admin: dates for the store's times, the columns an operator
needs in view at 1400 px (measured in headless Chromium), the force release
page's crumbs, and no reason asked for a completed job."""

from __future__ import annotations

import html
import json
import re
import uuid
from pathlib import Path

import django.contrib.admin
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from celery_leases.stores import LeaseStore
from celery_leases.stores.base import Acquired, LeaseState, ms_to_datetime
from tests.acceptance.harness import wait_until
from tests.browser import chromium

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "/admin/celery_leases/lease/"
#: an owner as a worker writes it: host, pid, a random part
OWNER = "worker-7.eu-west-1.compute.internal:1234567:0123456789abcdef"


def _admin() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("ops", "o@example.com", "pw"))
    return client


def _cells(page: str, field: str) -> list[str]:
    return [
        re.sub(r"<[^>]+>", "", cell).strip()
        for cell in re.findall(rf'<t[dh] class="field-{field}[^"]*">(.*?)</t[dh]>', page, re.S)
    ]


def _shown(ms: int) -> str:
    return ms_to_datetime(ms).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def test_the_detail_page_shows_the_stores_times_as_dates(django_store: LeaseStore) -> None:
    claimed = django_store.claim("job-dated", OWNER, 30, task_id="celery-task-dated")
    assert isinstance(claimed, Acquired)
    assert django_store.renew("job-dated", OWNER, claimed.generation, 30)
    record = django_store.get("job-dated")
    assert record is not None
    assert record.claimed_at_ms is not None
    assert record.renewed_at_ms is not None
    page = _admin().get(f"{CHANGELIST}job-dated/change/").content.decode()
    shown = {
        field: value.strip()
        for field, value in re.findall(
            r'<div class="form-row field-(\w+)">.*?<div class="readonly">(.*?)</div>', page, re.S
        )
    }
    assert shown["until"] == _shown(record.lease_until_ms)
    assert shown["claimed"] == _shown(record.claimed_at_ms)
    assert shown["renewed"] == _shown(record.renewed_at_ms)
    assert shown["completed"] == shown["released"] == "-"
    # no field of raw milliseconds is left
    assert not {"lease_until", "claimed_at", "renewed_at", "completed_at"} & set(shown)
    assert OWNER in page  # the whole owner, where the list shows host:pid


def test_the_list_shows_the_task_id_whether_expired_and_the_time_left(
    django_store: LeaseStore,
) -> None:
    django_store.claim("job-live", OWNER, 60, task_id="celery-task-live")
    django_store.claim("job-stale", OWNER, 0.2, task_id="celery-task-stale")
    record = django_store.get("job-stale")
    assert record is not None
    wait_until(lambda: django_store.now_ms() > record.lease_until_ms, timeout=30)
    django_store.claim("job-done", OWNER, 60)
    done = django_store.get("job-done")
    assert done is not None
    django_store.complete("job-done", OWNER, done.generation)
    page = _admin().get(CHANGELIST, {"o": "1"}).content.decode()  # by job id
    assert _cells(page, "job_id") == ["job-done", "job-live", "job-stale"]
    assert _cells(page, "task_id") == ["-", "celery-task-live", "celery-task-stale"]
    assert _cells(page, "expired") == ["-", "no", "yes"]
    left = _cells(page, "left")
    assert left[0] == left[2] == "-"
    assert re.fullmatch(r"\d+\.\d s", left[1]), left
    assert 0 < float(left[1].split()[0]) <= 60
    assert _cells(page, "holder")[1] == "worker-7.eu-west-1.compute.internal:1234567"


def test_every_column_of_the_list_is_in_view_at_1400_px(
    django_store: LeaseStore, tmp_path: Path
) -> None:
    for _ in range(5):
        django_store.claim(
            str(uuid.uuid4()), OWNER, 60,
            task_name="orders.tasks.charge_the_customer_again", task_id=str(uuid.uuid4()),
        )  # fmt: skip
    page = _admin().get(CHANGELIST).content.decode()
    # the page as a browser gets it, with the admin's own style sheets (the
    # shop serves no static files: its pages name them relative, admin/css/...)
    (tmp_path / "admin").symlink_to(Path(django.contrib.admin.__file__).parent / "static" / "admin")
    measure = """<script>
      const results = document.querySelector('#changelist .results');
      const edge = Math.min(window.innerWidth, results.getBoundingClientRect().right);
      const headers = [...document.querySelectorAll('#result_list thead th')];
      document.body.dataset.columns = JSON.stringify(headers.map(th => th.textContent.trim()));
      document.body.dataset.cut = JSON.stringify(headers
        .filter(th => th.getBoundingClientRect().right > edge + 0.5)
        .map(th => th.textContent.trim()));
    </script>"""
    (tmp_path / "list.html").write_text(page.replace("</body>", f"{measure}</body>"))
    dom = chromium(
        (tmp_path / "list.html").as_uri(), tmp_path, "--window-size=1400,1000", "--dump-dom"
    )
    found = {
        name: json.loads(value.replace("&quot;", '"'))
        for name, value in re.findall(r'data-(columns|cut)="([^"]*)"', dom)
    }
    assert [c.lower() for c in found["columns"][1:]] == [
        "job id", "state", "task name", "task id", "generation", "holder",
        "lease until (utc)", "expired", "left",
    ]  # fmt: skip
    assert found["cut"] == [], dom[:2000]


def test_the_force_release_page_has_the_app_and_model_crumbs(django_store: LeaseStore) -> None:
    django_store.claim("job-held", OWNER, 60)
    page = (
        _admin()
        .post(CHANGELIST, {"action": "force_release", "_selected_action": ["job-held"]})
        .content.decode()
    )
    assert 'name="reason"' in page
    (crumbs,) = re.findall(r'<div class="breadcrumbs">(.*?)</div>', page, re.S)
    assert re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", crumbs))).strip() == (
        " \u203a ".join(["Home", "Celery leases", "Leases", "Force release"])
    )
    assert f'href="{CHANGELIST}"' in crumbs


def test_a_completed_job_is_refused_before_a_reason_is_asked(django_store: LeaseStore) -> None:
    claimed = django_store.claim("job-finished", OWNER, 60)
    assert isinstance(claimed, Acquired)
    django_store.complete("job-finished", OWNER, claimed.generation)
    page = (
        _admin()
        .post(
            CHANGELIST,
            {"action": "force_release", "_selected_action": ["job-finished"]},
            follow=True,
        )
        .content.decode()
    )
    assert 'name="reason"' not in page
    assert "a completed job is not released" in page
    record = django_store.get("job-finished")
    assert record is not None
    assert record.state is LeaseState.COMPLETED
