"""A running task's message headers, as the library reads them."""

from __future__ import annotations

from celery.app.task import Context

from celery_leases.request import header_of


def test_a_header_copied_onto_the_request_is_read_first() -> None:
    request = Context(leases_deferrals=3, headers={"leases_deferrals": 1})
    assert header_of(request, "leases_deferrals") == 3


def test_a_header_kept_in_the_headers_mapping_is_read() -> None:
    assert header_of(Context(headers={"leases_send_id": "s1"}), "leases_send_id") == "s1"


def test_headers_that_are_not_a_mapping_count_as_none() -> None:
    # Celery's own tests run tasks whose request headers are a number
    assert header_of(Context(headers=0), "leases_send_id", "none") == "none"
    assert header_of(Context(headers=None), "leases_send_id") is None
