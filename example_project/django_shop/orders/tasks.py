"""The shop's leased tasks."""

# --8<-- [start:tasks]
import time
from pathlib import Path

from celery import shared_task

from celery_leases import LeasedTask
from celery_leases.contrib.django.fencing import fenced_update
from orders.models import Order


@shared_task(base=LeasedTask, bind=True)
def charge(self: LeasedTask, order_id: int) -> int:
    """Mark an order charged, unless a newer run of this job wrote it already."""
    fenced_update(Order.objects.filter(pk=order_id), self.lease, status="charged")
    return self.lease.generation


# --8<-- [end:tasks]


@shared_task(base=LeasedTask, bind=True)
def pack(self: LeasedTask, order_id: int, go_file: str) -> int:
    """Mark an order picking, wait until ``go_file`` exists, then mark it packed.

    The tests hold a run between its two writes with ``go_file``.
    """
    fenced_update(Order.objects.filter(pk=order_id), self.lease, status="picking")
    deadline = time.monotonic() + 60
    while not Path(go_file).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    fenced_update(Order.objects.filter(pk=order_id), self.lease, status="packed")
    return self.lease.generation
