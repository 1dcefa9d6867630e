"""The start check reads the VisibilityTimeout an SQS queue has, or will get.

Against a local SQS server: a queue given by URL in ``predefined_queues``,
and a queue kombu creates with ``sqs-creation-attributes``, which SQS then
uses in place of ``broker_transport_options['visibility_timeout']``.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_leases.broker_checks import countdown_cap, visibility_timeout
from celery_leases.broker_visibility import read_queue_visibility
from tests.broker_servers import SqsServer

#: the transport option; every queue in these tests has less
OPTION = 30


def _app(server: SqsServer, queue: str, **options: Any) -> Celery:
    app = Celery(f"queue-visibility-{queue}", set_as_current=False, broker=server.url)
    app.conf.task_default_queue = queue
    app.conf.broker_transport_options = {
        "region": "us-east-1",
        "is_secure": False,
        "visibility_timeout": OPTION,
        **options,
    }
    return app


def _queue_attribute(app: Celery, queue: str) -> float:
    """The VisibilityTimeout SQS has for ``queue`` (which must exist)."""
    with app.connection_for_read() as connection:
        client = connection.default_channel.sqs()
        url = client.get_queue_url(QueueName=queue)["QueueUrl"]
        reply = client.get_queue_attributes(QueueUrl=url, AttributeNames=["VisibilityTimeout"])
    return float(reply["Attributes"]["VisibilityTimeout"])


def test_a_predefined_queue_is_read_at_its_url(sqs_server: SqsServer, unique: str) -> None:
    queue = f"pre{unique}"
    setup = _app(sqs_server, queue)
    with setup.connection_for_read() as connection:
        url = (
            connection.default_channel.sqs()
            .create_queue(QueueName=queue, Attributes={"VisibilityTimeout": "2"})
            .get("QueueUrl")
        )
    app = _app(sqs_server, queue, predefined_queues={queue: {"url": url}})
    [warning] = read_queue_visibility(app)
    assert f"SQS queue {queue!r} has a VisibilityTimeout of 2 s" in warning
    assert (visibility_timeout(app), countdown_cap(app)) == (2.0, 1.0)


def test_a_queue_kombu_creates_with_its_own_visibility_timeout_counts_at_the_first_start(
    sqs_server: SqsServer, unique: str
) -> None:
    queue = f"new{unique}"
    app = _app(sqs_server, queue, **{"sqs-creation-attributes": {"VisibilityTimeout": "3"}})
    [warning] = read_queue_visibility(app)
    assert f"SQS queue {queue!r} does not exist yet" in warning
    assert "sqs-creation-attributes" in warning
    assert (visibility_timeout(app), countdown_cap(app)) == (3.0, 1.5)
    # what kombu then creates is what the check counted on
    with app.connection_for_read() as connection:
        connection.default_channel.queue_declare(queue)
    assert _queue_attribute(app, queue) == 3.0
    [warning] = read_queue_visibility(app)
    assert f"SQS queue {queue!r} has a VisibilityTimeout of 3 s" in warning
    assert visibility_timeout(app) == 3.0


@pytest.mark.parametrize("created", [None, str(OPTION * 2)])
def test_a_queue_kombu_creates_with_the_option_or_more_gives_nothing_to_warn_about(
    sqs_server: SqsServer, unique: str, created: str | None
) -> None:
    options = {} if created is None else {"sqs-creation-attributes": {"VisibilityTimeout": created}}
    app = _app(sqs_server, f"new{unique}", **options)
    assert read_queue_visibility(app) == []
    assert visibility_timeout(app) == OPTION
