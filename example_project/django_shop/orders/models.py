# --8<-- [start:model]
from django.db import models


class Order(models.Model):
    status = models.CharField(max_length=20, default="open")
    # the newest generation that wrote the row; the fenced helpers compare it
    fence_generation = models.BigIntegerField(null=True)


# --8<-- [end:model]
