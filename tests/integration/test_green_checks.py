"""The worker's start checks for the gevent and eventlet pools, in processes
that monkey-patched themselves first, as ``celery worker -P gevent`` does.

A store that would renew in the hub, or ``lease_on_lost`` "raise" or
"stop", stops the worker at start with a message naming what to use.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.acceptance.harness import REPO_ROOT

#: run in a fresh process: patch, then check an app for each (url, on_lost)
_CHECK = """
import json, sys
pool, cases = sys.argv[1], json.loads(sys.argv[2])
if pool == "gevent":
    from gevent import monkey
    monkey.patch_all()
else:
    import eventlet
    eventlet.monkey_patch()
from celery import Celery
from celery_leases import LeaseConfigurationError, LeasedTask
from celery_leases.worker import check_app
results = []

def job(self):
    pass

for url, on_lost in cases:
    app = Celery("green-checks", set_as_current=False)
    app.conf.leases_store = url
    app.conf.leases_on_lost = on_lost
    app.task(shared=False, base=LeasedTask, bind=True, name="green.job")(job)
    app.finalize()
    try:
        results.append({"warnings": check_app(app, pool=pool, store_timeout=2.0)})
    except LeaseConfigurationError as exc:
        results.append({"error": str(exc)})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, Any]]]:
    """What the start checks said, per pool, per case (one process per pool)."""
    folder = tmp_path_factory.mktemp("green")
    cases = {
        "raise": ("memory://", "raise"),
        "stop": ("memory://", "stop"),
        "redis": ("redis://127.0.0.1:1/0", "flag"),  # nothing listens on port 1
        "tls": ("rediss://127.0.0.1:1/0", "flag"),
        "sqlite": (f"sqlite:///{folder}/leases.db", "flag"),
    }
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for pool in ("gevent", "eventlet"):
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _CHECK, pool, json.dumps(list(cases.values()))],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        results = json.loads(done.stdout.strip().splitlines()[-1])
        found[pool] = dict(zip(cases, results, strict=True))
    return found


POOLS = pytest.mark.parametrize("pool", ["gevent", "eventlet"])


@POOLS
@pytest.mark.parametrize("on_lost", ["raise", "stop"])
def test_raise_and_stop_are_refused_on_a_green_pool(
    checked: dict[str, dict[str, dict[str, Any]]], pool: str, on_lost: str
) -> None:
    error = str(checked[pool][on_lost]["error"])
    assert f"lease_on_lost={on_lost!r}" in error
    assert f"the {pool} pool cannot honour" in error
    assert "lease_on_lost='flag'" in error
    assert "self.lease.check()" in error


@POOLS
def test_a_plain_redis_store_and_flag_pass(
    checked: dict[str, dict[str, dict[str, Any]]], pool: str
) -> None:
    result = checked[pool]["redis"]
    assert "error" not in result, result
    # unreachable: only the usual warning, no refusal
    assert any("cannot be reached now" in warning for warning in result["warnings"])


@POOLS
@pytest.mark.parametrize("case", ["tls", "sqlite"])
def test_a_store_that_would_renew_in_the_hub_is_refused(
    checked: dict[str, dict[str, dict[str, Any]]], pool: str, case: str
) -> None:
    error = str(checked[pool][case]["error"])
    assert f"cannot renew leases outside the {pool} hub" in error
    assert "plain redis:// or unix:// lease store" in error
