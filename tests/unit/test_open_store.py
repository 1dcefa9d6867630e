"""``open_store``: which store a URL opens, and the errors for bad URLs."""

from __future__ import annotations

import sys

import pytest

from celery_leases import LeaseConfigurationError, LeaseError, open_store
from celery_leases.stores.memory import ManualClock, MemoryStore


def test_memory_url_opens_a_memory_store() -> None:
    store = open_store("memory://")
    assert isinstance(store, MemoryStore)
    assert store.url == "memory://"


def test_memory_url_passes_options_to_the_store() -> None:
    clock = ManualClock(start_ms=5_000_000)
    store = open_store("memory://", clock=clock)
    assert store.now_ms() == 5_000_000


def test_scheme_is_case_insensitive() -> None:
    assert isinstance(open_store("MEMORY://"), MemoryStore)


@pytest.mark.parametrize(
    "url", ["oracle://localhost/db", "http://localhost:6379", "mongodb://x", "://nothing"]
)
def test_unknown_scheme_is_a_configuration_error(url: str) -> None:
    with pytest.raises(LeaseConfigurationError, match="unknown lease store scheme") as info:
        open_store(url)
    assert "redis://" in str(info.value)


@pytest.mark.parametrize("url", ["", "localhost:6379", "redis", "/tmp/leases.db", None, 6379])
def test_not_a_url_is_a_configuration_error(url: object) -> None:
    with pytest.raises(LeaseConfigurationError, match="is not a URL"):
        open_store(url)  # type: ignore[arg-type]


def test_url_errors_are_lease_errors() -> None:
    with pytest.raises(LeaseError):
        open_store("nope")


def test_an_option_the_store_does_not_take_is_a_configuration_error() -> None:
    with pytest.raises(LeaseConfigurationError, match="leases_store_options"):
        open_store("memory://", prefix="leases:")


@pytest.mark.parametrize(
    "url",
    [
        "oracle://admin:Pa55-secret@localhost/db",
        "admin:Pa55-secret@localhost:6379",
        "postgresql://admin:Pa55-secret@host:notaport/db",
        "redis://localhost:99999999/0?password=Pa55-secret",
    ],
)
def test_url_errors_never_show_the_password(url: str) -> None:
    with pytest.raises(LeaseConfigurationError) as info:
        open_store(url)
    assert "Pa55-secret" not in str(info.value)
    assert "***" in str(info.value)


def test_a_registered_scheme_opens_with_its_opener(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_leases import stores
    from celery_leases.stores import register_scheme, scheme_is_known

    monkeypatch.setattr(stores, "_REGISTERED", {})
    opened: list[tuple[str, dict[str, object]]] = []

    def opener(url: str, **options: object) -> MemoryStore:
        opened.append((url, options))
        return MemoryStore()

    assert not scheme_is_known("plugged://x")
    register_scheme("plugged", opener)
    assert scheme_is_known("PLUGGED://x")
    assert isinstance(open_store("plugged://x", table_name="t"), MemoryStore)
    assert opened == [("plugged://x", {"table_name": "t"})]


@pytest.mark.parametrize("scheme", ["redis", "sqlite", "memory", "not a name"])
def test_a_builtin_scheme_cannot_be_registered(scheme: str) -> None:
    from celery_leases.stores import register_scheme

    with pytest.raises(LeaseConfigurationError, match="cannot register"):
        register_scheme(scheme, MemoryStore)


def test_a_django_url_without_the_django_app_says_what_to_add() -> None:
    with pytest.raises(LeaseConfigurationError, match=r"celery_leases\.contrib\.django"):
        open_store("django://default")


def test_a_missing_mysql_driver_names_the_mysql_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sqlalchemy")
    monkeypatch.setitem(sys.modules, "pymysql", None)  # import pymysql now fails
    with pytest.raises(LeaseConfigurationError, match=r"celery-leases\[mysql\]") as info:
        open_store("mysql+pymysql://app:Pa55-secret@localhost/db")
    assert "Pa55-secret" not in str(info.value)
