"""The acceptance app with the operator features on: metrics and the purge task.

``LEASES_TEST_METRICS_PORT`` turns on the workers' metrics server
(``leases_metrics_port``); ``install`` adds ``--leases-metrics-port`` to
``celery worker``.
"""

from __future__ import annotations

import os

from celery_leases import install
from celery_leases.metrics import install_metrics
from celery_leases.purge import schedule_purge
from tests.acceptance.app import app

__all__ = ["app"]

if os.environ.get("LEASES_TEST_METRICS_PORT"):
    app.conf.leases_metrics_port = int(os.environ["LEASES_TEST_METRICS_PORT"])
install(app)
install_metrics(app)
schedule_purge(app, every=3600, older_than=60)
