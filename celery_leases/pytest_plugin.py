"""pytest fixtures for testing your own leased tasks, with no server and no Docker.

Installed with the package (entry point ``pytest11``) and inert until a test
asks for one of its fixtures:

``lease_store_url``
    ``memory://`` unless ``--leases-store URL`` or the environment variable
    ``CELERY_LEASES_TEST_STORE`` names a real store.
``lease_clock``
    a :class:`~celery_leases.stores.memory.ManualClock`: the memory store's
    time moves only when the test says so.
``leases_config``
    a dict of Celery settings for ``leases_app``; override it like
    ``celery_config`` of ``celery.contrib.pytest``.
``leases_app``
    a fresh Celery app on the in-memory broker and result backend; override
    it to return your own app (configured the same way).
``lease_store``
    the store the app's leased tasks use in this process (the same object).
``lease_faults``
    a :class:`LeaseFaults`: ``expire()``, ``steal()``, ``lose()`` and
    ``store_down()`` make a run-out lease, a stale holder, a lost lease and a
    store outage happen inside the test.
``leases_worker``
    a Celery worker in a thread of the test process
    (:func:`celery.contrib.testing.worker.start_worker`), started on
    ``leases_app`` and stopped after the test.

Under pytest-django, a test with ``leases_worker`` needs
``@pytest.mark.django_db(transaction=True)`` (or ``transactional_db``): a
plain ``django_db`` test runs inside one open transaction, which the
worker's own database connections can neither see into nor write past
(SQLite answers "database table is locked"). The fixture says so at once.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from celery_leases.errors import LeaseConfigurationError, StoreUnavailable
from celery_leases.lease import Lease
from celery_leases.runtime import forget_runtime, stop, store_for
from celery_leases.stores.base import Acquired, LeaseStore
from celery_leases.stores.memory import ManualClock, MemoryStore

__all__ = ["ENV_STORE", "LeaseFaults"]

#: environment variable that names the store for ``lease_store_url``
ENV_STORE = "CELERY_LEASES_TEST_STORE"

#: the store operations that ``store_down()`` makes fail: every hook a store
#: implements (the abstract methods of :class:`LeaseStore`), so a hook added
#: to the base class is failed too
_STORE_HOOKS = tuple(sorted(LeaseStore.__abstractmethods__))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-leases")
    group.addoption(
        "--leases-store",
        dest="leases_store",
        default=None,
        metavar="URL",
        help=f"lease store URL for the lease_store fixture (default: ${ENV_STORE} or memory://)",
    )


def _is_lost(lease: Lease) -> bool:
    return lease.lost


class LeaseFaults:
    """Faults a test can inject around a leased task.

    Args:
        store: the store the task uses.
        clock: the memory store's clock, if it has one.
    """

    def __init__(self, store: LeaseStore, clock: ManualClock | None = None) -> None:
        self.store = store
        self.clock = clock

    def _job_id(self, lease: Lease | Acquired | str) -> str:
        return lease if isinstance(lease, str) else lease.job_id

    def expire(self, lease: Lease | Acquired | str) -> None:
        """Let the lease on a job run out now, by the store's clock.

        Moves the memory store's clock to the lease's end, where it has run
        out. Nobody else holds the job yet, so its holder may still renew;
        :meth:`steal` is what makes it stale.

        Raises:
            LeaseConfigurationError: the store has no controllable clock.
        """
        if self.clock is None:
            raise LeaseConfigurationError(
                "expire() moves the memory store's clock; this store's clock is real: "
                "use steal(), which takes the lease away at once"
            )
        record = self.store.get(self._job_id(lease))
        if record is not None and record.is_live(self.clock.now_ms):
            # a lease has run out at lease_until exactly
            self.clock.now_ms = record.lease_until_ms

    def steal(self, lease: Lease | Acquired | str, *, ttl: float = 60.0) -> Acquired:
        """Claim the job as another worker would once the lease ran out.

        The present holder becomes stale: its renewals, its completion and
        its fenced writes are refused. The returned claim is a fencing
        token of the newer generation (pass it to fenced writes to act as
        the newer holder).

        On the memory store the clock moves past the lease's end (a
        takeover, as in production). On a real store, whose clock cannot be
        moved, the lease is taken away at once as an operator would
        (:meth:`~celery_leases.stores.base.LeaseStore.force_release`), so the
        test never waits out the app's ttl.

        Args:
            lease: the lease, a claim, or a job id.
            ttl: the stolen lease's TTL in seconds.

        Raises:
            LeaseConfigurationError: the job is completed, or has no record.
        """
        job_id = self._job_id(lease)
        owner = f"pytest-steal:{secrets.token_hex(8)}"
        if self.clock is not None:
            self.expire(job_id)
        else:
            self.store.force_release(job_id, by=owner, reason="steal() in a test")
        result = self.store.claim(job_id, owner, ttl, task_name="pytest-steal")
        if not isinstance(result, Acquired):
            raise LeaseConfigurationError(f"cannot steal job {job_id!r}: {result!r}")
        return result

    def lose(self, lease: Lease, *, timeout: float = 10.0) -> Acquired:
        """Make ``lease`` lost now: :meth:`steal` it, then let its holder see it.

        The holder's process learns it at its next renewal; this renews at
        once, so ``lease.lost`` is true and ``lease.check()`` raises when
        this returns.

        Raises:
            TimeoutError: the lease was not seen lost within ``timeout``.
        """
        stolen = self.steal(lease)
        # what the heartbeat does at its next tick, done now: the renewal is
        # refused (a newer generation holds the job) and the lease marks it
        refusal = self.store.renew(lease.job_id, lease.owner, lease.generation, 1.0)
        lease.apply_renewal(time.monotonic(), refusal)
        deadline = time.monotonic() + timeout
        while not _is_lost(lease):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the lease on job {lease.job_id!r} was not seen lost")
            time.sleep(0.02)
        return stolen

    @contextlib.contextmanager
    def store_down(self) -> Iterator[None]:
        """Inside the block, every store operation raises ``StoreUnavailable``.

        As a driver failure would: claims defer the message, renewals fail
        until the holder's deadline passes, completions are retried.
        """
        saved: dict[str, Any] = {}

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable(
                f"the lease store {self.store.url or type(self.store).__name__} is down "
                "(store_down() in a test)"
            ) from ConnectionError("store_down()")

        for name in _STORE_HOOKS:
            if name in vars(self.store):
                saved[name] = vars(self.store)[name]
            setattr(self.store, name, unavailable)
        try:
            yield
        finally:
            for name in _STORE_HOOKS:
                if name in saved:
                    setattr(self.store, name, saved[name])
                else:
                    delattr(self.store, name)


@pytest.fixture
def lease_store_url(request: pytest.FixtureRequest) -> str:
    """The store URL the tests use: the option, the variable, else ``memory://``."""
    option = request.config.getoption("leases_store", default=None)
    return str(option or os.environ.get(ENV_STORE) or "memory://")


