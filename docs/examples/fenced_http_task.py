"""A leased task that writes to an HTTP service with its fencing token.

The service is ``fenced_service.py`` beside this file (``python
fenced_service.py`` serves it on port 8000). Needs ``pip install
'celery-leases[http,redis]'``: httpx for the request, Redis for the broker
and the lease store. ``FENCING_BROKER``, ``FENCING_STORE`` and
``FENCING_SERVICE`` move them (the tests set them).
"""

import os

import httpx
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.fencing.http import FencingAuth, fencing_headers

app = Celery("publisher", broker=os.environ.get("FENCING_BROKER", "redis://localhost:6379/0"))
app.conf.leases_store = os.environ.get("FENCING_STORE", "redis://localhost:6379/1")
SERVICE = os.environ.get("FENCING_SERVICE", "http://127.0.0.1:8000")


@app.task(base=LeasedTask, bind=True, shared=False)  # only this app runs it
def publish(self: LeasedTask, name: str, body: str) -> int:
    response = httpx.put(f"{SERVICE}/values/{name}", content=body, auth=FencingAuth(self.lease))
    response.raise_for_status()
    # any other client: send these headers yourself
    assert fencing_headers(self.lease)["Idempotency-Key"] == self.lease.idempotency_key
    return response.status_code
