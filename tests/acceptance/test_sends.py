"""Which deliveries are the same run, and what a copy keeps of its message.

The producer of :func:`test_a_producer_without_the_library_gets_a_new_run_per_task_id`
is a process of its own that never imports celery_leases, so its messages
carry no send id, as from any plain Celery client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from celery_leases import Acquired
from tests.acceptance.app import HEADERS, SINGLETON
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import REPO_ROOT

#: a plain Celery client: sends by name, prints each answer as JSON
_PLAIN_PRODUCER = """
import json, sys
from celery import Celery

broker, queue, key = sys.argv[1:4]
app = Celery("plain", broker=broker, backend=broker)
app.conf.broker_connection_retry_on_startup = True
# the first call holds its key for 1 s: the second is sent while it is held
first = app.send_task("{name}", args=(key, 1, 1.0), queue=queue)
second = app.send_task("{name}", args=(key, 2), queue=queue)
answers = [first.get(timeout=40), second.get(timeout=40)]
# the completing message again, with its task id: the same run, already answered
again = app.send_task("{name}", args=(key, 2), queue=queue, task_id=second.id)
answers.append(again.get(timeout=40))
assert "celery_leases" not in sys.modules
print(json.dumps({{"answers": answers, "ids": [first.id, second.id]}}))
"""


def test_a_producer_without_the_library_gets_a_new_run_per_task_id(cluster: Cluster) -> None:
    """A custom lease_key and messages without a send id: another task id
    under the same key is a new run (serialized by the lease); the same
    task id is the same run."""
    cluster.worker("a")
    key = "plain-" + str(time.monotonic_ns())
    produced = subprocess.run(
        [
            sys.executable,
            "-c",
            _PLAIN_PRODUCER.format(name=SINGLETON),
            cluster.config.broker,
            cluster.config.queue,
            key,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert produced.returncode == 0, produced.stderr
    report = json.loads(produced.stdout)
    assert report["answers"] == [1, 2, 2]
    first_id, second_id = report["ids"]
    assert cluster.side.done_count(first_id) == 1
    assert cluster.side.done_count(second_id) == 1  # its second message did not run it again
    starts = cluster.side.events(kind="start")
    assert [event["job"] for event in starts] == [first_id, second_id]  # one after the other


def test_a_deferred_copy_keeps_the_sender_s_custom_headers(cluster: Cluster) -> None:
    cluster.worker("a")
    job_id = "headers-" + str(time.monotonic_ns())
    assert isinstance(cluster.store.claim(job_id, "holder:1:abc", 1.0), Acquired)
    result = cluster.send(
        HEADERS,
        "x_trace",
        "x_tenant",
        task_id=job_id,
        headers={"x_trace": "trace-7f3a", "x_tenant": "acme"},
    )
    value = result.get(timeout=30)
    assert value["deferrals"] >= 1  # the body ran in a copy
    sent = {"x_trace": "trace-7f3a", "x_tenant": "acme"}
    assert value["attributes"] == sent
    assert value["headers"] == sent
