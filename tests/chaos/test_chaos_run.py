"""Real chaos runs: workers, a nemesis and the checker (``python -m chaos``).

The short CI profile runs in the test command: three real workers (two
prefork, one threads pool; two with their wall clock 300 s off), 24 leased
jobs writing through a fenced SQL row and a fenced Redis stream, and a
seeded nemesis that pauses pool processes and whole workers past their
lease, kills them, sends duplicates, partitions the workers from the store
and kills the store; the checker must find no violation. The green profile
does the same, shorter, on two gevent workers whose runs hold the hub. The
once profile's jobs end with an exactly-once row in the store's database,
on PostgreSQL and on MariaDB (about 40 s each).

The broken variants each need a run of their own (about 30 s each), so
they run when ``LEASES_CHAOS_VARIANTS=1`` is set; the checker's detection
of each one is also shown on hand-made histories in ``test_checker.py``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from chaos.checker import Report
from chaos.runner import PROFILES, run
from tests.conftest import IN_CI
from tests.servers import ServerMissing, find_postgres_bin

SEED = int(os.environ.get("LEASES_CHAOS_SEED", "1"))


@pytest.fixture(autouse=True)
def _servers_present() -> None:
    try:
        find_postgres_bin()
        if shutil.which("redis-server") is None:
            raise ServerMissing("redis-server is not installed")
    except ServerMissing as exc:
        if IN_CI:
            pytest.fail(f"{exc} (CI=true: a missing server fails the run)")
        pytest.skip(str(exc))


def _assert_no_violation_under_every_fault(report: Report) -> None:
    print(report.format())
    assert report.ok, report.format()
    counts = report.counts
    # the faults happened and the workers really raced
    for fault in ("pause-child", "pause-worker", "kill-child", "partition", "store-restart"):
        assert counts[fault] >= 1, f"no {fault} injected:\n{report.format()}"
    assert counts["duplicate"] >= 1
    assert counts["attempts"] > counts["jobs"], "no job was claimed twice"
    assert counts["deliveries found HeldElsewhere"] >= 1


@pytest.mark.timeout(360)
def test_the_ci_profile_under_faults_has_no_violation(tmp_path: Path) -> None:
    report = run(PROFILES["ci"], store_kind="redis", seed=SEED, out=tmp_path, log=print)
    _assert_no_violation_under_every_fault(report)


@pytest.mark.skipif(
    os.environ.get("LEASES_CHAOS_AMQP") != "1",
    reason="the ci profile on a RabbitMQ broker (about 2 min): set LEASES_CHAOS_AMQP=1",
)
@pytest.mark.timeout(420)
def test_the_ci_profile_on_rabbitmq_has_no_violation(tmp_path: Path) -> None:
    try:
        report = run(
            PROFILES["ci"], store_kind="redis", seed=SEED, out=tmp_path, broker_kind="amqp",
            log=print,
        )  # fmt: skip
    except ServerMissing as exc:
        if IN_CI:
            pytest.fail(f"{exc} (CI=true: a missing server fails the run)")
        pytest.skip(str(exc))
    _assert_no_violation_under_every_fault(report)


@pytest.mark.timeout(240)
def test_the_green_profile_on_gevent_has_no_violation(tmp_path: Path) -> None:
    """Two gevent workers (one with its wall clock 300 s off), 14 jobs, and
    the ci profile's faults but those on pool processes, which gevent has
    none of. Every run first holds the hub past its lease's safe duration
    (chaos.app): renewals must land meanwhile (H), and every job complete."""
    report = run(
        PROFILES["green"], store_kind="redis", seed=SEED, out=tmp_path, pool="gevent", log=print
    )
    print(report.format())
    assert report.ok, report.format()
    counts = report.counts
    for fault in ("pause-worker", "partition", "store-restart", "duplicate"):
        assert counts[fault] >= 1, f"no {fault} injected:\n{report.format()}"
    assert counts["hub holds"] >= counts["jobs"], "a run did not hold the hub"
    assert counts["hub holds renewed meanwhile"] >= 1


def _run_or_skip(profile: str, store_kind: str, tmp_path: Path, **kwargs: Any) -> Report:
    """Run ``profile``; skip (fail in CI) when its store's server is not installed."""
    try:
        return run(PROFILES[profile], store_kind=store_kind, seed=SEED, out=tmp_path, **kwargs)
    except ServerMissing as exc:
        if IN_CI:
            pytest.fail(f"{exc} (CI=true: a missing server fails the run)")
        pytest.skip(str(exc))


#: the SQL stores the once profile runs on: its effects live in their database
ONCE_STORES = pytest.mark.parametrize("store_kind", ["postgres", "mysql"])


@pytest.mark.timeout(300)
@ONCE_STORES
def test_the_once_profile_applies_every_effect_exactly_once(
    tmp_path: Path, store_kind: str
) -> None:
    """Jobs end with an exactly-once row in the store's database (PostgreSQL
    or MariaDB); each is killed at one step (before, inside, after the
    commit, after the result) besides the nemesis's faults, a restart of
    the store among them; each row count must be 1."""
    report = _run_or_skip("once", store_kind, tmp_path, log=print)
    print(report.format())
    assert report.ok, report.format()
    counts = report.counts
    assert counts["jobs with 1 effect rows"] == counts["jobs"] == PROFILES["once"].jobs
    for step in ("before", "inside", "after-commit", "after-result"):
        assert counts[f"self-kills {step}"] >= 1, f"no kill {step}:\n{report.format()}"
    for fault in ("pause-child", "duplicate", "store-restart"):
        assert counts[fault] >= 1, f"no {fault} injected:\n{report.format()}"


VARIANTS = {
    "complete-without-generation": "I3",
    "expiring-generation": "I1",
    "unfenced-target": "I5",
    "renew-without-owner": "I4",
    "worker-clock-claim": "I2",
    "ignore-deadline": "D",
}


@pytest.mark.skipif(
    os.environ.get("LEASES_CHAOS_VARIANTS") != "1",
    reason="a run per broken variant (about 3 min in all): set LEASES_CHAOS_VARIANTS=1",
)
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("variant", "invariant"), sorted(VARIANTS.items()))
def test_the_checker_catches_a_broken_variant(tmp_path: Path, variant: str, invariant: str) -> None:
    report = run(PROFILES["variant"], store_kind="redis", seed=SEED, out=tmp_path, variant=variant)
    assert any(v.startswith(f"{invariant} ") for v in report.violations), report.format()


@pytest.mark.skipif(
    os.environ.get("LEASES_CHAOS_VARIANTS") != "1",
    reason="a run per SQL store (about 1 min each): set LEASES_CHAOS_VARIANTS=1",
)
@pytest.mark.timeout(300)
@ONCE_STORES
def test_the_checker_catches_writes_committed_apart_from_the_completion(
    tmp_path: Path, store_kind: str
) -> None:
    report = _run_or_skip("once", store_kind, tmp_path, variant="separate-commit")
    assert any(v.startswith("I7 ") for v in report.violations), report.format()
