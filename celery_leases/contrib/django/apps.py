"""The Django application: registers ``django://`` and the system checks at start."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryLeasesConfig(AppConfig):
    """``celery_leases.contrib.django`` in ``INSTALLED_APPS``."""

    name = "celery_leases.contrib.django"
    label = "celery_leases"
    verbose_name = "Celery leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery_leases.contrib.django import checks, store

        store.register()
        checks.register()
