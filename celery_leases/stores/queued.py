"""The queued mark: a job of a key is queued and has not started yet.

A sender of a ``lease_queue_unique`` task places the mark before it
publishes; the run that claims the key's lease takes it away again. The
mark names the queued message's task id and runs out by itself at
``queued_until_ms`` on the store's clock, so a message that is lost, or a
sender that died between placing the mark and publishing, blocks the key
for that long at most.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["QueuedMark"]


@dataclass(frozen=True, slots=True)
class QueuedMark:
    """A job queued under ``job_id`` (times in store milliseconds).

    Attributes:
        job_id: the lease key.
        task_id: the Celery task id of the queued message.
        queued_at_ms: when the mark was placed.
        queued_until_ms: when it runs out by itself.
    """

    job_id: str
    task_id: str
    queued_at_ms: int
    queued_until_ms: int
