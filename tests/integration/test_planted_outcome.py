"""A kept outcome is data from the store, not code: a worker decodes it only
with the app's result serializer.

An app with JSON results that also accepts pickle messages (``accept_content``)
must not unpickle an outcome someone planted in the lease store. The worker
is a real Celery worker in this process; the broker, the result backend and
the lease store are a real redis-server.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery

from celery_leases import LeasedTask, LeaseRecordUnreadable, LeaseState
from celery_leases.sending import keeping_send_id
from celery_leases.task import store_for
from tests.integration.conftest import WAIT, Recorder, worker
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


class _MakesMarker:
    """Unpickling this creates the directory ``path``: code ran in the unpickler."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (os.mkdir, (str(self.path),))


def _planted_pickle(marker: Path) -> bytes:
    """An outcome as the record keeps one, with pickle as its content type."""
    body = pickle.dumps(["ok", _MakesMarker(marker)])
    return b"application/x-python-serialize\nbinary\n" + body


def test_a_planted_pickle_outcome_is_refused_not_unpickled(
    make_app: Callable[..., Celery],
    redis_server: RedisServer,
    unique: str,
    tmp_path: Path,
    recorder: Recorder,
) -> None:
    app = make_app(
        redis_server.url,
        leases_store_options={"prefix": f"planted{unique}:"},
        result_serializer="json",
        accept_content=["json", "pickle"],  # the app takes pickle messages, not results
    )

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> str:
        recorder.add("body", self.request.id)
        return "ran"

    marker = tmp_path / "unpickled"
    task_id = uuid.uuid4().hex
    # someone with write access to the store plants a completed record of the
    # job, naming the send the worker will receive, with a pickle outcome
    store = store_for(app)
    planted = store.claim(task_id, "planter:1:x", 30, send_id="send-1")
    store.complete(task_id, "planter:1:x", planted.generation, outcome=_planted_pickle(marker))

    with worker(app), keeping_send_id("send-1"):
        result = job.apply_async(task_id=task_id)
        result.get(timeout=WAIT, propagate=False)
    assert not marker.exists(), "the worker unpickled an outcome planted in the store"
    assert result.state == "FAILURE"
    error = result.result
    assert isinstance(error, LeaseRecordUnreadable), error
    assert "application/x-python-serialize" in str(error)
    assert "not the result serializer 'json'" in str(error)
    assert recorder.of("body") == []  # the planted completion still stands: no run
    record = store.get(task_id)
    assert record is not None
    assert record.state is LeaseState.COMPLETED


def test_an_outcome_in_the_result_serializer_still_answers_a_redelivery(
    make_app: Callable[..., Celery],
    redis_server: RedisServer,
    unique: str,
    recorder: Recorder,
) -> None:
    app = make_app(
        redis_server.url,
        leases_store_options={"prefix": f"planted{unique}:"},
        result_serializer="pickle",
        accept_content=["json", "pickle"],
    )

    @app.task(shared=False, base=LeasedTask, bind=True)
    def job(self: LeasedTask) -> str:
        recorder.add("body", self.request.id)
        return "ran"

    task_id = uuid.uuid4().hex
    store = store_for(app)
    first = store.claim(task_id, "first:1:x", 30, send_id="send-1")
    kept = b"application/x-python-serialize\nbinary\n" + pickle.dumps(["ok", "kept result"])
    store.complete(task_id, "first:1:x", first.generation, outcome=kept)

    with worker(app), keeping_send_id("send-1"):
        assert job.apply_async(task_id=task_id).get(timeout=WAIT) == "kept result"
    assert recorder.of("body") == []
