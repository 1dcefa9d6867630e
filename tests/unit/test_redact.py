"""Passwords in lease store URLs and options never reach Celery's settings views."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.app import utils

from celery_leases import LeaseError, open_store
from celery_leases.redact import MASK, install_settings_filter, mask_settings, mask_url

SECRET = "s3cret-Pw"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (f"redis://:{SECRET}@h:6379/0", f"redis://:{MASK}@h:6379/0"),
        (f"rediss://user:{SECRET}@h/1?ssl=1", f"rediss://user:{MASK}@h/1?ssl=1"),
        (f"redis://h/0?password={SECRET}&db=1", f"redis://h/0?password={MASK}&db=1"),
        (
            f"postgresql+psycopg://app:{SECRET}@db:5432/leases",
            f"postgresql+psycopg://app:{MASK}@db:5432/leases",
        ),
        ("postgresql+psycopg://app:p%40ss@db/leases", f"postgresql+psycopg://app:{MASK}@db/leases"),
        (
            f"sentinel://h1:26379;sentinel://:{SECRET}@h2:26379/0",
            f"sentinel://h1:26379;sentinel://:{MASK}@h2:26379/0",
        ),
    ],
)
def test_mask_url_hides_the_password(url: str, masked: str) -> None:
    assert mask_url(url) == masked


@pytest.mark.parametrize(
    "url", ["sqlite:////var/lib/leases.db", "memory://", "redis://user@h/0", "not a url"]
)
def test_mask_url_leaves_urls_without_a_password_alone(url: str) -> None:
    assert mask_url(url) == url


def test_mask_settings_goes_through_mappings_and_lists() -> None:
    options = {
        "prefix": "x:",
        "sentinels": [f"redis://:{SECRET}@s1/0"],
        "nested": {"url": f"redis://:{SECRET}@h"},
    }
    masked = mask_settings(options)
    assert SECRET not in json.dumps(masked)
    assert masked["prefix"] == "x:"


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("redact", set_as_current=False)
    yield app
    app.close()


def test_celery_settings_censor_masks_the_lease_store(app: Celery) -> None:
    install_settings_filter()
    install_settings_filter()  # idempotent: wrapped once
    assert getattr(utils.filter_hidden_settings, "__wrapped__", None) is not None
    assert not hasattr(utils.filter_hidden_settings.__wrapped__, "__wrapped__")
    app.conf.update(
        leases_store=f"postgresql+psycopg://app:{SECRET}@db/leases",
        leases_store_options={"table_name": "t", "connect_args": {"password": SECRET}},
        broker_url="redis://h/0",
    )
    table = app.conf.table()
    assert SECRET not in json.dumps(table, default=str)
    assert table["leases_store"] == f"postgresql+psycopg://app:{MASK}@db/leases"
    assert table["leases_store_options"]["table_name"] == "t"
    assert SECRET not in app.conf.humanize()


def test_importing_the_library_installs_the_censor() -> None:
    import celery_leases  # noqa: F401

    assert getattr(utils.filter_hidden_settings, "celery_leases_wrapped", False)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param(
            f"foo://user:{SECRET}@h/0",
            id="unknown-scheme",
        ),
        pytest.param(f"redis://:{SECRET}@127.0.0.1:1/0?socket_timeout=abc", id="redis-bad-query"),
        pytest.param(f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/x", id="postgres-unreachable"),
    ],
)
def test_store_errors_hide_the_password(url: str) -> None:
    with pytest.raises(LeaseError) as caught:
        open_store(url).claim("job", "owner", 5.0)
    assert SECRET not in str(caught.value)
    assert SECRET not in repr(caught.value)
    assert "://" in str(caught.value)  # the store is still named


def test_store_option_errors_hide_the_password() -> None:
    with pytest.raises(LeaseError) as caught:
        open_store(f"redis://:{SECRET}@127.0.0.1:1/0", bogus=1)
    assert SECRET not in str(caught.value)
