"""The celery-leases pytest plugin, pointed at the shop's Celery app and its database."""

# --8<-- [start:fixtures]
from typing import Any

import pytest


@pytest.fixture
def leases_app() -> Any:
    """The plugin's worker and store fixtures run the shop's own app."""
    from shop.celery import app

    return app


@pytest.fixture
def lease_store_url() -> str:
    """The lease table of the test database, as the settings name it."""
    return "django://default"


# --8<-- [end:fixtures]
