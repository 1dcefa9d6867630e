"""The pytest plugin's fixtures, used as a library user would use them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from celery_leases import (
    Acquired,
    HeldElsewhere,
    LeaseConfigurationError,
    LeaseStore,
    Refusal,
    RenewRequest,
    StoreUnavailable,
)
from celery_leases.pytest_plugin import ENV_STORE, LeaseFaults
from celery_leases.stores.memory import ManualClock, MemoryStore


def test_lease_store_is_the_memory_store_on_the_manual_clock(
    lease_store: LeaseStore, lease_clock: ManualClock
) -> None:
    assert isinstance(lease_store, MemoryStore)
    claim = lease_store.claim("job", "owner-a", 10.0)
    assert isinstance(claim, Acquired)
    assert claim.store_now_ms == lease_clock.now_ms
    lease_clock.advance(9.0)
    assert isinstance(lease_store.claim("job", "owner-b", 10.0), HeldElsewhere)


def test_expire_lets_another_worker_claim_the_next_generation(
    lease_store: LeaseStore, lease_faults: LeaseFaults
) -> None:
    first = lease_store.claim("job", "owner-a", 60.0)
    assert isinstance(first, Acquired)
    lease_faults.expire(first)
    second = lease_store.claim("job", "owner-b", 60.0)
    assert isinstance(second, Acquired)
    # the store's clock moved past the lease: the generation follows it
    assert second.generation == max(first.generation + 1, second.store_now_ms)


def test_steal_makes_the_holder_stale(lease_store: LeaseStore, lease_faults: LeaseFaults) -> None:
    first = lease_store.claim("job", "owner-a", 60.0)
    assert isinstance(first, Acquired)
    stolen = lease_faults.steal("job")
    assert stolen.generation == max(first.generation + 1, stolen.store_now_ms)
    assert isinstance(lease_store.renew("job", "owner-a", first.generation, 60.0), Refusal)
    assert isinstance(lease_store.complete("job", "owner-a", first.generation), Refusal)


def test_store_down_fails_every_operation_until_the_block_ends(
    lease_store: LeaseStore, lease_faults: LeaseFaults
) -> None:
    held = lease_store.claim("held", "owner-a", 60.0)
    assert isinstance(held, Acquired)
    # the traceback of a failure shows which one reached the store
    every_operation: dict[str, Callable[[], object]] = {
        "claim": lambda: lease_store.claim("job", "owner-a", 10.0),
        "renew": lambda: lease_store.renew("held", "owner-a", held.generation, 10.0),
        "renew_many": lambda: lease_store.renew_many(
            [RenewRequest("held", "owner-a", held.generation, 10.0)]
        ),
        "complete": lambda: lease_store.complete("held", "owner-a", held.generation),
        "release": lambda: lease_store.release("held", "owner-a", held.generation),
        "force_release": lambda: lease_store.force_release("held", by="ops", reason="test"),
        "get": lambda: lease_store.get("held"),
        "records": lambda: list(lease_store.records()),
        "purge": lambda: lease_store.purge(60.0),
        "now_ms": lease_store.now_ms,
    }
    with lease_faults.store_down():
        for operation in every_operation.values():
            with pytest.raises(StoreUnavailable, match="store_down"):
                operation()
    # after the block every operation reaches the store again
    assert isinstance(lease_store.claim("job", "owner-a", 10.0), Acquired)
    assert lease_store.force_release("held", by="ops", reason="test").generation > held.generation


def test_store_down_covers_every_hook_a_store_implements() -> None:
    public = {
        name
        for name, value in vars(LeaseStore).items()
        if callable(value) and not name.startswith("_")
    }
    hooks = {name.lstrip("_") for name in LeaseStore.__abstractmethods__}
    # each public operation reaches the store through a hook of its own name,
    # so failing every hook fails them all
    assert public - hooks <= {"close"}


def test_a_store_url_from_the_environment_is_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setenv(ENV_STORE, f"sqlite:///{tmp_path / 'leases.db'}")
    store = request.getfixturevalue("lease_store")
    faults: LeaseFaults = request.getfixturevalue("lease_faults")
    assert not isinstance(store, MemoryStore)
    with pytest.raises(LeaseConfigurationError, match="steal"):
        faults.expire("job")


def test_steal_on_a_real_store_fences_out_a_holder_that_keeps_renewing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setenv(ENV_STORE, f"sqlite:///{tmp_path / 'leases.db'}")
    store = request.getfixturevalue("lease_store")
    faults: LeaseFaults = request.getfixturevalue("lease_faults")
    # an hour-long lease, renewed by its holder: waiting for it to run out
    # would never end
    first = store.claim("job", "owner-a", 3600.0)
    assert isinstance(first, Acquired)
    stop = threading.Event()
    refusals: list[object] = []

    def renew() -> None:
        while not stop.wait(0.05):
            answer = store.renew("job", "owner-a", first.generation, 3600.0)
            if isinstance(answer, Refusal):
                refusals.append(answer)
                return

    renewer = threading.Thread(target=renew)
    renewer.start()
    stolen: list[Acquired] = []
    stealer = threading.Thread(target=lambda: stolen.append(faults.steal("job")), daemon=True)
    try:
        stealer.start()
        stealer.join(timeout=30)
        assert stolen, "steal() waited for a lease that is renewed"
        renewer.join(timeout=10)  # it ends at its first refused renewal
    finally:
        stop.set()
        renewer.join(timeout=10)
    assert stolen[0].generation > first.generation
    assert refusals, "the holder's renewal was not refused"
    assert isinstance(store.complete("job", "owner-a", first.generation), Refusal)
    record = store.get("job")
    assert record is not None
    assert record.owner == stolen[0].owner


@pytest.fixture
def db() -> str:
    """A fixture of one's own that happens to share pytest-django's name."""
    return "mine"


def test_leases_worker_takes_a_db_fixture_of_ones_own_without_pytest_django(
    request: pytest.FixtureRequest, db: str
) -> None:
    from celery_leases.pytest_plugin import _in_django_test_transaction

    assert not _in_django_test_transaction(request)
