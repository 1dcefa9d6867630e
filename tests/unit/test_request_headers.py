"""A running task's message headers, as the library reads them."""

from __future__ import annotations

from celery import Celery
from celery.app.task import Context

from celery_leases.publish import DEFERRALS_HEADER, copy_signature
from celery_leases.request import header_of, headers_of
from celery_leases.sending import message_send_id


def test_a_header_copied_onto_the_request_is_read_first() -> None:
    request = Context(leases_deferrals=3, headers={"leases_deferrals": 1})
    assert header_of(request, "leases_deferrals") == 3


def test_a_header_kept_in_the_headers_mapping_is_read() -> None:
    assert header_of(Context(headers={"leases_send_id": "s1"}), "leases_send_id") == "s1"


def test_headers_that_are_not_a_mapping_count_as_none() -> None:
    # Celery's own tests run tasks whose request headers are a number
    assert header_of(Context(headers=0), "leases_send_id", "none") == "none"
    assert header_of(Context(headers=None), "leases_send_id") is None


def test_a_copy_of_a_message_whose_headers_are_not_a_mapping_starts_them_afresh() -> None:
    app = Celery("copies", set_as_current=False)

    @app.task(shared=False)
    def job() -> None: ...

    request = Context(headers=0, id="t-1", leases_send_id="send-1")
    assert headers_of(request) == {}
    copy = copy_signature(job, request, (), {}, reason="held")
    assert copy.options["headers"][DEFERRALS_HEADER] == 1
    assert message_send_id(request) == "send-1"  # the copy is the same send
