"""A password in the lease store URL shows up nowhere: ``celery inspect conf``,
Flower's worker page and API, the worker banner and log, lease events, and the
errors and warnings of an unreachable store."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_leases import StoreUnavailable, open_store
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import REPO_ROOT, Worker, wait_until
from tests.acceptance.test_flower import Flower

SECRET = "Pw-0f-the-Lease-Store"


def with_password(url: str) -> str:
    """``url`` with ``SECRET`` as its password (the test servers ignore it)."""
    scheme, rest = url.split("://", 1)
    user, _, host = rest.rpartition("@")
    return f"{scheme}://{user or ''}:{SECRET}@{host}"


@pytest.fixture
def flower(cluster: Cluster, tmp_path: Path) -> Iterator[Flower]:
    started = Flower(cluster, tmp_path)
    try:
        yield started
    finally:
        started.stop()
        # the test's AsyncResults sit in reference cycles and talk to the result
        # backend when collected: collect them while the servers are up
        gc.collect()


def inspect_conf(cluster: Cluster, worker: Worker) -> str:
    """``celery inspect conf`` of one worker, as the CLI prints it."""
    done = subprocess.run(
        [
            sys.executable, "-m", "celery", "-A", "tests.acceptance.app", "inspect", "conf",
            "-d", worker.hostname.replace("%h", os.uname().nodename), "--timeout", "10",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, **cluster.config.to_env(), "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        timeout=60,
        check=True,
    )  # fmt: skip
    return done.stdout.decode() + done.stderr.decode()


@pytest.mark.parametrize("lease_store_target", ["postgres"], indirect=True)
def test_the_store_password_is_shown_nowhere(
    cluster: Cluster, flower: Flower, tmp_path: Path
) -> None:
    cluster.configure(store=with_password(cluster.config.store))
    worker = cluster.worker("a", extra_args=("-E",))
    result = cluster.send(STEPS, 0.1)
    value = result.get(timeout=30)
    info = flower.wait_task(result.id, timeout=30, lease_ran_on=value["worker"])

    conf = inspect_conf(cluster, worker)
    assert "leases_store" in conf
    assert "********" in conf
    nodename = value["worker"]
    flower_conf = wait_until(
        lambda: json.loads(flower.get("/api/workers?refresh=1")).get(nodename, {}).get("conf"),
        timeout=30,
        message="Flower to load the worker's configuration",
    )
    assert "leases_store" in flower_conf
    seen = {
        "celery inspect conf": conf,
        "Flower's worker API": json.dumps(flower_conf),
        "Flower's worker page": flower.get(f"/worker/{nodename}"),
        "Flower's task info": json.dumps(info),
        "the worker banner and log": worker.log(),
    }
    # the Config tab is rendered on the server, with the lease settings in it
    assert "leases_store" in seen["Flower's worker page"]
    for place, text in seen.items():
        assert SECRET not in text, f"the store password shows in {place}"


def test_an_unreachable_store_hides_its_password_in_errors_and_logs(cluster: Cluster) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:1/0"  # nothing listens on port 1
    with pytest.raises(StoreUnavailable) as caught:
        open_store(url).claim("job", "owner", 5.0)
    assert SECRET not in str(caught.value)
    assert SECRET not in repr(caught.value)

    cluster.configure(store=url, store_options={})
    worker = cluster.worker("a", extra_args=("-E",))
    result = cluster.send(STEPS, 0.1)
    worker.wait_for_log(rf"{result.id}.*store unavailable", timeout=30)
    log = worker.log()
    assert "redis://:***@127.0.0.1:1/0" in log  # the store names itself, masked
    assert SECRET not in log
    assert SECRET not in inspect_conf(cluster, worker)
