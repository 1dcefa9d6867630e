# --8<-- [start:celery]
import os

from celery import Celery

from celery_leases import install

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
# every CELERY_* setting of settings.py: CELERY_LEASES_TTL is leases_ttl
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
install(app)  # --leases-store and --leases-ttl for `celery worker`, checks at start
# --8<-- [end:celery]
