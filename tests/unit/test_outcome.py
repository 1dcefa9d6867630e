"""The outcome a completion keeps: encoded with the result serializer, bounded, decoded safely."""

from __future__ import annotations

import pytest

from celery_leases.outcome import decode, encode_error, encode_value


def test_a_value_round_trips_through_json() -> None:
    payload = encode_value({"total": 42, "items": [1, 2]}, serializer="json", max_bytes=1024)
    assert payload is not None
    assert decode(payload, accept=["json"]) == ("ok", {"total": 42, "items": [1, 2]})


def test_an_error_keeps_its_type_name_and_message() -> None:
    payload = encode_error(ValueError("poison"), serializer="json", max_bytes=1024)
    assert payload is not None
    assert decode(payload, accept=["json"]) == (
        "error",
        {"type": "ValueError", "message": "poison"},
    )


def test_a_value_over_the_limit_or_not_serializable_is_not_kept() -> None:
    assert encode_value("x" * 2000, serializer="json", max_bytes=1000) is None
    assert encode_value({1, 2}, serializer="json", max_bytes=1000) is None
    assert encode_value("small", serializer="json", max_bytes=0) is None


def test_a_content_type_the_app_does_not_accept_is_refused() -> None:
    payload = encode_value({"a": 1}, serializer="pickle", max_bytes=1024)
    assert payload is not None
    with pytest.raises(ValueError, match="unreadable outcome"):
        decode(payload, accept=["json"])
    assert decode(payload, accept=["json", "pickle"]) == ("ok", {"a": 1})


def test_garbage_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unreadable outcome"):
        decode(b"no newlines here", accept=None)
