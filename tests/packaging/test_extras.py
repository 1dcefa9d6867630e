"""Each extra, installed from the built wheel into an empty virtualenv, runs what it promises.

The package a user installs is the wheel, not this checkout: each test makes
a fresh virtualenv outside the checkout, installs ``celery_leases-*.whl[extra]``
and nothing else, and runs a small program there (no ``PYTHONPATH`` pointing
back here). ``[redis]`` must start a worker on a Redis broker and run a
leased task on a Redis store; ``[postgres]`` must claim and complete on a
PostgreSQL store, ``[mysql]`` on a MariaDB store; and so on. The pip cache makes a repeat run quick.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.packaging.steps import ROOT
from tests.packaging.steps import clean_env as _env
from tests.packaging.steps import run_step as _run
from tests.servers import MariadbServer, PostgresServer, RedisServer

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

#: extras for the people who work on celery-leases, not for its users
DEVELOPER_EXTRAS = {"dev", "bench", "docs"}


class Venv:
    """An empty virtualenv with the wheel and one extra installed."""

    def __init__(self, folder: Path, wheel: Path, extra: str) -> None:
        self.folder = folder
        # no pip of its own: this pip installs into it (quicker, and the venv holds
        # only the wheel and what its extra brings)
        _run([sys.executable, "-m", "venv", "--without-pip", str(folder / "venv")], cwd=folder)
        self.python = folder / "venv" / "bin" / "python"
        install = ["-m", "pip", "--python", str(self.python), "install", "-q"]
        _run([sys.executable, *install, f"{wheel}[{extra}]"], cwd=folder)
        # the probes import the installed package, never this checkout's
        where = _run(
            [str(self.python), "-c", "import celery_leases; print(celery_leases.__file__)"], folder
        )
        assert str(folder / "venv") in where, where

    def script(self, name: str, text: str) -> Path:
        path = self.folder / name
        path.write_text(textwrap.dedent(text))
        return path

    def run(self, name: str, text: str, *args: str, env: dict[str, str] | None = None) -> str:
        """Run ``text`` as the program ``name`` with the venv's Python; its output."""
        path = self.script(name, text)
        return _run([str(self.python), str(path), *args], cwd=self.folder, env=env)


@pytest.fixture
def venv(request: pytest.FixtureRequest, tmp_path: Path, wheel: Path) -> Venv:
    return Venv(tmp_path, wheel, request.param)


CLAIM_AND_COMPLETE = """
    import sys
    from celery_leases import Acquired, Completed, open_store

    store = open_store(sys.argv[1])
    try:
        claim = store.claim("extra-job", "probe-owner", 30)
        assert isinstance(claim, Acquired), claim
        done = store.complete("extra-job", "probe-owner", claim.generation)
        assert isinstance(done, Completed), done
        print("completed generation", claim.generation)
    finally:
        store.close()
"""


def test_every_user_extra_is_tested() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    tested = {"redis", "sqlalchemy", "postgres", "mysql", "http", "metrics", "flower", "django"}
    assert set(extras) - DEVELOPER_EXTRAS == tested


