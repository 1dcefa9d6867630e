"""Fencing for HTTP services: the header convention, client helpers, a checker.

A fenced request carries three headers::

    Fencing-Token: 1700000000123          the lease's generation
    Fencing-Job: 3f1c...-task-id          the lease's job_id, percent-encoded
    Idempotency-Key: 3f1c...:1700000000123  "<encoded job_id>:<generation>"

Header values are latin-1, and a job id may be any text, so the job id is
sent as the percent-encoding of its UTF-8 bytes: RFC 3986 unreserved
characters (``A-Z a-z 0-9 - . _ ~``) stay as they are, every other byte
becomes ``%XX``. A Celery task id (a UUID) is therefore sent unchanged;
``"rapport-été"`` is sent as ``rapport-%C3%A9t%C3%A9`` and ``"a b/c%d"`` as
``a%20b%2Fc%25d``. :func:`token_from_headers` decodes it again.

Clients send them with :func:`fencing_headers` or :class:`FencingAuth`
(httpx and requests both take it as ``auth=``). A service puts a
:class:`FenceChecker` in front of its write: it refuses a token older than
the newest it accepted for the resource (answer 409 Conflict), and with
``on_repeat`` it can refuse or ignore a repeat of the same generation.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, unquote

from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing import (
    FenceResult,
    FenceStorage,
    FencingToken,
    MemoryFences,
    OnRepeat,
    Token,
    check_on_repeat,
    check_resource,
    check_token,
)

if TYPE_CHECKING:
    import httpx
    import requests

__all__ = [
    "FENCING_JOB_HEADER",
    "FENCING_TOKEN_HEADER",
    "IDEMPOTENCY_KEY_HEADER",
    "FenceChecker",
    "FencingAuth",
    "fenced_httpx_client",
    "fenced_requests_session",
    "fencing_headers",
    "token_from_headers",
]

FENCING_TOKEN_HEADER = "Fencing-Token"  # noqa: S105 - a header name, not a secret
FENCING_JOB_HEADER = "Fencing-Job"
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"

#: locks striping the resources of one checker: bounded memory, and two
#: resources rarely share a lock
_LOCK_STRIPES = 64

_Request = TypeVar("_Request")


def fencing_headers(token: FencingToken) -> dict[str, str]:
    """The headers that carry ``token`` on a request.

    Raises:
        LeaseConfigurationError: the token is invalid.
    """
    job_id, generation = check_token(token)
    encoded = _encode_job_id(job_id)
    return {
        FENCING_TOKEN_HEADER: str(generation),
        FENCING_JOB_HEADER: encoded,
        IDEMPOTENCY_KEY_HEADER: f"{encoded}:{generation}",
    }


def _encode_job_id(job_id: str) -> str:
    """``job_id`` as ASCII for a header: UTF-8, percent-encoded but for unreserved characters."""
    try:
        return quote(job_id, safe="", encoding="utf-8", errors="strict")
    except UnicodeEncodeError as exc:  # a lone surrogate has no UTF-8 form
        raise LeaseConfigurationError(
            f"job id {job_id!r} cannot be sent in a header: it is not valid Unicode text",
            job_id=job_id,
        ) from exc


def _decode_job_id(value: str, header: str) -> str:
    """The job id of a header value written by :func:`_encode_job_id`."""
    try:
        return unquote(value, encoding="utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise LeaseConfigurationError(
            f"the {header} header {value!r} is not a percent-encoded UTF-8 job id"
        ) from exc


class FencingAuth:
    """Adds the fencing headers to every request; pass it as ``auth=``.

    Works with httpx (a callable auth) and requests (a callable auth)
    without importing either::

        httpx.post(url, json=body, auth=FencingAuth(self.lease))
        requests.post(url, json=body, auth=FencingAuth(self.lease))
    """

    def __init__(self, token: FencingToken) -> None:
        self.headers = fencing_headers(token)

    def __call__(self, request: _Request) -> _Request:
        request.headers.update(self.headers)  # type: ignore[attr-defined]
        return request


def _need(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError as exc:
        raise LeaseConfigurationError(
            f"this helper needs {module}, which is not installed: pip install 'celery-leases[http]'"
        ) from exc


def fenced_httpx_client(token: FencingToken, **options: Any) -> httpx.Client:
    """An ``httpx.Client`` that sends the fencing headers of ``token``.

    Raises:
        LeaseConfigurationError: httpx is not installed.
    """
    client: httpx.Client = _need("httpx").Client(auth=FencingAuth(token), **options)
    return client


def fenced_requests_session(token: FencingToken) -> requests.Session:
    """A ``requests.Session`` that sends the fencing headers of ``token``.

    Raises:
        LeaseConfigurationError: requests is not installed.
    """
    session: requests.Session = _need("requests").Session()
    session.auth = FencingAuth(token)
    return session


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """A header by name, case-insensitively; WSGI environ keys work too."""
    wanted = name.lower()
    environ_key = "HTTP_" + name.upper().replace("-", "_")
    for key, value in headers.items():
        if key == environ_key or (isinstance(key, str) and key.lower() == wanted):
            return str(value)
    return None


def token_from_headers(headers: Mapping[str, str]) -> Token:
    """Read the fencing token of a request.

    Args:
        headers: the request's headers (any mapping), or a WSGI environ.

    Returns:
        The :class:`~celery_leases.fencing.Token` (without owner).

    Raises:
        LeaseConfigurationError: a header is missing or malformed (also a
            ``Fencing-Job`` that is not percent-encoded UTF-8), or the
            ``Idempotency-Key`` disagrees with the token (answer 400).
    """
    raw_generation = _header(headers, FENCING_TOKEN_HEADER)
    job_id = _header(headers, FENCING_JOB_HEADER)
    if raw_generation is None or job_id is None:
        raise LeaseConfigurationError(
            f"the request carries no fencing token: send the {FENCING_TOKEN_HEADER} and "
            f"{FENCING_JOB_HEADER} headers (fencing_headers(lease) makes them)"
        )
    try:
        generation = int(raw_generation.strip())
    except ValueError:
        generation = 0
    token = Token(_decode_job_id(job_id.strip(), FENCING_JOB_HEADER), generation)
    check_token(token)
    key = _header(headers, IDEMPOTENCY_KEY_HEADER)
    if key is not None and not _key_matches(key.strip(), token):
        raise LeaseConfigurationError(
            f"{IDEMPOTENCY_KEY_HEADER} {key!r} does not match the fencing token "
            f"{token.idempotency_key!r}",
            job_id=token.job_id,
            generation=token.generation,
        )
    return token


def _key_matches(key: str, token: Token) -> bool:
    # the encoded job id has no ':', so the last one ends it; comparing the
    # decoded parts also accepts another spelling of the same escapes (%c3)
    encoded_job, _, generation = key.rpartition(":")
    return _decode_job_id(
        encoded_job, IDEMPOTENCY_KEY_HEADER
    ) == token.job_id and generation == str(token.generation)


class FenceChecker:
    """Refuses stale fenced requests in front of a service's own write.

    Thread-safe. Fences live in ``storage``: in memory by default (one
    service process), or a shared :class:`~celery_leases.fencing.redis.RedisFence`
    or :class:`~celery_leases.fencing.sql.SqlFences` for several processes.

    Args:
        storage: where fences are kept; a fresh ``MemoryFences`` by default.
        on_repeat: what a repeat of the accepted generation does
            (``"apply"``, ``"refuse"`` or ``"accept"``).
    """

    def __init__(
        self, storage: FenceStorage | None = None, *, on_repeat: OnRepeat = "apply"
    ) -> None:
        self.storage: FenceStorage = MemoryFences() if storage is None else storage
        self.on_repeat = check_on_repeat(on_repeat)
        self._stripes = [threading.Lock() for _ in range(_LOCK_STRIPES)]

    def check(self, headers: Mapping[str, str], *, resource: str) -> FenceResult:
        """Accept the request's token for ``resource``, moving the fence.

        A check alone does not order the write that follows it with another
        request's write; use :meth:`fenced` around the write for that.

        Returns:
            The result; ``applied`` is ``False`` for a repeat that must be
            answered as success without writing again.

        Raises:
            StaleFencingToken: the token is stale (answer 409 Conflict).
            LeaseConfigurationError: the headers are missing or malformed
                (answer 400 Bad Request).
        """
        resource = check_resource(resource)
        token = token_from_headers(headers)
        return self.storage.advance(resource, token, on_repeat=self.on_repeat)

    @contextlib.contextmanager
    def fenced(self, headers: Mapping[str, str], *, resource: str) -> Iterator[FenceResult]:
        """:meth:`check`, then hold ``resource`` until the block ends.

        Writes of one process to one resource then happen in fence order::

            with checker.fenced(environ, resource=key) as result:
                if result.applied:
                    write(...)

        Without the hold, request 7 could pass its check, request 8 pass
        its own and write, and then 7 write over 8. Across processes, hold
        the resource in the target itself (for example ``fenced_execute``).
        """
        resource = check_resource(resource)
        stripe = self._stripes[zlib.crc32(resource.encode()) % _LOCK_STRIPES]
        with stripe:
            yield self.check(headers, resource=resource)
