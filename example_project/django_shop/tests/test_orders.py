"""The shop's leased tasks, run by the plugin's in-process worker on the test database."""

# --8<-- [start:tests]
from typing import Any

import pytest
from orders.models import Order
from orders.tasks import charge

from celery_leases import StaleFencingToken
from celery_leases.contrib.django.fencing import fenced_update
from celery_leases.contrib.django.models import Lease
from celery_leases.fencing import Token


# the worker's connections see only what the test commits: transaction=True
@pytest.mark.django_db(transaction=True)
def test_a_charge_is_written_with_the_lease_generation(leases_worker: Any) -> None:
    order = Order.objects.create()
    generation = charge.delay(order.pk).get(timeout=10)
    order.refresh_from_db()
    assert (order.status, order.fence_generation) == ("charged", generation)
    lease = Lease.objects.get(generation=generation)
    assert (lease.state, lease.task_name) == ("completed", "orders.tasks.charge")


@pytest.mark.django_db(transaction=True)
def test_a_write_of_an_older_generation_is_refused(leases_worker: Any) -> None:
    order = Order.objects.create()
    generation = charge.delay(order.pk).get(timeout=10)
    lease = Lease.objects.get(generation=generation)
    with pytest.raises(StaleFencingToken):
        fenced_update(
            Order.objects.filter(pk=order.pk), Token(lease.job_id, generation - 1), status="open"
        )
    order.refresh_from_db()
    assert order.status == "charged"


# --8<-- [end:tests]
