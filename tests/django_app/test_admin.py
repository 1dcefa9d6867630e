"""The lease admin: dates for the store's times, the columns an operator
needs in view at 1400 px (measured in headless Chromium), the force release
page's crumbs, and no reason asked for a completed job; a job's queued mark
(``lease_queue_unique``) on the lease list and page, the job's last
skipped call on its page, and the queued marks' own list, which finds a key
whose job never ran."""

from __future__ import annotations

import html
import json
import re
import uuid
from pathlib import Path

import django.contrib.admin
import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from celery_leases.stores import LeaseStore
from celery_leases.stores.base import Acquired, LeaseState, ms_to_datetime
from celery_leases.stores.waiters import LAST_SKIPPED, SKIPPED_KEPT
from tests.acceptance.harness import wait_until
from tests.browser import chromium

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "/admin/celery_leases/lease/"
MARKS = "/admin/celery_leases/queuedmark/"
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


def _fields(page: str) -> dict[str, str]:
    """The read-only fields of a detail page, by name, as text."""
    return {
        field: re.sub(r"<[^>]+>", "", value).strip()
        for field, value in re.findall(
            r'<div class="form-row field-(\w+)">.*?<div class="readonly">(.*?)</div>', page, re.S
        )
    }


def _completed(store: LeaseStore, job_id: str) -> None:
    """A job that ran once: its lease record is completed."""
    claimed = store.claim(job_id, OWNER, 60, task_id=f"celery-task-{job_id}")
    assert isinstance(claimed, Acquired)
    assert store.complete(job_id, OWNER, claimed.generation)


def _ran_out(store: LeaseStore, job_id: str, task_id: str) -> None:
    """A queued mark of ``job_id`` that ran out by the store's clock."""
    mark = store.mark_queued(job_id, task_id, 0.2)
    wait_until(lambda: store.now_ms() > mark.queued_until_ms, timeout=30)


def test_the_detail_page_shows_the_stores_times_as_dates(django_store: LeaseStore) -> None:
    claimed = django_store.claim("job-dated", OWNER, 30, task_id="celery-task-dated")
    assert isinstance(claimed, Acquired)
    assert django_store.renew("job-dated", OWNER, claimed.generation, 30)
    record = django_store.get("job-dated")
    assert record is not None
    assert record.claimed_at_ms is not None
    assert record.renewed_at_ms is not None
    page = _admin().get(f"{CHANGELIST}job-dated/change/").content.decode()
    shown = _fields(page)
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
        job_id = str(uuid.uuid4())
        django_store.claim(
            job_id, OWNER, 60,
            task_name="orders.tasks.charge_the_customer_again", task_id=str(uuid.uuid4()),
        )  # fmt: skip
        django_store.mark_queued(job_id, str(uuid.uuid4()), 3600)  # the widest "queued"
    page = _admin().get(CHANGELIST).content.decode()
    # the page as a browser gets it, with the admin's own style sheets (the
    # shop serves no static files: its pages name them relative, admin/css/...)
    (tmp_path / "admin").symlink_to(Path(django.contrib.admin.__file__).parent / "static" / "admin")
    # measured once the page has loaded: the admin's deferred scripts have
    # run by then, and the navigation sidebar is open, as on a first visit
    measure = """<script>
      window.addEventListener('load', () => {
        const results = document.querySelector('#changelist .results');
        const edge = Math.min(window.innerWidth, results.getBoundingClientRect().right);
        const headers = [...document.querySelectorAll('#result_list thead th')];
        document.body.dataset.columns = JSON.stringify(headers.map(th => th.textContent.trim()));
        document.body.dataset.cut = JSON.stringify(headers
          .filter(th => th.getBoundingClientRect().right > edge + 0.5)
          .map(th => th.textContent.trim()));
        document.body.dataset.sidebar = JSON.stringify(
          document.querySelector('#main').classList.contains('shifted'));
      });
    </script>"""
    (tmp_path / "list.html").write_text(page.replace("</body>", f"{measure}</body>"))
    dom = chromium(
        (tmp_path / "list.html").as_uri(), tmp_path, "--window-size=1400,1000", "--dump-dom"
    )
    found = {
        name: json.loads(value.replace("&quot;", '"'))
        for name, value in re.findall(r'data-(columns|cut|sidebar)="([^"]*)"', dom)
    }
    assert [c.lower() for c in found["columns"][1:]] == [
        "job id", "state", "task name", "task id", "generation", "holder",
        "lease until (utc)", "expired", "left", "queued",
    ]  # fmt: skip
    assert found["sidebar"] is True  # the navigation beside the list takes its room
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


def test_the_list_shows_a_jobs_queued_task_id_and_the_time_its_mark_has_left(
    django_store: LeaseStore,
) -> None:
    for job_id in ("job-a-queued", "job-b-plain", "job-c-ran-out"):
        _completed(django_store, job_id)
    django_store.mark_queued("job-a-queued", "celery-task-next", 60)
    _ran_out(django_store, "job-c-ran-out", "celery-task-lost")
    page = _admin().get(CHANGELIST, {"o": "1"}).content.decode()  # by job id
    assert _cells(page, "job_id") == ["job-a-queued", "job-b-plain", "job-c-ran-out"]
    queued = _cells(page, "queued")
    assert queued[1:] == ["-", "-"]  # none, and one the store no longer counts
    match = re.fullmatch(r"celery-task-next \((\d+\.\d) s left\)", queued[0])
    assert match, queued
    assert 0 < float(match.group(1)) <= 60


