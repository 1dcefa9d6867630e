"""The error tree survives the trip through a result backend."""

from __future__ import annotations

import inspect
import pickle

import pytest
from celery import Celery

import celery_leases.errors
from celery_leases import (
    LeaseConfigurationError,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseRecordUnreadable,
    LeaseSkipped,
    ResultUnavailable,
    StaleFencingToken,
    StoreUnavailable,
    TakeoverLimitExceeded,
)

ERRORS: list[LeaseError] = [
    LeaseError("plain", job_id="j", owner="o", generation=3),
    LeaseHeld("held", job_id="j", holder="h", generation=4, remaining=1.5),
    LeaseSkipped(
        "skipped", job_id="j", holder="h", generation=4, remaining=1.5, holder_task_id="t"
    ),
    LeaseLost("lost", job_id="j", owner="o", generation=5, reason="superseded"),
    StaleFencingToken("stale", job_id="j", generation=6, resource="r", accepted=7),
    StoreUnavailable("down", job_id="j"),
    LeaseConfigurationError("bad setting"),
    LeaseRecordUnreadable("the record of job 'j' is unreadable", job_id="j"),
    TakeoverLimitExceeded("poison", job_id="j", owner="o", generation=8, takeovers=6, limit=5),
    ResultUnavailable("no result", job_id="j", owner="o", generation=9),
]


def test_the_list_has_every_error_class() -> None:
    classes = {
        cls
        for _, cls in inspect.getmembers(celery_leases.errors, inspect.isclass)
        if issubclass(cls, LeaseError)
    }
    assert classes == {type(error) for error in ERRORS}


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_pickling_keeps_the_class_and_every_attribute(error: LeaseError) -> None:
    copy = pickle.loads(pickle.dumps(error))  # noqa: S301 - our own bytes
    assert type(copy) is type(error)
    assert copy.args == error.args
    assert vars(copy) == vars(error)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_can_be_made_from_its_message_alone(error: LeaseError) -> None:
    # what serializers that store only (type, args) do when loading it again
    copy = type(error)(error.args[0])
    assert isinstance(copy, LeaseError)
    assert str(copy) == str(error)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_is_made_again_whole_from_its_args(error: LeaseError) -> None:
    # what Celery's result backends do with an error stored as json
    copy = type(error)(*error.args)
    assert vars(copy) == vars(error)
    assert str(copy) == str(error) == error.args[0]
    assert repr(copy) == f"{type(error).__name__}({str(error)!r})"


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_a_result_backend_gives_back_the_same_class(error: LeaseError, serializer: str) -> None:
    app = Celery("errors", set_as_current=False)
    app.conf.result_serializer = serializer
    app.conf.accept_content = ["json", "pickle"]
    app.conf.result_accept_content = ["json", "pickle"]
    backend = app.backend
    stored = backend.prepare_exception(error, serializer)
    loaded = backend.exception_to_python(stored)
    assert type(loaded) is type(error)
    assert str(loaded) == str(error)
    assert vars(loaded) == vars(error)  # job id, holder, generation, ...
    app.close()


def test_an_unreadable_record_is_neither_an_outage_nor_a_configuration() -> None:
    # a caller that retries StoreUnavailable must not retry this forever
    assert issubclass(LeaseRecordUnreadable, LeaseError)
    assert not issubclass(LeaseRecordUnreadable, (StoreUnavailable, LeaseConfigurationError))
