"""The error tree survives the trip through a result backend."""

from __future__ import annotations

import pickle

import pytest
from celery import Celery

from celery_leases import (
    LeaseConfigurationError,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseRecordUnreadable,
    StaleFencingToken,
    StoreUnavailable,
    TakeoverLimitExceeded,
)

ERRORS: list[LeaseError] = [
    LeaseError("plain", job_id="j", owner="o", generation=3),
    LeaseHeld("held", job_id="j", holder="h", generation=4, remaining=1.5),
    LeaseLost("lost", job_id="j", owner="o", generation=5, reason="superseded"),
    StaleFencingToken("stale", job_id="j", generation=6, resource="r", accepted=7),
    StoreUnavailable("down", job_id="j"),
    LeaseConfigurationError("bad setting"),
    LeaseRecordUnreadable("the record of job 'j' is unreadable", job_id="j"),
    TakeoverLimitExceeded("poison", job_id="j", owner="o", generation=8, takeovers=6, limit=5),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_pickling_keeps_the_class_and_every_attribute(error: LeaseError) -> None:
    copy = pickle.loads(pickle.dumps(error))  # noqa: S301 - our own bytes
    assert type(copy) is type(error)
    assert copy.args == error.args
    assert vars(copy) == vars(error)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_can_be_made_from_its_message_alone(error: LeaseError) -> None:
    # what serializers that store only (type, args) do when loading it again
    copy = type(error)(*error.args)
    assert isinstance(copy, LeaseError)
    assert str(copy) == str(error)


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
    app.close()


def test_an_unreadable_record_is_neither_an_outage_nor_a_configuration() -> None:
    # a caller that retries StoreUnavailable must not retry this forever
    assert issubclass(LeaseRecordUnreadable, LeaseError)
    assert not issubclass(LeaseRecordUnreadable, (StoreUnavailable, LeaseConfigurationError))