def test_the_list_reads_the_queued_marks_in_one_query_whatever_the_rows(
    django_store: LeaseStore,
) -> None:
    client = _admin()

    def list_page_queries() -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            assert client.get(CHANGELIST).status_code == 200
        return [query["sql"] for query in queries.captured_queries]

    _completed(django_store, "job-0")
    django_store.mark_queued("job-0", "celery-task-0", 60)
    few = list_page_queries()
    for n in range(1, 8):
        _completed(django_store, f"job-{n}")
        django_store.mark_queued(f"job-{n}", f"celery-task-{n}", 60)
    many = list_page_queries()
    page = client.get(CHANGELIST).content.decode()
    assert len([c for c in _cells(page, "queued") if c.startswith("celery-task-")]) == 8
    assert len(many) == len(few)
    assert len([sql for sql in many if "celery_leases_queued" in sql]) == 1
    assert len([sql for sql in many if "celery_leases_waiters" in sql]) == 1


def test_the_detail_page_shows_the_queued_marks_task_id_and_times(
    django_store: LeaseStore,
) -> None:
    _completed(django_store, "job-again")
    mark = django_store.mark_queued("job-again", "celery-task-again", 60)
    client = _admin()
    shown = _fields(client.get(f"{CHANGELIST}job-again/change/").content.decode())
    assert shown["queued_task"] == "celery-task-again"
    assert shown["queued_since"] == _shown(mark.queued_at_ms)
    assert shown["queued_until_shown"] == _shown(mark.queued_until_ms)

    _completed(django_store, "job-idle")
    shown = _fields(client.get(f"{CHANGELIST}job-idle/change/").content.decode())
    assert shown["queued_task"] == shown["queued_since"] == shown["queued_until_shown"] == "-"


def test_the_detail_page_shows_the_jobs_last_skipped_call(django_store: LeaseStore) -> None:
    _completed(django_store, "job-busy")
    for task_id in ("celery-task-skipped-1", "celery-task-skipped-2"):
        django_store.add_waiter("job-busy", LAST_SKIPPED, task_id, b"", SKIPPED_KEPT)
    [entry] = django_store.waiters("job-busy")
    client = _admin()
    shown = _fields(client.get(f"{CHANGELIST}job-busy/change/").content.decode())
    assert shown["skipped_task"] == "celery-task-skipped-2"
    assert shown["skipped_at"] == _shown(entry.waiting_since_ms)

    # none, and one that ran out by the store's clock
    _completed(django_store, "job-calm")
    _completed(django_store, "job-long-ago")
    django_store.add_waiter("job-long-ago", LAST_SKIPPED, "celery-task-old", b"", 0.2)
    wait_until(lambda: not django_store.waiters("job-long-ago"), timeout=30)
    for job_id in ("job-calm", "job-long-ago"):
        shown = _fields(client.get(f"{CHANGELIST}{job_id}/change/").content.decode())
        assert shown["skipped_task"] == shown["skipped_at"] == "-", job_id


def test_a_key_that_is_only_queued_is_found_in_the_queued_marks_list(
    django_store: LeaseStore,
) -> None:
    first = django_store.mark_queued("job-never-ran", "celery-task-first", 60)
    _completed(django_store, "job-ran")
    django_store.mark_queued("job-ran", "celery-task-second", 60)
    _ran_out(django_store, "job-lost", "celery-task-lost")
    client = _admin()
    assert "job-never-ran" not in client.get(CHANGELIST).content.decode()

    page = client.get(MARKS, {"o": "0"}).content.decode()  # by job id (no action column)
    assert _cells(page, "job_id") == ["job-lost", "job-never-ran", "job-ran"]
    assert _cells(page, "task_id") == [
        "celery-task-lost",
        "celery-task-first",
        "celery-task-second",
    ]
    assert _cells(page, "lease") == ["none (never run)", "none (never run)", "completed"]
    assert f'href="{CHANGELIST}job-ran/change/"' in page
    left = _cells(page, "left")
    assert left[0] == "ran out"
    assert re.fullmatch(r"\d+\.\d s", left[1]), left
    assert _cells(page, "since")[1] == _shown(first.queued_at_ms)
    assert _cells(page, "until")[1] == _shown(first.queued_until_ms)
    # by job id or by the queued task id
    for query in ("never-ran", "celery-task-first"):
        found = client.get(MARKS, {"q": query}).content.decode()
        assert _cells(found, "job_id") == ["job-never-ran"]


def test_the_queued_marks_are_read_only(django_store: LeaseStore) -> None:
    django_store.mark_queued("job-queued", "celery-task-queued", 60)
    client = _admin()
    assert client.get(f"{MARKS}add/").status_code == 403
    assert client.post(f"{MARKS}job-queued/delete/", {"post": "yes"}).status_code == 403
    page = client.get(f"{MARKS}job-queued/change/").content.decode()
    assert 'name="_save"' not in page
    assert _fields(page)["task_id"] == "celery-task-queued"
    assert django_store.queued("job-queued") is not None