@pytest.mark.redis
@pytest.mark.parametrize("venv", ["redis"], indirect=True)
def test_redis_extra_runs_a_worker_on_a_redis_broker(venv: Venv, redis_server: RedisServer) -> None:
    venv.script(
        "extra_app.py",
        """
        import os
        from celery import Celery
        from celery_leases import LeasedTask

        app = Celery("extra_app", broker=os.environ["URL"], backend=os.environ["URL"])
        app.conf.leases_store = os.environ["URL"]
        app.conf.leases_store_options = {"prefix": "extra-probe:"}

        @app.task(base=LeasedTask)
        def add(a, b):
            return a + b
        """,
    )
    env = _env(URL=redis_server.url.replace("/0", "/14"))
    celery = venv.folder / "venv" / "bin" / "celery"
    log = (venv.folder / "worker.log").open("w")
    worker = subprocess.Popen(
        [str(celery), "-A", "extra_app", "worker", "-P", "solo", "-Q", "extra-probe", "-l", "info"],
        cwd=venv.folder, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        out = venv.run(
            "send.py",
            """
            from extra_app import add
            print("result", add.apply_async((2, 3), queue="extra-probe").get(timeout=120))
            """,
            env=env,
        )
        assert "result 5" in out, (venv.folder / "worker.log").read_text()
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
        log.close()


@pytest.mark.postgres
@pytest.mark.parametrize("venv", ["postgres"], indirect=True)
def test_postgres_extra_claims_on_a_postgresql_store(
    venv: Venv, postgres_server: PostgresServer
) -> None:
    out = venv.run("probe.py", CLAIM_AND_COMPLETE, postgres_server.url)
    assert "completed generation" in out


@pytest.mark.mysql
@pytest.mark.parametrize("venv", ["mysql"], indirect=True)
def test_mysql_extra_claims_on_a_mariadb_store(venv: Venv, mariadb_server: MariadbServer) -> None:
    out = venv.run("probe.py", CLAIM_AND_COMPLETE, mariadb_server.url)
    assert "completed generation" in out


@pytest.mark.parametrize("venv", ["sqlalchemy"], indirect=True)
def test_sqlalchemy_extra_claims_on_a_sqlite_store(venv: Venv) -> None:
    out = venv.run("probe.py", CLAIM_AND_COMPLETE, f"sqlite:///{venv.folder / 'leases.db'}")
    assert "completed generation" in out


@pytest.mark.parametrize("venv", ["http"], indirect=True)
def test_http_extra_makes_fenced_clients(venv: Venv) -> None:
    out = venv.run(
        "probe.py",
        """
        from celery_leases.fencing import Token
        from celery_leases.fencing.http import fenced_httpx_client, fenced_requests_session

        token = Token("job", 7)
        with fenced_httpx_client(token) as client, fenced_requests_session(token) as session:
            print("clients", type(client).__name__, type(session).__name__)
        """,
    )
    assert "clients Client Session" in out


@pytest.mark.parametrize("venv", ["metrics"], indirect=True)
def test_metrics_extra_counts_lease_signals(venv: Venv) -> None:
    out = venv.run(
        "probe.py",
        """
        from celery import Celery
        from prometheus_client import generate_latest
        from celery_leases import signals
        from celery_leases.metrics import install_metrics, metrics_registry

        install_metrics(Celery("probe"))
        signals.duplicate_deferred.send(sender=None, lease=None, reason="held")
        print(generate_latest(metrics_registry()).decode())
        """,
    )
    assert 'celery_leases_deferred_total{reason="held",task=""} 1.0' in out, out


@pytest.mark.parametrize("venv", ["flower"], indirect=True)
def test_flower_extra_shows_lease_attempts(venv: Venv) -> None:
    out = venv.run(
        "probe.py",
        """
        import celery_leases.flower
        print("installed", celery_leases.flower.install())
        """,
    )
    assert "installed True" in out


@pytest.mark.parametrize("venv", ["django"], indirect=True)
def test_django_extra_migrates_and_opens_a_django_store(venv: Venv) -> None:
    out = venv.run(
        "probe.py",
        """
        import sys

        import django
        from django.conf import settings
        from django.core.management import call_command
        from django.template.loader import get_template

        settings.configure(
            INSTALLED_APPS=[
                "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                "django.contrib.sessions", "django.contrib.messages",
                "celery_leases.contrib.django",
            ],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": sys.argv[1]}},
            TEMPLATES=[{"BACKEND": "django.template.backends.django.DjangoTemplates",
                        "APP_DIRS": True}],
        )
        django.setup()
        call_command("migrate", verbosity=0)
        from celery_leases import open_store
        from celery_leases.contrib.django.models import Lease

        store = open_store("django://default")
        claim = store.claim("extra-job", "probe-owner", 30)
        store.close()
        get_template("admin/celery_leases/lease/force_release.html")
        print("lease", Lease.objects.get(pk="extra-job").generation == claim.generation)
        """,
        str(venv.folder / "db.sqlite3"),
    )
    assert "lease True" in out, out
