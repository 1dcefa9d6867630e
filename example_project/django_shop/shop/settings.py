"""Settings of the shop: SQLite in db.sqlite3 and kombu's filesystem broker, no server.

``SHOP_DATA`` moves the data files (default: this folder); ``SHOP_POSTGRES``
(a ``postgresql://user@host:port/name`` URL) puts the database on PostgreSQL,
``SHOP_MYSQL`` (a ``mysql://user:password@host:port/name`` URL) on MySQL or
MariaDB through PyMySQL;
``SHOP_DB_NAME`` names another database on it (the tests start workers on
the test database with it).
"""

import os
from pathlib import Path
from urllib.parse import urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("SHOP_DATA", BASE_DIR)).resolve()

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "insecure-key-of-the-example-only")
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]

# --8<-- [start:apps]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_leases.contrib.django",
    "orders",
]
# --8<-- [end:apps]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "shop.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --8<-- [start:database]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE_DIR / "db.sqlite3",
        # a worker and the web process write the same file: wait for the
        # write lock, and take it when a transaction begins
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
        # tests need a file too: a worker cannot share an in-memory database
        "TEST": {"NAME": BASE_DIR / "test.sqlite3"},
    }
}
# --8<-- [end:database]
# the data files are in SHOP_DATA (the tests keep each run's apart)
DATABASES["default"]["NAME"] = DATA / "db.sqlite3"
DATABASES["default"]["TEST"]["NAME"] = DATA / "test.sqlite3"
if os.environ.get("SHOP_POSTGRES"):
    url = urlsplit(os.environ["SHOP_POSTGRES"])
    DATABASES["default"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": url.path.lstrip("/"),
        "USER": url.username or "",
        "PASSWORD": url.password or "",
        "HOST": url.hostname or "",
        "PORT": str(url.port or ""),
    }
# --8<-- [start:mysql]
import os  # noqa: E402 - imported above too: this part is shown alone

if os.environ.get("SHOP_MYSQL"):
    # Django's MySQL backend imports MySQLdb (mysqlclient, a C extension);
    # PyMySQL stands in for it. PyMySQL answers Django's mysqlclient version
    # check with a version of its own for it (2.2.8 in PyMySQL 1.2), above
    # the 1.4.3 Django 5.2 needs, so no pymysql.version_info is set here.
    import pymysql

    pymysql.install_as_MySQLdb()
    url = urlsplit(os.environ["SHOP_MYSQL"])
    DATABASES["default"] = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": url.path.lstrip("/"),
        "USER": url.username or "",
        "PASSWORD": url.password or "",
        "HOST": url.hostname or "",
        "PORT": str(url.port or ""),
        # the lease table is utf8mb4: so are the test database and its tables
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {"CHARSET": "utf8mb4"},
    }
# --8<-- [end:mysql]
if os.environ.get("SHOP_DB_NAME"):
    DATABASES["default"]["NAME"] = os.environ["SHOP_DB_NAME"]

# --8<-- [start:celery]
BROKER_FOLDER = BASE_DIR / "broker"
CELERY_BROKER_URL = "filesystem://"
# kombu's filesystem transport, writing each message file whole before a
# worker can take it (kombu's own can hand out a file still being written),
# and keeping it until the worker acknowledges it
CELERY_BROKER_TRANSPORT = "celery_leases.filesystem:Transport"
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "data_folder_in": str(BROKER_FOLDER / "messages"),
    "data_folder_out": str(BROKER_FOLDER / "messages"),
    "store_processed": True,
    "processed_folder": str(BROKER_FOLDER / "processed"),
    "control_folder": str(BROKER_FOLDER / "control"),
    "polling_interval": 0.1,  # seconds between looks into the folder
}
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False  # the filesystem broker has no fan-out
CELERY_TASK_ACKS_LATE = True
CELERY_RESULT_BACKEND = f"db+sqlite:///{BASE_DIR / 'results.sqlite3'}"

CELERY_LEASES_STORE = "django://default"  # the lease table of the migration
CELERY_LEASES_TTL = 3  # renewed every second while a task runs
# --8<-- [end:celery]
BROKER_FOLDER = DATA / "broker"
for option in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
    folder = Path(CELERY_BROKER_TRANSPORT_OPTIONS[option]).name
    CELERY_BROKER_TRANSPORT_OPTIONS[option] = str(BROKER_FOLDER / folder)
CELERY_RESULT_BACKEND = f"db+sqlite:///{DATA / 'results.sqlite3'}"
for folder in ("messages", "processed", "control"):
    (BROKER_FOLDER / folder).mkdir(parents=True, exist_ok=True)
