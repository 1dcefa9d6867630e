"""The shop's leased tasks."""

# --8<-- [start:tasks]
import time
from pathlib import Path

from celery import shared_task
from celery.utils.log import get_task_logger

from celery_leases import LeasedTask, StaleFencingToken
from celery_leases.contrib.django.exactly_once import exactly_once
from celery_leases.contrib.django.fencing import fenced_update
from orders.models import Order, Shipment


@shared_task(base=LeasedTask, bind=True)
def charge(self: LeasedTask, order_id: int) -> int:
    """Mark an order charged, unless a newer run of this job wrote it already."""
    fenced_update(Order.objects.filter(pk=order_id), self.lease, status="charged")
    return self.lease.generation


# --8<-- [end:tasks]

logger = get_task_logger(__name__)


def hold(folder: str, step: str, job_id: str) -> None:
    """Wait at ``step`` until ``<folder>/<step>.go`` exists, once per folder.

    The tests stop, kill or go on with a run held there; without a folder
    (the default) a run never waits.
    """
    if not folder or (Path(folder) / f"{step}.held").exists():
        return
    (Path(folder) / f"{step}.held").touch()
    logger.warning("job %s held at %s", job_id, step)
    deadline = time.monotonic() + 60
    while not (Path(folder) / f"{step}.go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


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


# --8<-- [start:ship]
@shared_task(base=LeasedTask, bind=True)
def ship(self: LeasedTask, order_id: int, hold_in: str = "") -> dict[str, int]:
    """Ship an order: the shipment row and the job's completion commit together."""
    with exactly_once(self, using="default") as tx:
        Shipment.objects.create(
            order_id=order_id, job_id=self.request.id, generation=self.lease.generation
        )
        Order.objects.filter(pk=order_id).update(status="shipped")
        hold(hold_in, "before-commit", self.request.id)
        value = tx.complete({"order": order_id, "generation": self.lease.generation})
    hold(hold_in, "after-commit", self.request.id)
    return value


# --8<-- [end:ship]
