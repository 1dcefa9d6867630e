"""The start check and the deferral cap for RabbitMQ's consumer timeout and the
visibility timeout of Redis and SQS."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from kombu import Queue

from celery_leases import LeaseConfigurationError, LeasedTask
from celery_leases.broker_checks import (
    DEFAULT_CONSUMER_TIMEOUT,
    consumer_timeout,
    countdown_cap,
)
from celery_leases.task import forget_runtime
from celery_leases.worker import check_app
from tests.leases import drop_foreign_tasks


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("brokers", broker="amqp://guest:guest@127.0.0.1:1//", set_as_current=False)
    app.conf.leases_store = "memory://"
    yield app
    forget_runtime(app)
    app.close()


def _leased(app: Celery, **options: object) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True, name="job", **options)
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    drop_foreign_tasks(app, "job")


def _consumer_warnings(app: Celery) -> list[str]:
    return [w for w in check_app(app, pool="prefork") if "consumer_timeout" in w]


def test_rabbitmq_without_a_setting_assumes_its_default_timeout(app: Celery) -> None:
    assert consumer_timeout(app) == DEFAULT_CONSUMER_TIMEOUT
    assert countdown_cap(app) == DEFAULT_CONSUMER_TIMEOUT / 2


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "sqs://", "memory://"])
def test_other_brokers_have_no_consumer_timeout(app: Celery, url: str) -> None:
    app.conf.broker_url = url
    app.conf.leases_broker_consumer_timeout = 5
    assert consumer_timeout(app) is None


def test_redis_and_sqs_cap_countdowns_at_half_the_visibility_timeout(app: Celery) -> None:
    # a copy held past it would be handed out again, and each delivery defers one
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    assert countdown_cap(app) == 1800.0  # kombu's default one hour
    app.conf.broker_transport_options = {"visibility_timeout": 6}
    assert countdown_cap(app) == 3.0
    app.conf.broker_url = "sqs://"
    assert countdown_cap(app) == 3.0
    app.conf.broker_url = "memory://"
    assert countdown_cap(app) is None


def test_the_setting_gives_the_timeout_and_zero_turns_it_off(app: Celery) -> None:
    app.conf.leases_broker_consumer_timeout = 8
    assert consumer_timeout(app) == 8.0
    assert countdown_cap(app) == 4.0
    app.conf.leases_broker_consumer_timeout = 0
    assert consumer_timeout(app) is None
    assert countdown_cap(app) is None


def test_a_queue_argument_gives_the_timeout(app: Celery) -> None:
    app.conf.task_queues = [
        Queue("slow", queue_arguments={"x-consumer-timeout": 600_000}),
        Queue("fast", queue_arguments={"x-consumer-timeout": 20_000}),
        Queue("plain"),
    ]
    assert consumer_timeout(app) == 20.0


@pytest.mark.parametrize("value", [-1, "soon", True, float("nan")])
def test_a_bad_setting_stops_the_worker(app: Celery, value: object) -> None:
    app.conf.leases_broker_consumer_timeout = value
    _leased(app)
    with pytest.raises(LeaseConfigurationError, match="leases_broker_consumer_timeout"):
        check_app(app, pool="prefork")


def test_a_ttl_or_defer_max_reaching_the_timeout_is_reported(app: Celery) -> None:
    app.conf.leases_broker_consumer_timeout = 30
    app.conf.leases_ttl = 10
    _leased(app, lease_defer_max=45.0)
    (warning,) = _consumer_warnings(app)
    assert "task 'job'" in warning
    assert "leases_defer_max (45 s)" in warning
    assert "held at most 15 s each" in warning


def test_a_time_limit_reaching_the_timeout_is_reported(app: Celery) -> None:
    app.conf.leases_ttl = 10
    app.conf.leases_defer_max = 20
    _leased(app, time_limit=3600)
    (warning,) = _consumer_warnings(app)
    assert "may run for 3600 s (time_limit)" in warning
    assert "the RabbitMQ consumer_timeout the worker assumes is 1800 s" in warning


def test_settings_below_the_timeout_give_no_warning(app: Celery) -> None:
    app.conf.leases_broker_consumer_timeout = 30
    app.conf.leases_ttl = 10
    app.conf.leases_defer_max = 14
    _leased(app, time_limit=25)
    assert _consumer_warnings(app) == []