@pytest.fixture
def lease_clock() -> ManualClock:
    """The memory store's clock; ``lease_clock.advance(seconds)`` moves it."""
    return ManualClock(start_ms=time.time_ns() // 1_000_000)


@pytest.fixture
def leases_config() -> Mapping[str, Any]:
    """Celery settings for ``leases_app``; override to change them."""
    return {}


@pytest.fixture
def leases_app(leases_config: Mapping[str, Any]) -> Any:
    """A fresh app on the in-memory broker and result backend."""
    from celery import Celery

    app = Celery("celery-leases-tests", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        broker_connection_retry_on_startup=True,
        **leases_config,
    )
    return app


@pytest.fixture
def lease_store(
    leases_app: Any, lease_store_url: str, lease_clock: ManualClock
) -> Iterator[LeaseStore]:
    """Point ``leases_app`` at the test store; yield the store its tasks use."""
    conf = leases_app.conf
    saved = {key: conf.get(key) for key in ("leases_store", "leases_store_options")}
    options = dict(conf.get("leases_store_options") or {})
    if lease_store_url.startswith("memory://"):
        options = {"clock": lease_clock}
    conf.leases_store = lease_store_url
    conf.leases_store_options = options
    forget_runtime(leases_app)
    try:
        yield store_for(leases_app)
    finally:
        forget_runtime(leases_app)
        for key, value in saved.items():
            conf[key] = value


@pytest.fixture
def lease_faults(lease_store: LeaseStore, lease_clock: ManualClock) -> LeaseFaults:
    """Inject a run-out lease, a stale holder, a lost lease or a store outage."""
    clock = lease_clock if isinstance(lease_store, MemoryStore) else None
    return LeaseFaults(lease_store, clock)


@pytest.fixture
def leases_worker_parameters() -> Mapping[str, Any]:
    """Keyword arguments for ``start_worker``; override to change the pool."""
    return {"pool": "solo", "concurrency": 1}


def _in_django_test_transaction(request: pytest.FixtureRequest) -> bool:
    """Whether pytest-django runs this test inside a transaction it rolls back."""
    if not request.config.pluginmanager.hasplugin("django"):
        return False  # a fixture of one's own may be called "db"
    names = set(request.fixturenames)
    if names & {"transactional_db", "live_server"}:
        return False
    marker = request.node.get_closest_marker("django_db")
    if marker is None:
        return "db" in names
    transaction = marker.kwargs.get("transaction", marker.args[0] if marker.args else False)
    return not transaction


@pytest.fixture
def leases_worker(
    request: pytest.FixtureRequest,
    leases_app: Any,
    lease_store: LeaseStore,
    leases_worker_parameters: Mapping[str, Any],
) -> Iterator[Any]:
    """A worker consuming ``leases_app``'s default queue in a thread of this process."""
    from celery.contrib.testing.worker import start_worker

    if _in_django_test_transaction(request):
        pytest.fail(
            "leases_worker runs tasks on their own database connections, which cannot see "
            "or write past the transaction pytest-django wraps this test in; use "
            "@pytest.mark.django_db(transaction=True) (or the transactional_db fixture)",
            pytrace=False,
        )

    parameters = {"perform_ping_check": False, "shutdown_timeout": 30.0}
    parameters.update(leases_worker_parameters)
    try:
        with start_worker(leases_app, **parameters) as worker:
            yield worker
    finally:
        stop()
