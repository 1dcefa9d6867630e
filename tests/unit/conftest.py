"""Fixtures of the unit tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_leases.task import forget_runtime


@pytest.fixture
def app() -> Iterator[Celery]:
    """A fresh app without settings; its lease runtime is forgotten after the test."""
    app = Celery("unit", set_as_current=False)
    yield app
    forget_runtime(app)
    app.close()
