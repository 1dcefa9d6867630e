"""What operators see of real workers: ``celery inspect leases``, the
metrics server of a prefork worker, and the purge task run by a worker."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_leases import LeaseState
from tests.acceptance.app import STEPS
from tests.acceptance.conftest import Cluster
from tests.acceptance.harness import REPO_ROOT, Worker, wait_until
from tests.integration.test_conformance import backdate_completion, wait_for_store_clock
from tests.servers import free_port

OPS_APP = "tests.acceptance.ops_app"


def _worker(
    cluster: Cluster,
    name: str,
    pool: str,
    concurrency: int,
    *,
    extra_args: tuple[str, ...] = (),
    start: bool = True,
    **env: str,
) -> Worker:
    worker = Worker(
        f"{name}-{cluster.config.queue}",
        {**cluster.config.to_env(), **env},
        cluster.log_dir,
        pool=pool,
        concurrency=concurrency,
        queue=cluster.config.queue,
        app=OPS_APP,
        extra_args=extra_args,
    )
    cluster.workers.append(worker)
    return worker.start() if start else worker


def _inspect(cluster: Cluster, worker: Worker) -> list[dict[str, Any]]:
    node = worker.hostname.replace("%h", socket.gethostname())
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", OPS_APP, "inspect", "leases",
         "-d", node, "--timeout", "10", "--json"],
        capture_output=True, text=True, timeout=60, env=worker.env, cwd=REPO_ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    replies = json.loads(result.stdout)
    rows: list[dict[str, Any]] = replies[node]["ok"]
    return rows


@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 2), ("threads", 2)])
def test_inspect_leases_lists_what_each_worker_holds(
    cluster: Cluster, pool: str, concurrency: int
) -> None:
    cluster.configure(ttl=10.0)  # a loaded machine must not make a renewal late
    worker = _worker(cluster, "insp", pool, concurrency)
    results = [cluster.send(STEPS, 6.0) for _ in range(2)]
    for result in results:
        cluster.side.wait_event(result.id, "start", timeout=30)

    rows = _inspect(cluster, worker)
    assert sorted(r["job_id"] for r in rows) == sorted(r.id for r in results)
    # the job id is the task id here: each row names the task that holds it
    assert [r["task_id"] for r in rows] == [r["job_id"] for r in rows]
    for row in rows:
        record = cluster.record(row["job_id"])
        assert record is not None
        assert row["generation"] == record.generation
        assert row["task_name"] == STEPS
        # the default key: the job id is the task id (a pool child's from its record)
        assert row["task_id"] == row["job_id"]
        assert 0 < row["remaining"] <= cluster.config.ttl
        assert not row["lost"]
    assert len({r["pid"] for r in rows}) == 2 if pool == "prefork" else 1

    for result in results:
        result.get(timeout=60)
    assert _inspect(cluster, worker) == []


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_two_workers_on_one_host_serve_metrics_on_the_free_ports_they_print(
    cluster: Cluster,
) -> None:
    workers = [
        _worker(cluster, f"port{i}", "prefork", 1, extra_args=("--leases-metrics-port", "0"))
        for i in range(2)
    ]
    # the banner names the page, on this host only unless an address is set
    printed = r"\.> metrics:\s+http://127\.0\.0\.1:(\d+)/metrics"
    ports = [int(worker.wait_for_log(printed, timeout=10)[1]) for worker in workers]
    assert ports[0] != ports[1]
    results = [cluster.send(STEPS, 0.2) for _ in range(4)]
    for result in results:
        result.get(timeout=60)

    def acquired(port: int) -> float:
        return _scrape(port).get(
            ("celery_leases_claims_total", (("outcome", "acquired"), ("task", STEPS))), 0.0
        )

    # each page counts its own worker's claims; together they count every run
    assert wait_until(lambda: sum(map(acquired, ports)) == len(results), timeout=30)
    for worker, port in zip(workers, ports, strict=True):
        # the pool child closed its copy of the listening socket
        listening = _listening_sockets(port)
        assert listening
        children = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()
        assert children
        for child in children:
            assert not listening & _sockets_of(int(child)), f"child {child} holds port {port}"


def test_a_taken_metrics_port_stops_the_worker_at_start(cluster: Cluster) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = _worker(
            cluster,
            "taken",
            "solo",
            1,
            extra_args=("--leases-metrics-port", str(port)),
            start=False,
        )
        with pytest.raises(AssertionError, match="exited before logging"):
            worker.start()
        assert worker.wait_exit(timeout=30) == 1
    assert f"Error: the metrics server cannot listen on 127.0.0.1:{port}" in worker.log()
    assert "Traceback" not in worker.log()


def _listening_sockets(port: int) -> set[str]:
    """``socket:[inode]`` names of the TCP sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                found.add(f"socket:[{fields[9]}]")
    return found


def _sockets_of(pid: int) -> set[str]:
    """``socket:[inode]`` names of the open sockets of process ``pid``."""
    names = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            names.add(os.readlink(fd))
    return {name for name in names if name.startswith("socket:")}


def test_prefork_worker_serves_metrics_of_all_its_children(cluster: Cluster) -> None:
    port = free_port()
    _worker(cluster, "metrics", "prefork", 2, LEASES_TEST_METRICS_PORT=str(port))
    first = cluster.send(STEPS, 2.5)
    cluster.side.wait_event(first.id, "start", timeout=30)
    # the same message again: the other child finds the lease held and defers it
    duplicate = cluster.send(STEPS, 2.5, task_id=first.id)
    second = cluster.send(STEPS, 0.2)
    second.get(timeout=60)
    first.get(timeout=60)
    duplicate.get(timeout=60)

    def settled() -> dict[Any, float] | None:
        samples = _scrape(port)
        held = samples.get(("celery_leases_held", (("task", STEPS),)))
        return samples if held == 0 else None

    samples = wait_until(settled, timeout=30, message="no lease held in the metrics")
    task = ("task", STEPS)
    assert samples[("celery_leases_claims_total", (("outcome", "acquired"), task))] == 2
    assert samples[("celery_leases_claims_total", (("outcome", "held"), task))] >= 1
    assert samples[("celery_leases_deferred_total", (("reason", "held"), task))] >= 1
    # ttl 2 s, renewed every 2/3 s: the 2.5 s run renews at least twice
    assert samples[("celery_leases_renew_seconds_count", (task,))] >= 2
    assert not any(name.startswith("celery_leases_lost") for name, _ in samples)
    assert all("redis://" not in str(labels) for _, labels in samples)


def test_the_purge_task_deletes_old_completed_records(cluster: Cluster) -> None:
    _worker(cluster, "purge", "solo", 1)
    done = cluster.send(STEPS, 0.1)
    kept = cluster.send(STEPS, 0.1)
    done.get(timeout=60)
    kept.get(timeout=60)
    store = cluster.store
    backdate_completion(store, done.id, seconds=120)
    record = store.get(done.id)
    assert record is not None
    wait_for_store_clock(store, record.generation)

    purged = cluster.client.send_task("celery_leases.purge", args=(60,), queue=cluster.config.queue)
    wait_until(lambda: store.get(done.id) is None, timeout=30, message="the purge")
    assert purged.id
    kept_record = store.get(kept.id)
    assert kept_record is not None
    assert kept_record.state is LeaseState.COMPLETED
