"""The outcome a completion keeps: encoded with the result serializer, bounded, decoded safely."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.serialization import dumps as kombu_dumps

from celery_leases.errors import LeaseRecordUnreadable
from celery_leases.outcome import decode, encode_error, encode_value


def test_a_value_round_trips_through_json() -> None:
    payload = encode_value({"total": 42, "items": [1, 2]}, serializer="json", max_bytes=1024)
    assert payload is not None
    assert decode(payload, serializer="json") == ("ok", {"total": 42, "items": [1, 2]})


def test_an_error_keeps_its_type_name_and_message() -> None:
    payload = encode_error(ValueError("poison"), serializer="json", max_bytes=1024)
    assert payload is not None
    assert decode(payload, serializer="json") == (
        "error",
        {"type": "ValueError", "message": "poison"},
    )


def test_a_value_over_the_limit_or_not_serializable_is_not_kept() -> None:
    assert encode_value("x" * 2000, serializer="json", max_bytes=1000) is None
    assert encode_value({1, 2}, serializer="json", max_bytes=1000) is None
    assert encode_value("small", serializer="json", max_bytes=0) is None


def test_only_the_result_serializer_or_result_accept_content_decodes() -> None:
    payload = encode_value({"a": 1}, serializer="pickle", max_bytes=1024)
    assert payload is not None
    # accepting pickle messages (accept_content) does not make a record unpicklable
    with pytest.raises(LeaseRecordUnreadable, match="not the result serializer 'json'"):
        decode(payload, serializer="json", accept=None, job_id="j")
    with pytest.raises(LeaseRecordUnreadable, match="was not decoded"):
        decode(payload, serializer="json", accept=["json"])
    assert decode(payload, serializer="pickle") == ("ok", {"a": 1})
    assert decode(payload, serializer="json", accept=["json", "pickle"]) == ("ok", {"a": 1})


def test_a_trusted_raw_content_type_is_refused_too() -> None:
    # kombu hands back application/data and application/text raw, whatever accept says
    with pytest.raises(LeaseRecordUnreadable, match="'application/data'"):
        decode(b"application/data\nbinary\n[]", serializer="json")


def test_garbage_is_refused_with_a_clear_error() -> None:
    with pytest.raises(LeaseRecordUnreadable, match="not an outcome celery-leases wrote"):
        decode(b"no newlines here", serializer="json")
    with pytest.raises(LeaseRecordUnreadable, match="does not decode"):
        decode(b"application/json\nutf-8\n{not json", serializer="json")
    with pytest.raises(LeaseRecordUnreadable, match="unknown outcome kind"):
        decode(b'application/json\nutf-8\n["maybe", 1]', serializer="json")


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(_JSON_VALUES)
def test_plain_json_values_are_encoded_byte_for_byte_as_kombu_encodes_them(value: object) -> None:
    payload = encode_value(value, serializer="json", max_bytes=1 << 20)
    content_type, encoding, body = kombu_dumps(["ok", value], serializer="json")
    assert payload == f"{content_type}\n{encoding}\n".encode() + body.encode(encoding)
    assert decode(payload, serializer="json") == ("ok", value)


def test_values_plain_json_cannot_hold_go_through_kombu_and_come_back() -> None:
    moment = datetime(2026, 12, 1, 7, 0, tzinfo=timezone.utc)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    payload = encode_value({"at": moment, "id": ident}, serializer="json", max_bytes=4096)
    assert payload is not None
    assert decode(payload, serializer="json") == ("ok", {"at": moment, "id": ident})
