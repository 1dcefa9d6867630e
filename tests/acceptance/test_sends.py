"""Which deliveries are the same run, and what a copy keeps of its message.

The plain producers here are processes of their own that never import
celery_leases, so their messages carry no send id, as from any plain Celery
client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

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


#: a plain Celery client: sends each (args, task id) of argv's JSON by name
#: and prints the answers as JSON
_PLAIN_CALLS = """
import json, sys
from celery import Celery

broker, queue, name, calls = sys.argv[1:5]
app = Celery("plain", broker=broker, backend=broker)
app.conf.broker_connection_retry_on_startup = True
answers = [
    app.send_task(name, args=args, queue=queue, task_id=task_id).get(timeout=40)
    for args, task_id in json.loads(calls)
]
assert "celery_leases" not in sys.modules
print(json.dumps(answers))
"""


def _run_plain(script: str, cluster: Cluster, *argv: str) -> Any:
    """What ``script``, run by a Python that never imports celery_leases
    with the broker and queue first in its argv, prints as JSON."""
    produced = subprocess.run(
        [sys.executable, "-c", script, cluster.config.broker, cluster.config.queue, *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert produced.returncode == 0, produced.stderr
    return json.loads(produced.stdout)


def test_a_producer_without_the_library_gets_a_new_run_per_task_id(cluster: Cluster) -> None:
    """A custom lease_key and messages without a send id: another task id
    under the same key is a new run (serialized by the lease); the same
    task id is the same run."""
    cluster.worker("a")
    key = "plain-" + str(time.monotonic_ns())
    report = _run_plain(_PLAIN_PRODUCER.format(name=SINGLETON), cluster, key)
    assert report["answers"] == [1, 2, 2]
    first_id, second_id = report["ids"]
    assert cluster.side.done_count(first_id) == 1
    assert cluster.side.done_count(second_id) == 1  # its second message did not run it again
    starts = cluster.side.events(kind="start")
    assert [event["job"] for event in starts] == [first_id, second_id]  # one after the other


@pytest.mark.parametrize("lease_store_target", ["redis", "postgres", "sqlite"], indirect=True)
def test_a_plain_message_with_the_task_id_of_a_completion_with_a_send_id_is_the_same_run(
    cluster: Cluster,
) -> None:
    """The job is completed by a message with a send id (sent from this
    process, which imported the library); a plain client then sends the
    task under the same key with that task id (the same run: answered, not
    run), and with another one (a new run)."""
    cluster.worker("a")
    key = "resent-" + str(time.monotonic_ns())
    completed = cluster.send(SINGLETON, key, 1, task_id=f"{key}-first")
    assert completed.get(timeout=40) == 1
    record = cluster.record(f"singleton-{key}")
    assert record is not None
    assert record.send_id  # a send id of its own, not "task:<task id>"
    assert not record.send_id.startswith("task:")
    assert record.task_id == completed.id
    other = f"{key}-other"
    calls = [[[key, 2], completed.id], [[key, 3], other]]
    answers = _run_plain(_PLAIN_CALLS, cluster, SINGLETON, json.dumps(calls))
    assert answers == [1, 3]  # the same run answers with its own result
    assert cluster.side.done_count(completed.id) == 1  # not run again
    assert cluster.side.done_count(other) == 1
    starts = cluster.side.events(kind="start")
    assert [event["job"] for event in starts] == [completed.id, other]


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
