"""Tests of celery_leases.contrib.django, run by pytest-django in a process of their own.

``tests/integration/test_django.py`` runs them (with the shop's tests) on
SQLite, on PostgreSQL and on MariaDB; by hand::

    python -m pytest -c example_project/django_shop/pytest.ini
"""
