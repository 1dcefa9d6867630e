"""The outcome a completion keeps, so a redelivered copy can answer its client.

Celery stores a task's result only after the task returns. A worker killed
between the accepted completion and that store would leave the client
waiting forever: the redelivered copy finds the job completed and must not
run it again. So the completion keeps the run's outcome in the lease record,
encoded with the app's result serializer, up to ``leases_result_max_bytes``;
the copy hands it to Celery as its own return value (or raises the recorded
error). It is decoded only with the result serializer (or one that
``result_accept_content`` names): the serializers ``accept_content`` allows
for messages never decode a record.

The stored bytes are ``content_type``, a newline, ``content_encoding``, a
newline, then the serialized ``[kind, value]`` pair, where kind is ``"ok"``
or ``"error"`` (``value`` is then ``{"type": ..., "message": ...}``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from kombu.serialization import dumps, loads, prepare_accept_content

from celery_leases.errors import LeaseRecordUnreadable

__all__ = ["Outcome", "decode", "encode_error", "encode_value", "serialize"]

logger = logging.getLogger("celery_leases")

Outcome = tuple[str, Any]


def encode_value(value: object, *, serializer: str, max_bytes: int) -> bytes | None:
    """Encode a return value, or None if it is too large or cannot be encoded."""
    return _encode(("ok", value), serializer, max_bytes)


def encode_error(error: BaseException, *, serializer: str, max_bytes: int) -> bytes | None:
    """Encode a terminal error by its type name and message."""
    detail = {"type": type(error).__name__, "message": str(error)}
    return _encode(("error", detail), serializer, max_bytes)


#: the head of a JSON outcome, as kombu names its JSON serializer
_JSON_HEAD = b"application/json\nutf-8\n"


def serialize(value: object, serializer: str) -> bytes:
    """``value`` serialized by kombu's ``serializer``, as
    ``<content type>\\n<encoding>\\n<body>``.

    Raises:
        Exception: the serializer's error (kombu's EncodeError, ...).
    """
    content_type, encoding, data = dumps(  # type: ignore[no-untyped-call]
        value, serializer=serializer
    )
    body = data.encode(encoding or "utf-8") if isinstance(data, str) else bytes(data)
    return f"{content_type}\n{encoding}\n".encode() + body


def _encode(outcome: Outcome, serializer: str, max_bytes: int) -> bytes | None:
    if max_bytes <= 0:
        return None
    payload = _plain_json(outcome) if serializer == "json" else None
    if payload is None:
        try:
            payload = serialize(list(outcome), serializer)
        except Exception as exc:
            logger.info("the task's result is not kept with its completion: %r", exc)
            return None
    if len(payload) > max_bytes:
        logger.info(
            "the task's result (%d bytes encoded) is not kept with its completion: "
            "leases_result_max_bytes is %d",
            len(payload),
            max_bytes,
        )
        return None
    return payload


def _plain_json(outcome: Outcome) -> bytes | None:
    """``outcome`` as kombu's JSON serializer writes it, if plain JSON types
    hold it (else None, and kombu encodes it, with its markers for dates,
    UUIDs and decimals). kombu's serializer is the standard library's encoder
    with a hook for other types; calling that encoder straight saves most of
    a trivial task's encoding time."""
    try:
        return _JSON_HEAD + json.dumps(list(outcome)).encode("utf-8")
    except (TypeError, ValueError):
        return None


def decode(
    payload: bytes,
    *,
    serializer: str,
    accept: Iterable[str] | None = None,
    job_id: str | None = None,
) -> Outcome:
    """Decode what :func:`encode_value` or :func:`encode_error` made.

    Only the app's ``result_serializer`` and the serializers (or content
    types) of its ``result_accept_content`` decode an outcome. A record is
    data anyone who can write to the store could have planted, so the
    message serializers of ``accept_content`` do not count: an app with
    JSON results that also accepts pickle messages must never unpickle a
    record. Any other content type is refused before a decoder sees it.

    Raises:
        LeaseRecordUnreadable: the payload is not an outcome this app could
            have written (a content type it does not use for results, or
            bytes that do not decode).
    """
    allowed = prepare_accept_content([serializer, *(accept or ())])  # type: ignore[no-untyped-call]
    try:
        raw_type, raw_encoding, body = payload.split(b"\n", 2)
        content_type, encoding = raw_type.decode(), raw_encoding.decode()
    except ValueError:
        raise LeaseRecordUnreadable(
            f"the outcome kept in the lease record of job {job_id!r} is not an outcome "
            "celery-leases wrote; delete the record (celery leases purge or release) after "
            "checking who writes to the lease store",
            job_id=job_id,
        ) from None
    if content_type not in allowed:
        raise LeaseRecordUnreadable(
            f"the outcome kept in the lease record of job {job_id!r} has the content type "
            f"{content_type[:80]!r}, which is not the result serializer {serializer!r} nor in "
            "result_accept_content: it was not decoded. Something other than this app wrote "
            "it; check who writes to the lease store, or add the serializer to "
            "result_accept_content if this app really stores such results",
            job_id=job_id,
        )
    try:
        kind, value = loads(  # type: ignore[no-untyped-call]
            body, content_type, encoding, accept=allowed
        )
    except Exception as exc:
        raise LeaseRecordUnreadable(
            f"the outcome kept in the lease record of job {job_id!r} does not decode as "
            f"{content_type!r}: {exc!r}",
            job_id=job_id,
        ) from exc
    if kind not in ("ok", "error"):
        raise LeaseRecordUnreadable(
            f"unknown outcome kind {kind!r} in the lease record of job {job_id!r}",
            job_id=job_id,
        )
    return str(kind), value
