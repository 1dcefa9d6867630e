"""The per-thread chain of running leased bodies (celery_leases.runs)."""

from __future__ import annotations

import threading
from typing import Any

from celery_leases import runs
from celery_leases.lease import Lease
from celery_leases.settings import LeaseTiming
from celery_leases.stores.memory import MemoryStore


def _lease(job_id: str) -> Lease:
    return Lease(
        job_id=job_id,
        owner="w",
        generation=1,
        lease_until_ms=0,
        started_at=0.0,
        store=MemoryStore(),
        timing=LeaseTiming(ttl=10.0, renew_interval=3.0, drift_margin=0.5),
    )


def _run(name: str, request: Any = None) -> runs.Run:
    return runs.Run(name, _lease(name), request if request is not None else object())


def test_nested_runs_are_seen_innermost_first_and_leave_nothing_behind() -> None:
    outer, inner = _run("outer"), _run("inner")
    runs.push(outer)
    runs.push(inner)
    assert [run.task_name for run in runs.innermost()] == ["inner", "outer"]
    assert runs.running(outer.request)
    runs.pop(inner)
    assert [run.task_name for run in runs.innermost()] == ["outer"]
    assert not runs.running(inner.request)
    runs.pop(outer)
    assert list(runs.innermost()) == []
    # a thread with nothing running keeps no entry (a running task costs one entry)
    assert threading.get_ident() not in runs._innermost


def test_ending_a_run_that_is_not_innermost_unlinks_it() -> None:
    first, second, third = _run("first"), _run("second"), _run("third")
    for run in (first, second, third):
        runs.push(run)
    runs.pop(second)
    assert [run.task_name for run in runs.innermost()] == ["third", "first"]
    runs.pop(second)  # ended twice: nothing changes
    assert [run.task_name for run in runs.innermost()] == ["third", "first"]
    runs.pop(third)
    runs.pop(first)
    assert list(runs.innermost()) == []


def test_each_thread_sees_only_its_own_runs() -> None:
    mine = _run("mine")
    runs.push(mine)
    seen: list[list[str]] = []
    started, done = threading.Event(), threading.Event()

    def other() -> None:
        theirs = _run("theirs")
        runs.push(theirs)
        seen.append([run.task_name for run in runs.innermost()])
        started.set()
        done.wait(10)
        runs.pop(theirs)

    thread = threading.Thread(target=other)
    thread.start()
    assert started.wait(10)
    assert [run.task_name for run in runs.innermost()] == ["mine"]
    done.set()
    thread.join(10)
    runs.pop(mine)
    assert seen == [["theirs"]]
    assert runs._innermost == {}
