"""Checks run when a worker starts: the store is opened once, early."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from celery_leases import LeaseConfigurationError, LeasedTask, LeaseSettings
from celery_leases.redact import mask, secrets_of
from celery_leases.worker import check_app, check_store


def _leased(app: Celery) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()


def test_bad_store_options_stop_the_worker_at_start(app: Celery) -> None:
    app.conf.leases_store = "memory://"
    app.conf.leases_store_options = {"prefix": "x:"}
    _leased(app)
    with pytest.raises(LeaseConfigurationError, match="leases_store_options"):
        check_app(app, pool="prefork")


def test_a_store_in_a_missing_folder_stops_the_worker_at_start(app: Celery, tmp_path: Path) -> None:
    app.conf.leases_store = f"sqlite:///{tmp_path / 'missing' / 'leases.db'}"
    _leased(app)
    with pytest.raises(LeaseConfigurationError, match="does not exist"):
        check_app(app, pool="prefork")


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:1/0", "postgresql+psycopg://postgres@127.0.0.1:1/leases"],
    ids=["redis", "postgres"],
)
def test_an_unreachable_store_does_not_stop_the_worker(app: Celery, url: str) -> None:
    # nothing listens on port 1: claims defer until the store is back. The
    # Redis store does not connect on open: the check asks it the time
    app.conf.leases_store = url
    _leased(app)
    warnings = check_app(app, pool="prefork")
    assert any("cannot be reached now" in w and "deferred until it can" in w for w in warnings)


def test_a_store_password_is_not_shown_in_the_warning(app: Celery) -> None:
    app.conf.leases_store = "redis://:pw-in-the-url-93@127.0.0.1:1/0"
    _leased(app)
    warnings = check_app(app, pool="prefork")
    assert any("cannot be reached now" in w for w in warnings)
    assert not any("pw-in-the-url-93" in w for w in warnings)


def test_secrets_are_taken_from_the_url_and_password_like_options() -> None:
    settings = LeaseSettings(
        store_url="postgresql+psycopg://user:p%40ss-word@db/leases",
        store_options={"connect_args": {"password": "opt-secret"}, "prefix": "leases:"},
    )
    secrets = secrets_of(settings.store_url, settings.store_options)
    assert set(secrets) == {"p%40ss-word", "p@ss-word", "opt-secret"}
    text = "login with p@ss-word or opt-secret failed for leases:"
    assert mask(text, secrets=secrets) == "login with *** or *** failed for leases:"


def test_a_memory_store_answers_the_start_check() -> None:
    assert check_store(LeaseSettings(store_url="memory://")) is None


def test_a_time_limit_past_the_visibility_timeout_is_reported(app: Celery) -> None:
    app.conf.leases_store = "memory://"
    app.conf.leases_ttl = 30
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    app.conf.broker_transport_options = {"visibility_timeout": 3600}

    @app.task(shared=False, base=LeasedTask, bind=True, time_limit=7200)
    def long_job(self: LeasedTask) -> None:
        pass

    @app.task(shared=False, base=LeasedTask, bind=True, time_limit=600)
    def short_job(self: LeasedTask) -> None:
        pass

    app.finalize()
    reported = [w for w in check_app(app, pool="prefork") if "time_limit" in w]
    assert len(reported) == 1
    assert "long_job" in reported[0]
    assert "7200 s" in reported[0]


@pytest.mark.parametrize("value", [0, "60", float("nan"), float("inf"), -1, 86401, True])
def test_a_task_with_a_bad_defer_max_stops_the_worker(app: Celery, value: object) -> None:
    app.conf.leases_store = "memory://"

    @app.task(shared=False, base=LeasedTask, bind=True, lease_defer_max=value)
    def deferring(self: LeasedTask) -> None:
        pass

    app.finalize()
    with pytest.raises(LeaseConfigurationError, match=r"deferring\.lease_defer_max must be"):
        check_app(app, pool="prefork")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lease_key": "k", "lease_queue_unique": 0}, r"queued\.lease_queue_unique must be"),
        ({"lease_key": "k", "lease_queue_unique": "yes"}, r"queued\.lease_queue_unique must be"),
        ({"lease_key": "k", "lease_queue_unique": 86401}, r"queued\.lease_queue_unique must be"),
        ({"lease_queue_unique": True}, "sets lease_queue_unique but no lease_key"),
    ],
)
def test_a_bad_lease_queue_unique_set_after_the_definition_stops_the_worker(
    app: Celery, options: dict[str, object], message: str
) -> None:
    # the decorator refuses these already (tests/unit/test_queue_unique_definition.py)
    app.conf.leases_store = "memory://"

    @app.task(shared=False, base=LeasedTask, bind=True)
    def queued(self: LeasedTask) -> None:
        pass

    app.finalize()
    for name, value in options.items():
        setattr(type(app.tasks[queued.name]), name, value)
    with pytest.raises(LeaseConfigurationError, match=message):
        check_app(app, pool="prefork")


def test_a_task_with_a_good_lease_queue_unique_starts(app: Celery) -> None:
    app.conf.leases_store = "memory://"

    @app.task(shared=False, base=LeasedTask, bind=True, lease_key="k", lease_queue_unique=600)
    def queued(self: LeasedTask) -> None:
        pass

    app.finalize()
    assert not [w for w in check_app(app, pool="prefork") if "queue" in w]


def test_a_task_with_a_good_defer_max_starts(app: Celery) -> None:
    app.conf.leases_store = "memory://"

    @app.task(shared=False, base=LeasedTask, bind=True, lease_defer_max=86400)
    def deferring(self: LeasedTask) -> None:
        pass

    app.finalize()
    assert check_app(app, pool="prefork") == []


@pytest.mark.parametrize("ttl", [1e11, 1e16, float("nan"), 0])
def test_a_task_with_a_bad_ttl_stops_the_worker_naming_the_task(app: Celery, ttl: float) -> None:
    app.conf.leases_store = "memory://"

    @app.task(shared=False, base=LeasedTask, bind=True, lease_ttl=ttl)
    def timed(self: LeasedTask) -> None:
        pass

    app.finalize()
    with pytest.raises(LeaseConfigurationError, match=r"task '.*timed'.*lease_ttl\) must be"):
        check_app(app, pool="prefork")


def test_store_options_that_are_not_a_dict_stop_the_worker(app: Celery) -> None:
    app.conf.leases_store = "memory://"
    app.conf.leases_store_options = "x"
    _leased(app)
    with pytest.raises(LeaseConfigurationError, match="leases_store_options must be a dict"):
        check_app(app, pool="prefork")


def test_the_solo_pool_signal_in_the_worker_process_is_not_a_prefork_child() -> None:
    from celery.signals import worker_process_init

    from celery_leases.worker import in_prefork_child

    worker_process_init.send(sender="solo@host")  # what the solo pool sends, in-process
    assert not in_prefork_child()  # lease_on_lost="stop" must not kill the whole worker
