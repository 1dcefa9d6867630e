"""Fixtures of the Django tests: the shop project's settings, real worker processes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
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


def url_of_this_database() -> sa.URL:
    """A store URL of the test database, written from where Django's connection
    is (on PostgreSQL, as libpq resolved it: a socket folder, a service's host)."""
    settings = connection.settings_dict
    if connection.vendor == "sqlite":
        return sa.URL.create("sqlite", database=str(settings["NAME"]))
    if connection.vendor == "mysql":
        host = str(settings["HOST"] or "")
        socket = host.startswith("/")  # Django's unix_socket
        return sa.URL.create(
            "mysql+pymysql",
            username=settings["USER"] or None,
            password=settings["PASSWORD"] or None,
            host=None if socket else host or None,
            port=int(settings["PORT"]) if settings["PORT"] else None,
            database=settings["NAME"],
            query={"unix_socket": host} if socket else {},
        )
    connection.ensure_connection()
    info = connection.connection.info  # psycopg's ConnectionInfo
    passed = info.get_parameters()  # those not at their default, password left out
    query = {k: v for k, v in passed.items() if k not in ("host", "port", "user", "dbname")}
    return sa.URL.create(
        "postgresql+psycopg",
        username=info.user,
        password=info.password or None,
        database=info.dbname,
        query={"host": info.host, "port": str(info.port), **query},
    )
