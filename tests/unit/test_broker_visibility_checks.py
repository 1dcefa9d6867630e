"""Start checks and message parsing of ``leases_broker_keep_invisible``."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_leases import LeaseConfigurationError, LeasedTask
from celery_leases.broker_checks import (
    countdown_cap,
    note_queue_visibility,
    visibility_source,
    visibility_timeout,
)
from celery_leases.broker_visibility import Delivery, delivery_of
from celery_leases.spelling import misspelled_settings
from celery_leases.task import forget_runtime
from celery_leases.worker import check_app
from tests.leases import drop_foreign_tasks
from tests.servers import free_port


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("visibility-checks", set_as_current=False)
    app.conf.leases_store = "memory://"
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    yield app
    forget_runtime(app)
    app.close()


def _leased(app: Celery, **options: Any) -> None:
    @app.task(shared=False, base=LeasedTask, bind=True, name="job", **options)
    def job(self: LeasedTask) -> None:
        pass

    app.finalize()
    drop_foreign_tasks(app, "job")


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_a_setting_that_is_not_a_boolean_stops_the_worker(app: Celery, value: object) -> None:
    app.conf.leases_broker_keep_invisible = value
    _leased(app)
    with pytest.raises(LeaseConfigurationError, match="leases_broker_keep_invisible must be"):
        check_app(app, pool="prefork")


def test_a_task_that_renews_less_than_twice_per_visibility_timeout_stops_the_worker(
    app: Celery,
) -> None:
    app.conf.leases_broker_keep_invisible = True
    app.conf.broker_transport_options = {"visibility_timeout": 20}
    _leased(app, lease_ttl=30)  # renewed every 10 s
    with pytest.raises(LeaseConfigurationError, match=r"task 'job' renews its lease every 10 s"):
        check_app(app, pool="prefork")


def test_with_the_setting_a_run_may_outlast_the_visibility_timeout(app: Celery) -> None:
    app.conf.broker_transport_options = {"visibility_timeout": 60}
    _leased(app, lease_ttl=75, time_limit=7200)  # renewed every 25 s
    without = [w for w in check_app(app, pool="prefork") if "visibility_timeout" in w]
    assert len(without) == 2  # the ttl and the time limit
    assert all("leases_broker_keep_invisible" in w for w in without)
    app.conf.leases_broker_keep_invisible = True
    forget_runtime(app)
    assert [w for w in check_app(app, pool="prefork") if "visibility" in w] == []


def test_the_setting_has_no_effect_on_rabbitmq_and_says_so(app: Celery) -> None:
    app.conf.broker_url = "amqp://guest@127.0.0.1:1//"
    app.conf.leases_broker_keep_invisible = True
    _leased(app)
    warnings = check_app(app, pool="prefork")
    assert any("leases_broker_keep_invisible is set but" in w for w in warnings)


def test_the_setting_is_a_known_name(app: Celery) -> None:
    app.conf.leases_broker_keep_invisible = True
    app.conf.leases_broker_keep_invisble = True
    (warning,) = misspelled_settings(app.conf)
    assert "'leases_broker_keep_invisble'" in warning
    assert "did you mean 'leases_broker_keep_invisible'" in warning


def test_visibility_timeouts_default_to_kombus_own(app: Celery) -> None:
    assert visibility_timeout(app) == 3600
    app.conf.broker_url = "sqs://"
    assert visibility_timeout(app) == 1800
    app.conf.broker_transport_options = {"visibility_timeout": 7}
    assert visibility_timeout(app) == 7
    app.conf.broker_url = "amqp://"
    assert visibility_timeout(app) is None


def test_an_sqs_queue_below_the_option_gives_the_visibility_timeout(app: Celery) -> None:
    app.conf.broker_url = "sqs://"
    app.conf.broker_transport_options = {"visibility_timeout": 30}
    note_queue_visibility(app, {"slow": 20.0, "fast": 2.0})
    assert visibility_timeout(app) == 2.0
    assert countdown_cap(app) == 1.0
    assert visibility_source(app) == "the VisibilityTimeout attribute of SQS queue 'fast'"
    # what is noted replaces what was noted before
    note_queue_visibility(app, {})
    assert visibility_timeout(app) == 30.0
    assert visibility_source(app) == "broker_transport_options['visibility_timeout']"


def test_an_sqs_broker_that_cannot_be_read_at_start_gives_a_warning(app: Celery) -> None:
    pytest.importorskip("boto3")
    app.conf.broker_url = f"sqs://key:secret@127.0.0.1:{free_port()}"  # nothing listens
    app.conf.broker_transport_options = {
        "region": "us-east-1",
        "is_secure": False,
        "visibility_timeout": 30,
    }
    _leased(app, lease_ttl=3)
    warnings = check_app(app, pool="prefork")
    assert any(
        w.startswith("could not read the VisibilityTimeout of the SQS queues")
        and "assume broker_transport_options['visibility_timeout'] (30 s)" in w
        for w in warnings
    )
    assert visibility_timeout(app) == 30.0


def test_a_delivery_is_read_from_the_message_properties() -> None:
    redis_request = SimpleNamespace(properties={"delivery_tag": "t1", "delivery_info": {}})
    assert delivery_of(redis_request, "redis") == Delivery("t1")
    sqs_properties = {"delivery_tag": "handle", "delivery_info": {"sqs_queue": "http://q/1"}}
    assert delivery_of(SimpleNamespace(properties=sqs_properties), "sqs") == Delivery(
        "handle", "http://q/1"
    )
    # an eager or direct call has no message; an SQS message needs its queue
    assert delivery_of(SimpleNamespace(properties=None), "redis") is None
    assert delivery_of(SimpleNamespace(), "redis") is None
    assert delivery_of(redis_request, "sqs") is None
