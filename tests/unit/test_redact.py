"""The one masker: passwords in URLs, text and options, and Celery's settings views."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.app import utils

from celery_leases import LeaseError, open_store
from celery_leases.censor import CELERY_MASK, install_settings_filter
from celery_leases.redact import MASK, mask, mask_settings, secrets_of

SECRET = "s3cret-Pw"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (f"redis://:{SECRET}@h:6379/0", f"redis://:{MASK}@h:6379/0"),
        (f"rediss://user:{SECRET}@h/1?ssl=1", f"rediss://user:{MASK}@h/1?ssl=1"),
        (f"redis://h/0?password={SECRET}&db=1", f"redis://h/0?password={MASK}&db=1"),
        ("unix:///run/redis.sock?db=2&password=pw", f"unix:///run/redis.sock?db=2&password={MASK}"),
        (
            f"postgresql+psycopg://app:{SECRET}@db:5432/leases",
            f"postgresql+psycopg://app:{MASK}@db:5432/leases",
        ),
        ("postgresql+psycopg://app:p%40ss@db/leases", f"postgresql+psycopg://app:{MASK}@db/leases"),
        (
            "postgresql://app@db/leases?sslpassword=k3y",
            f"postgresql://app@db/leases?sslpassword={MASK}",
        ),
        (
            f"sentinel://h1:26379;sentinel://:{SECRET}@h2:26379/0",
            f"sentinel://h1:26379;sentinel://:{MASK}@h2:26379/0",
        ),
        (
            f"sentinel://:{SECRET}@h1:26379;sentinel://:{SECRET}@h2:26379/0",
            f"sentinel://:{MASK}@h1:26379;sentinel://:{MASK}@h2:26379/0",
        ),
        # a raw @, / or # in the password: the whole of it goes, not the part a parser reads
        ("redis://user:p@ss/w#rd@h:6379/0", f"redis://user:{MASK}@h:6379/0"),
        # a port that does not parse: the URL is still masked
        (f"redis://:{SECRET}@h:port/0", f"redis://:{MASK}@h:port/0"),
    ],
)
def test_mask_hides_the_password_of_a_url(url: str, masked: str) -> None:
    assert mask(url) == masked


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////var/lib/leases.db",
        "memory://",
        "redis://user@h/0",
        "redis://h:6379/0",
        "postgresql+psycopg://postgres@127.0.0.1:5432/db",
        "not a url",
    ],
)
def test_mask_leaves_urls_without_a_password_alone(url: str) -> None:
    assert mask(url) == url


def test_mask_finds_urls_inside_text_and_the_given_secrets_in_every_form() -> None:
    text = (
        f"cannot open 'redis://:{SECRET}@h:1/0': Error connecting; "
        "login as app with p@ss-w0rd (p%40ss-w0rd) failed"
    )
    masked = mask(text, secrets=["p%40ss-w0rd"])
    assert masked == (
        f"cannot open 'redis://:{MASK}@h:1/0': Error connecting; "
        f"login as app with {MASK} ({MASK}) failed"
    )


def test_secrets_of_reads_the_url_its_query_and_secret_options() -> None:
    found = secrets_of(
        "sentinel://:one-pw@h1;sentinel://h2/0?password=two-pw",
        {"sentinel_kwargs": {"password": "three-pw"}, "prefix": "leases:", "token": "four-pw"},
    )
    assert set(found) == {"one-pw", "two-pw", "three-pw", "four-pw"}
    # a one- or two-letter secret would blank out ordinary words
    assert secrets_of("redis://:pw@h/0") == []


def test_mask_settings_goes_through_mappings_and_lists() -> None:
    options = {
        "prefix": "x:",
        "sentinels": [f"redis://:{SECRET}@s1/0"],
        "nested": {"url": f"redis://:{SECRET}@h", "password": SECRET, "api_token": 12345},
    }
    masked = mask_settings(options)
    assert SECRET not in json.dumps(masked)
    assert "12345" not in json.dumps(masked)
    assert masked["prefix"] == "x:"
    assert masked["nested"]["password"] == MASK


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
    assert table["leases_store"] == f"postgresql+psycopg://app:{CELERY_MASK}@db/leases"
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
