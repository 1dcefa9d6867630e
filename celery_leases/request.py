"""The worker-side request class of leased tasks.

Celery does not pass a message's content type to the task, so a copy
published again by the library would fall back to the task's default
serializer (a message sent with ``serializer="pickle"`` would then fail to
encode). :class:`LeasedRequest` adds the content type and encoding to the
request the task sees, as ``request.leases_content_type`` and
``request.leases_content_encoding``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery.worker.request import Request

__all__ = [
    "CONTENT_ENCODING_KEY",
    "CONTENT_TYPE_KEY",
    "LeasedRequest",
    "header_of",
    "headers_of",
]

CONTENT_TYPE_KEY = "leases_content_type"
CONTENT_ENCODING_KEY = "leases_content_encoding"


class LeasedRequest(Request):  # type: ignore[misc]  # celery ships no type hints
    """A Celery request that tells the task its message's content type."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        self._request_dict[CONTENT_TYPE_KEY] = self.content_type
        self._request_dict[CONTENT_ENCODING_KEY] = self.content_encoding


def header_of(request: Any, name: str, default: Any = None) -> Any:
    """The message header ``name`` of a running task's ``request``.

    Celery copies a message's headers onto the request as attributes (a
    worker's request), or keeps them in ``request.headers`` (an eager or
    direct call, a request made by hand); headers that are not a mapping
    count as none.
    """
    value = getattr(request, name, None)
    if value is None:
        value = headers_of(request).get(name)
    return default if value is None else value


def headers_of(request: Any) -> Mapping[str, Any]:
    """``request.headers`` (what an eager or direct call keeps there, and
    what a worker's request keeps of its message), or an empty mapping when
    it is none or not a mapping."""
    headers = getattr(request, "headers", None)
    return headers if isinstance(headers, Mapping) else {}
