"""A tiny HTTP service that refuses stale writers, on the standard library.

``PUT /values/<name>`` stores the request body under ``<name>`` if the
request's fencing token is not older than the newest one accepted for that
name. Answers: 200 (written, or a repeat accepted without writing), 409
(stale token), 400 (no or malformed token).

Run it with ``python docs/examples/fenced_service.py`` (port 8000).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from celery_leases.errors import LeaseConfigurationError, StaleFencingToken
from celery_leases.fencing.http import FenceChecker

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class ValueService:
    """The WSGI application: values in a dict, fenced per name."""

    def __init__(self, checker: FenceChecker | None = None) -> None:
        self.checker = checker or FenceChecker(on_repeat="accept")
        self.values: dict[str, bytes] = {}

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/values/"):
            return _answer(start_response, "404 Not Found", {"error": "no such path"})
        name = path.removeprefix("/values/")
        if environ["REQUEST_METHOD"] == "GET":
            if name not in self.values:
                return _answer(start_response, "404 Not Found", {"error": "no such value"})
            return _answer(start_response, "200 OK", {"value": self.values[name].decode()})
        if environ["REQUEST_METHOD"] != "PUT":
            return _answer(start_response, "405 Method Not Allowed", {"error": "use PUT"})
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length)
        # --8<-- [start:checker]
        try:
            # the environ carries the headers; hold the name while writing
            with self.checker.fenced(environ, resource=name) as fence:
                if fence.applied:
                    self.values[name] = body
        except StaleFencingToken as exc:
            return _answer(
                start_response, "409 Conflict", {"error": str(exc), "accepted": exc.accepted}
            )
        except LeaseConfigurationError as exc:
            return _answer(start_response, "400 Bad Request", {"error": str(exc)})
        return _answer(
            start_response,
            "200 OK",
            {"applied": fence.applied, "generation": fence.generation},
        )
        # --8<-- [end:checker]


def _answer(start_response: StartResponse, status: str, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(
        status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
    )
    return [data]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_in_thread(app: ValueService, port: int = 0) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``app`` on 127.0.0.1 from a daemon thread; ``port`` 0 picks one.

    Stop it with ``server.shutdown()`` then ``server.server_close()``.
    """
    server = make_server("127.0.0.1", port, app, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="fenced-service", daemon=True)
    thread.start()
    return server, thread


if __name__ == "__main__":
    with make_server("127.0.0.1", 8000, ValueService()) as httpd:
        httpd.serve_forever()
