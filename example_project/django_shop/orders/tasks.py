"""The shop's leased tasks."""

# --8<-- [start:tasks]
import time
from pathlib import Path

from celery import shared_task
from celery.utils.log import get_task_logger

from celery_leases import LeasedTask, StaleFencingToken
from celery_leases.contrib.django.fencing import fenced_update
from orders.models import Order


@shared_task(base=LeasedTask, bind=True)
def charge(self: LeasedTask, order_id: int) -> int:
    """Mark an order charged, unless a newer run of this job wrote it already."""
    fenced_update(Order.objects.filter(pk=order_id), self.lease, status="charged")
    return self.lease.generation


# --8<-- [end:tasks]

logger = get_task_logger(__name__)


@shared_task(base=LeasedTask, bind=True)
def pack(self: LeasedTask, order_id: int, go_file: str) -> int:
    """Mark an order picking, wait until ``go_file`` exists, then mark it packed.

    The tests hold a run between its two writes with ``go_file``.
    """
    fenced_update(Order.objects.filter(pk=order_id), self.lease, status="picking")
    deadline = time.monotonic() + 60
    while not Path(go_file).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        fenced_update(Order.objects.filter(pk=order_id), self.lease, status="packed")
    except StaleFencingToken as refused:
        # a newer run wrote the order: this run stops, the library fences it out
        logger.warning("order %s not packed: %s", order_id, refused)
        raise
    return self.lease.generation
