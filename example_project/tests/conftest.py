"""Fixtures of the example project's tests, on the celery-leases pytest plugin.

The plugin (``celery_leases.pytest_plugin``) gives the in-memory lease store
with a manual clock, the fault helpers and an in-process worker; these
fixtures point it at the invoices app, on the in-memory broker and result
backend, with a ledger in a temporary SQLite file and a real receipt service.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from invoices.config import Config
from invoices.ledger import open_ledger
from invoices.receipts import ReceiptService, serve
from invoices.tasks import make_app


# --8<-- [start:fixtures]
@pytest.fixture
def receipts() -> Iterator[ReceiptService]:
    service = ReceiptService()
    server = serve(service)
    service.url = f"http://127.0.0.1:{server.server_port}"  # type: ignore[attr-defined]
    yield service
    server.shutdown()
    server.server_close()


@pytest.fixture
def config(tmp_path: Path, receipts: ReceiptService) -> Config:
    return Config(
        data_dir=tmp_path,
        broker="memory://",
        backend="cache+memory://",
        receipts_url=receipts.url,  # type: ignore[attr-defined]
        ttl=3.0,
        work_seconds=0.0,
    )


@pytest.fixture
def leases_app(config: Config) -> Any:
    """The plugin's app: the example's own, configured for tests."""
    app = make_app(config)
    app.conf.leases_defer_backoff = 0.2  # a store outage is retried quickly
    return app


@pytest.fixture
def ledger(config: Config) -> Iterator[sa.Engine]:
    engine = open_ledger(config.ledger_url)
    yield engine
    engine.dispose()


# --8<-- [end:fixtures]
