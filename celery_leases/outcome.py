"""The outcome a completion keeps, so a redelivered copy can answer its client.

Celery stores a task's result only after the task returns. A worker killed
between the accepted completion and that store would leave the client
waiting forever: the redelivered copy finds the job completed and must not
run it again. So the completion keeps the run's outcome in the lease record,
encoded with the app's result serializer, up to ``leases_result_max_bytes``;
the copy hands it to Celery as its own return value (or raises the recorded
error).

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

__all__ = ["Outcome", "decode", "encode_error", "encode_value"]

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


def _encode(outcome: Outcome, serializer: str, max_bytes: int) -> bytes | None:
    if max_bytes <= 0:
        return None
    payload = _plain_json(outcome) if serializer == "json" else None
    if payload is None:
        try:
            content_type, encoding, data = dumps(  # type: ignore[no-untyped-call]
                list(outcome), serializer=serializer
            )
        except Exception as exc:
            logger.info("the task's result is not kept with its completion: %r", exc)
            return None
        body = data.encode(encoding or "utf-8") if isinstance(data, str) else bytes(data)
        payload = f"{content_type}\n{encoding}\n".encode() + body
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


def decode(payload: bytes, *, accept: Iterable[str] | None) -> Outcome:
    """Decode what :func:`encode_value` or :func:`encode_error` made.

    ``accept`` names the serializers (or content types) allowed, as in
    Celery's ``accept_content``; None allows any.

    Raises:
        ValueError: the payload is not an outcome this module wrote.
    """
    try:
        content_type, encoding, body = payload.split(b"\n", 2)
        kind, value = loads(  # type: ignore[no-untyped-call]
            body,
            content_type.decode(),
            encoding.decode(),
            accept=None if accept is None else prepare_accept_content(accept),  # type: ignore[no-untyped-call]
        )
    except Exception as exc:
        raise ValueError(f"unreadable outcome in the lease record: {exc!r}") from exc
    if kind not in ("ok", "error"):
        raise ValueError(f"unknown outcome kind {kind!r} in the lease record")
    return str(kind), value
