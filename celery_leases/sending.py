"""Send ids: which deliveries are the same run of a job, and which are new.

Celery runs a message sent again with the same task id as a new run (a
retry, ``replace()``, a chain step, a user re-sending on purpose); only a
redelivery of the same message by the broker is the same send. So every
published message gets a fresh send id in the :data:`SEND_ID_HEADER` header
(in ``before_task_publish``, connected when this package is imported), and
the lease record keeps the send id of the run that holds or completed it:

- a delivery whose send id is the completing run's is a redelivery: it is
  skipped and answers its client with the stored result;
- any other send is a new run of the job, serialized by the lease;
- the library's own deferred copy keeps the send id of the message it copies.

Eager and direct calls are always new runs. A message published by a client
that never imported celery_leases has no send id. It is the same run as the
completed one only if it carries the task id that completed the job
(protocol duty 7): under the default key the job id *is* the task id, so
the claim goes without a send id and any completion of the job answers it;
under a custom ``lease_key`` the claim's send id is ``"task:<task id>"``,
and the record keeps the task id of every run beside its send id, so such
a message is skipped when its task id completed the job (whether that
delivery had a send id or not), and a message with another task id under
the same key is a new run.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from celery.signals import before_task_publish

from celery_leases.request import header_of
from celery_leases.stores.base import TASK_ID_SEND_PREFIX

__all__ = [
    "SEND_ID_HEADER",
    "TASK_ID_SEND_PREFIX",
    "keeping_send_id",
    "message_send_id",
    "send_id_for",
    "send_id_of",
]

#: message header holding the send id
SEND_ID_HEADER = "leases_send_id"


class _Local(threading.local):
    keep: str | None = None


_local = _Local()


@contextlib.contextmanager
def keeping_send_id(send_id: str | None) -> Iterator[None]:
    """Publish in this block with ``send_id`` instead of a fresh one (a deferred copy)."""
    previous, _local.keep = _local.keep, send_id or ""
    try:
        yield
    finally:
        _local.keep = previous


def _stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is None:
        return
    keep = _local.keep
    if keep is None:
        headers[SEND_ID_HEADER] = uuid.uuid4().hex
    elif keep:
        headers[SEND_ID_HEADER] = keep
    else:
        headers.pop(SEND_ID_HEADER, None)


before_task_publish.connect(_stamp, weak=False, dispatch_uid="celery_leases.send_id")


def send_id_of(request: Any) -> str | None:
    """The send id of the running delivery; a fresh one for eager and direct calls."""
    if request.is_eager or request.called_directly:
        return uuid.uuid4().hex
    return message_send_id(request)


def message_send_id(request: Any) -> str | None:
    """The send id the running message carries (a copy published again
    keeps it), or None for a message without one."""
    value = header_of(request, SEND_ID_HEADER)
    return str(value) if value else None


def send_id_for(request: Any, job_id: str) -> str | None:
    """The send id the running delivery claims ``job_id`` with.

    The message's own send id; for a message without one, None under the
    default key (``job_id`` is its task id) and ``"task:<task id>"`` under a
    custom key, so only a delivery with the same task id is the same run.
    """
    send_id = send_id_of(request)
    if send_id is None and request.id and job_id != request.id:
        return f"{TASK_ID_SEND_PREFIX}{request.id}"
    return send_id
