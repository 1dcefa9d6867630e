# --8<-- [start:model]
from django.db import models


class Order(models.Model):
    status = models.CharField(max_length=20, default="open")
    # the newest generation that wrote the row; the fenced helpers compare it
    fence_generation = models.BigIntegerField(null=True)


# --8<-- [end:model]


# --8<-- [start:shipment]
class Shipment(models.Model):
    """One shipment per order, written exactly once by ``orders.tasks.ship``."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    job_id = models.CharField(max_length=255)
    generation = models.BigIntegerField()


# --8<-- [end:shipment]
