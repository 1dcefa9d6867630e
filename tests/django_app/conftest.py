"""Fixtures of the Django tests: the shop project's settings, real worker processes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from celery_leases.stores import LeaseStore, open_store
from tests.acceptance.harness import REPO_ROOT, Worker

SHOP = REPO_ROOT / "example_project" / "django_shop"

StartWorker = Callable[..., Worker]


@pytest.fixture
def django_store() -> Iterator[LeaseStore]:
    """The store a ``django://default`` setting opens, on the test database."""
    store = open_store("django://default")
    yield store
    store.close()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[StartWorker]:
    """Start ``celery -A shop worker`` processes on the test database; stop them after."""
    started: list[Worker] = []

    def start(*extra_args: str, env: dict[str, str] | None = None) -> Worker:
        worker = Worker(
            f"shop-{uuid.uuid4().hex[:8]}",
            {"SHOP_DB_NAME": str(connection.settings_dict["NAME"]), **(env or {})},
            tmp_path,
            pool="solo",
            queue="celery",
            app="shop",
            cwd=SHOP,
            extra_args=extra_args,
        )
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.stop()


def lease_of(store: LeaseStore, task_name: str) -> Any:
    """The one record of ``task_name`` in ``store``, or ``None``."""
    records = [r for r in store.records() if getattr(r, "task_name", None) == task_name]
    return records[0] if len(records) == 1 else None
