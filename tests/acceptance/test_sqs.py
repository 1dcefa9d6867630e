"""SQS through a local server (moto): real workers on kombu's SQS transport.

Timeline (visibility timeout 3 s, TTL 2 s, body 8 s)::

    A receives the job, claims generation g and runs the body
    t~3     SQS hands the unacknowledged message to B: B finds the lease
            held and defers the copy (it does not run the body)
    A is killed with SIGKILL; its message comes back after the visibility
            timeout, its lease runs out after the TTL
    one copy claims g+1 (a takeover) and runs the body once; no copy of
            the same message runs it again
"""

from __future__ import annotations

import re

import pytest
from celery.result import AsyncResult

from celery_leases import LeaseState
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import wait_until


@pytest.mark.parametrize("broker_kind", ["sqs"], indirect=True)
def test_visibility_duplicates_are_deferred_and_a_killed_holders_job_runs_once(
    cluster: Cluster,
) -> None:
    cluster.configure(ttl=2.0, visibility_timeout=3.0)
    workers = [cluster.worker("a"), cluster.worker("b")]
    # the queue is new: kombu creates it with the option, and the start check
    # finds nothing to warn about (nor fails to read it)
    assert not any("VisibilityTimeout" in worker.log() for worker in workers)
    result = cluster.send(STEPS, 8.0)
    (started_a,) = cluster.side.wait_event(result.id, "start", timeout=30)
    worker_a, worker_b = sorted(
        workers, key=lambda w: not started_a["worker"].startswith(f"{w.name}@")
    )
    deferred = rf"lease deferred: job={re.escape(result.id)} .*reason=held"
    wait_until(
        lambda: re.search(deferred, worker_b.log()),
        timeout=20,
        message="B to defer the message SQS delivered again",
    )
    assert cluster.side.events(result.id, "start") == [started_a], "B ran a held job"

    worker_a.kill()
    record = cluster.wait_record(
        result.id, state=LeaseState.COMPLETED, timeout=60, message="the job to run again"
    )
    assert record.takeovers == 1
    assert record.generation > started_a["generation"]
    value = AsyncResult(result.id, app=cluster.new_app()).get(timeout=20)
    assert value["generation"] == record.generation
    assert value["worker"].startswith(f"{worker_b.name}@")
    # B's acknowledgement of the copy it deferred deleted the message on
    # SQS; whatever copy is left is skipped: none runs the body again. Once
    # the queue holds no message (waiting, in flight or delayed), none can.
    wait_until(lambda: _messages_left(cluster) == 0, timeout=60, message="an empty queue on SQS")
    assert cluster.side.done_count(result.id) == 1
    assert len(cluster.side.events(result.id, "start")) == 2


def _messages_left(cluster: Cluster) -> int:
    """How many messages the test's queue on SQS holds: waiting, received
    and not yet deleted, or delayed."""
    kinds = ["", "NotVisible", "Delayed"]
    with cluster.client.connection_for_read() as connection:
        sqs = connection.default_channel.sqs()
        queue = connection.default_channel.canonical_queue_name(cluster.config.queue)
        url = sqs.get_queue_url(QueueName=queue)["QueueUrl"]
        counts = [f"ApproximateNumberOfMessages{kind}" for kind in kinds]
        found = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=counts)["Attributes"]
    return sum(int(found[count]) for count in counts)


def _make_queue(cluster: Cluster, visibility_timeout: int) -> None:
    """Create the test's queue on SQS with ``visibility_timeout``, as an older setup did."""
    with cluster.client.connection_for_write() as connection:
        channel = connection.default_channel
        channel.sqs().create_queue(
            QueueName=channel.canonical_queue_name(cluster.config.queue),
            Attributes={"VisibilityTimeout": str(visibility_timeout)},
        )


@pytest.mark.parametrize("broker_kind", ["sqs"], indirect=True)
def test_the_start_check_reads_the_visibility_timeout_an_existing_queue_has(
    cluster: Cluster,
) -> None:
    # the option was raised after kombu had created the queue with 2 s
    _make_queue(cluster, 2)
    cluster.configure(ttl=3.0, visibility_timeout=30.0)
    worker = cluster.worker("a")
    queue = re.escape(repr(cluster.config.queue))
    worker.wait_for_log(
        rf"SQS queue {queue} has a VisibilityTimeout of 2 s, below "
        r"broker_transport_options\['visibility_timeout'\] \(30 s\)",
        timeout=10,
    )
    # the task checks judge the 2 s the queue has, not the option's 30 s
    assert re.search(r"visibility_timeout \(2 s\) is shorter than the lease ttl", worker.log())


@pytest.mark.parametrize("broker_kind", ["sqs"], indirect=True)
def test_keep_invisible_refuses_renewals_too_rare_for_the_queues_own_timeout(
    cluster: Cluster,
) -> None:
    _make_queue(cluster, 2)
    # renewed every 1 s: enough for the option's 30 s, not for the queue's 2 s
    cluster.configure(ttl=3.0, visibility_timeout=30.0, keep_invisible=True)
    worker = cluster.worker("a", start=False)
    with pytest.raises(AssertionError, match="exited before logging"):
        worker.start(ready_timeout=60)
    assert worker.wait_exit(timeout=30) == 1
    assert re.search(
        rf"renews its lease every 1 s.*visibility timeout \(2 s, the VisibilityTimeout "
        rf"attribute of SQS queue {re.escape(repr(cluster.config.queue))}\)",
        worker.log(),
    )
