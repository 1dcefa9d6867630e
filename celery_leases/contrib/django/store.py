"""The store URL ``django://<alias>``: the SQL store on a ``DATABASES`` entry.

``CELERY_LEASES_STORE = "django://default"`` opens
:class:`~celery_leases.stores.sql.SqlStore` on the database Django's
``default`` alias names, connecting with Django's own connection
parameters (every ``DATABASES`` entry that works for Django works for the
store), with an engine of its own (the store's
connections keep their own timeouts and never join a request's
transaction). The table comes from the migration, so the store does not
create it unless ``create_table=True`` is among the store options.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from celery_leases.errors import LeaseConfigurationError
from celery_leases.stores import register_scheme
from celery_leases.stores.sql import SqlStore
from celery_leases.urls import url_scheme

__all__ = [
    "MIGRATE",
    "SCHEME",
    "connection_arguments",
    "database_alias",
    "open_django_store",
    "register",
]

SCHEME = "django"
#: what makes the lease table of a django:// store: the app's migration
MIGRATE = "manage.py migrate"

#: Django's database engines and the SQLAlchemy drivers the store uses
_DRIVERS = {
    "django.db.backends.sqlite3": "sqlite",
    "django.db.backends.postgresql": "postgresql+psycopg",
    "django.db.backends.mysql": "mysql+pymysql",
}

#: Django's connection parameters that shape how Python reads results, not
#: where or how the driver connects: SQLAlchemy's dialects set their own.
#: (psycopg's prepare_threshold stays: Django's None keeps poolers working.)
_READING_ONLY = {
    "sqlite": ("detect_types",),
    "postgresql+psycopg": ("context", "cursor_factory"),
    "mysql+pymysql": ("conv",),
}


def database_alias(url: str) -> str:
    """The ``DATABASES`` alias a ``django://<alias>`` URL names (``default`` when none).

    Raises:
        LeaseConfigurationError: ``url`` is not such a URL, or the alias is
            not in ``DATABASES``.
    """
    if url_scheme(url) != SCHEME:
        raise LeaseConfigurationError(f"{url!r} is not a django://<alias> URL")
    alias = url.split("://", 1)[1].strip("/") or "default"
    if alias not in settings.DATABASES:
        raise LeaseConfigurationError(
            f"the lease store {url!r} names the database alias {alias!r}, which is not in "
            f"DATABASES (aliases: {sorted(settings.DATABASES)})"
        )
    return alias


def connection_arguments(alias: str = "default") -> tuple[sa.URL, dict[str, Any]]:
    """How Django connects to the ``DATABASES`` entry ``alias``, for SQLAlchemy.

    The connection parameters are Django's own
    (``connections[alias].get_connection_params()``: ``HOST`` and ``PORT``,
    a socket folder as ``HOST`` included, and every ``OPTIONS`` entry it
    passes on, such as ``options``, ``service``, ``sslmode``, ``sslrootcert``
    or ``target_session_attrs``), less those that only shape how Python reads
    results (Django's cursor classes, adapters and converters: SQLAlchemy's
    dialect brings its own). They are meant for
    ``sqlalchemy.create_engine(url, connect_args=arguments)``: the URL names
    the driver, and the database, host and user where a URL can hold them,
    for messages; it has no password, and the arguments override it.

    Uses the entry as the connection has it now, so under a test runner it
    is the test database.

    Raises:
        LeaseConfigurationError: the alias is unknown, or its engine is
            not SQLite, PostgreSQL or MySQL/MariaDB, or it is an in-memory SQLite
            database.
    """
    connection = connections[alias]
    entry = connection.settings_dict
    driver = _DRIVERS.get(str(entry.get("ENGINE", "")))
    if driver is None:
        raise LeaseConfigurationError(
            f"the lease store on DATABASES[{alias!r}] needs the sqlite3, postgresql or "
            f"mysql engine, not {entry.get('ENGINE')!r}"
        )
    if driver == "sqlite" and connection.creation.is_in_memory_db(entry.get("NAME")):
        raise LeaseConfigurationError(
            f"DATABASES[{alias!r}] is an in-memory SQLite database, private to one "
            "connection: workers cannot share it. Under a test runner set "
            f"DATABASES[{alias!r}]['TEST']['NAME'] to a file"
        )
    try:
        arguments = dict(connection.get_connection_params())
    except ImproperlyConfigured as error:
        raise LeaseConfigurationError(f"DATABASES[{alias!r}]: {error}") from None
    for name in _READING_ONLY[driver]:
        arguments.pop(name, None)
    if driver == "sqlite":
        # the file is the URL's (sqlite3.connect takes it as its first argument)
        return sa.URL.create(driver, database=str(arguments.pop("database"))), arguments
    host = str(entry.get("HOST") or "")
    url = sa.URL.create(
        driver,
        username=entry.get("USER") or None,
        # a socket folder cannot be a URL's host; the arguments carry it
        host=host if host and not host.startswith("/") else None,
        port=int(entry["PORT"]) if entry.get("PORT") else None,
        database=entry.get("NAME") or None,
    )
    return url, arguments


def open_django_store(url: str, **options: Any) -> SqlStore:
    """Open the SQL store on the database ``url`` (``django://<alias>``) names,
    connecting as Django does (:func:`connection_arguments`).

    Raises:
        LeaseConfigurationError: see :func:`connection_arguments`.
    """
    options.setdefault("create_table", False)
    target, arguments = connection_arguments(database_alias(url))
    connect_args = {**arguments, **options.pop("connect_args", {})}
    return SqlStore.from_url(target.render_as_string(), connect_args=connect_args, **options)


def register() -> None:
    """Let ``open_store`` open ``django://`` URLs; called when Django starts the app."""
    register_scheme(SCHEME, open_django_store, table_maker=MIGRATE)
