"""The store URL ``django://<alias>``: the SQL store on a ``DATABASES`` entry.

``CELERY_LEASES_STORE = "django://default"`` opens
:class:`~celery_leases.stores.sql.SqlStore` on the database Django's
``default`` alias names, with an engine of its own (the store's
connections keep their own timeouts and never join a request's
transaction). The table comes from the migration, so the store does not
create it unless ``create_table=True`` is among the store options.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from django.conf import settings
from django.db import connections

from celery_leases.errors import LeaseConfigurationError
from celery_leases.stores import register_scheme
from celery_leases.stores.sql import SqlStore

__all__ = ["SCHEME", "database_url", "open_django_store", "register"]

SCHEME = "django"

#: Django's database engines and the SQLAlchemy drivers the store uses
_DRIVERS = {
    "django.db.backends.sqlite3": "sqlite",
    "django.db.backends.postgresql": "postgresql+psycopg",
    "django.db.backends.mysql": "mysql+pymysql",
}


def _alias(url: str) -> str:
    if not url.lower().startswith(f"{SCHEME}://"):
        raise LeaseConfigurationError(f"{url!r} is not a django://<alias> URL")
    alias = url.split("://", 1)[1].strip("/") or "default"
    if alias not in settings.DATABASES:
        raise LeaseConfigurationError(
            f"the lease store {url!r} names the database alias {alias!r}, which is not in "
            f"DATABASES (aliases: {sorted(settings.DATABASES)})"
        )
    return alias


def database_url(alias: str = "default") -> sa.URL:
    """The SQLAlchemy URL of the ``DATABASES`` entry ``alias``, password included.

    Uses the entry as the connection has it now, so under a test runner it
    is the test database.

    Raises:
        LeaseConfigurationError: the alias is unknown, or its engine is
            not SQLite, PostgreSQL or MySQL/MariaDB, or it is an in-memory SQLite
            database.
    """
    entry = connections[alias].settings_dict
    driver = _DRIVERS.get(str(entry.get("ENGINE", "")))
    if driver is None:
        raise LeaseConfigurationError(
            f"the lease store on DATABASES[{alias!r}] needs the sqlite3, postgresql or "
            f"mysql engine, not {entry.get('ENGINE')!r}"
        )
    name = str(entry.get("NAME") or "")
    if driver == "sqlite":
        if not name or name == ":memory:" or "mode=memory" in name:
            raise LeaseConfigurationError(
                f"DATABASES[{alias!r}] is an in-memory SQLite database, private to one "
                "connection: workers cannot share it. Under a test runner set "
                f"DATABASES[{alias!r}]['TEST']['NAME'] to a file"
            )
        # an absolute path makes the four slashes of sqlite:////path
        return sa.URL.create("sqlite", database=name)
    options = dict(entry.get("OPTIONS") or {})
    passed = ("sslmode", "application_name") if driver != "mysql+pymysql" else ("charset",)
    query = {k: str(v) for k, v in options.items() if k in passed}
    return sa.URL.create(
        driver,
        username=entry.get("USER") or None,
        password=entry.get("PASSWORD") or None,
        host=entry.get("HOST") or None,
        port=int(entry["PORT"]) if entry.get("PORT") else None,
        database=name or None,
        query=query,
    )


def open_django_store(url: str, **options: Any) -> SqlStore:
    """Open the SQL store on the database ``url`` (``django://<alias>``) names.

    Raises:
        LeaseConfigurationError: see :func:`database_url`.
    """
    options.setdefault("create_table", False)
    target = database_url(_alias(url))
    return SqlStore.from_url(target.render_as_string(hide_password=False), **options)


def register() -> None:
    """Let ``open_store`` open ``django://`` URLs; called when Django starts the app."""
    register_scheme(SCHEME, open_django_store)
