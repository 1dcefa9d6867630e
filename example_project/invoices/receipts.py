"""A receipt service on the standard library that refuses stale writers.

``PUT /receipts/<invoice>`` stores a receipt unless the request's fencing
token (the ``Fencing-Token`` headers that
:func:`celery_leases.fencing.http.fencing_headers` makes) is older than the
newest accepted for that invoice: 200 when stored (or a repeat of the
accepted token), 409 when stale, 400 without a token.
``GET /receipts/<invoice>`` returns the stored receipt.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from celery_leases.errors import LeaseConfigurationError, StaleFencingToken
from celery_leases.fencing import FencingToken
from celery_leases.fencing.http import FenceChecker, fencing_headers

__all__ = ["ReceiptRefused", "ReceiptService", "send_receipt", "serve"]

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class ReceiptService:
    """The WSGI application; receipts are kept in memory."""

    def __init__(self) -> None:
        self.checker = FenceChecker(on_repeat="accept")
        self.receipts: dict[str, dict[str, Any]] = {}

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/receipts/"):
            return _answer(start_response, "404 Not Found", {"error": "no such path"})
        invoice = path.removeprefix("/receipts/")
        if environ["REQUEST_METHOD"] == "GET":
            if invoice not in self.receipts:
                return _answer(start_response, "404 Not Found", {"error": "no receipt"})
            return _answer(start_response, "200 OK", self.receipts[invoice])
        if environ["REQUEST_METHOD"] != "PUT":
            return _answer(start_response, "405 Method Not Allowed", {"error": "use PUT"})
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        try:
            with self.checker.fenced(environ, resource=f"receipt:{invoice}") as fence:
                if fence.applied:
                    self.receipts[invoice] = {**json.loads(body), "generation": fence.generation}
        except StaleFencingToken as exc:
            return _answer(start_response, "409 Conflict", {"error": str(exc)})
        except LeaseConfigurationError as exc:
            return _answer(start_response, "400 Bad Request", {"error": str(exc)})
        return _answer(start_response, "200 OK", {"applied": fence.applied})


def _answer(start_response: StartResponse, status: str, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json")])
    return [data]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(service: ReceiptService, port: int = 0) -> WSGIServer:
    """Serve ``service`` on 127.0.0.1 from a daemon thread (``port`` 0 picks one).

    Stop it with ``server.shutdown()`` and ``server.server_close()``.
    """
    server = make_server("127.0.0.1", port, service, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="receipts", daemon=True).start()
    return server


class ReceiptRefused(Exception):
    """The receipt service refused the write (HTTP 409: a newer run wrote)."""


def send_receipt(base_url: str, lease: FencingToken, invoice_id: int, body: dict[str, Any]) -> None:
    """PUT the receipt of ``invoice_id`` with the fencing headers of ``lease``.

    Raises:
        ReceiptRefused: the service holds a receipt of a newer generation.
    """
    request = urllib.request.Request(  # noqa: S310  # the URL is the configured service
        f"{base_url}/receipts/{invoice_id}",
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Content-Type": "application/json", **fencing_headers(lease)},
    )
    try:
        with urllib.request.urlopen(request, timeout=10):  # noqa: S310
            pass
    except urllib.error.HTTPError as exc:
        if exc.code == 409:
            raise ReceiptRefused(exc.read().decode(errors="replace")) from exc
        raise


if __name__ == "__main__":
    # python -m invoices.receipts: the service on port 8000, for workers run by hand
    serve(ReceiptService(), port=8000)
    threading.Event().wait()
