# --8<-- [start:init]
# the Celery app is made when Django starts, so @shared_task uses it
from shop.celery import app as celery_app

__all__ = ["celery_app"]
# --8<-- [end:init]
