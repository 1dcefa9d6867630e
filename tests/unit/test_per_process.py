"""What a process keeps for itself: one object per process, and the job thread.

Every wait is on an event (a flush marker, a job that sets an event, a
thread's end), bounded and generous; a forked child reports through a pipe.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest

from celery_leases.per_process import JobThread, ProcessLocal, ProcessLocalByKey

WAIT = 10.0


@pytest.fixture
def jobs() -> Iterator[JobThread]:
    thread = JobThread("celery-leases-test-jobs")
    yield thread
    thread.stop(WAIT)


def in_forked_child(report: Callable[[], bytes]) -> bytes:
    """Run ``report()`` in a forked child and return what it wrote."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a process with threads; the
        # child runs only the report and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            answer = report()
        except BaseException as exc:  # the parent shows what went wrong
            answer = f"error: {exc!r}".encode()
        os.write(write, answer)
        os._exit(0)
    os.close(write)
    try:
        chunks = []
        while chunk := os.read(read, 4096):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(read)
        os.waitpid(pid, 0)


# --- ProcessLocal --------------------------------------------------------------


class Thing:
    def __init__(self) -> None:
        self.pid = os.getpid()


def test_one_object_per_process() -> None:
    local = ProcessLocal(Thing)
    assert local.made() is None
    first = local.get()
    assert local.get() is first
    assert local.made() is first


def test_forget_makes_a_new_object_next_time() -> None:
    local = ProcessLocal(Thing)
    first = local.get()
    assert local.forget() is first
    assert local.made() is None
    assert local.get() is not first


def test_a_forked_child_gets_an_object_of_its_own() -> None:
    local = ProcessLocal(Thing)
    parent = local.get()

    def report() -> bytes:
        inherited = local.made()
        child = local.get()
        fresh = inherited is None and child is not parent and child.pid == os.getpid()
        return b"fresh" if fresh and local.get() is child else b"stale"

    assert in_forked_child(report) == b"fresh"
    assert local.get() is parent


def test_one_object_per_key_and_process() -> None:
    class Key:
        pass

    one, two = Key(), Key()
    local: ProcessLocalByKey[Key, Thing] = ProcessLocalByKey(lambda key: Thing())
    assert local.made() == []
    first = local.get(one)
    assert local.get(one) is first
    assert local.get(two) is not first
    assert local.forget(one) is first
    assert local.get(one) is not first
    assert len(local.forget_all()) == 2
    assert local.made() == []


def test_a_forked_child_gets_its_own_objects_per_key() -> None:
    class Key:
        pass

    key = Key()
    local: ProcessLocalByKey[Key, Thing] = ProcessLocalByKey(lambda key: Thing())
    parent = local.get(key)

    def report() -> bytes:
        inherited = local.made()
        child = local.get(key)
        return b"fresh" if inherited == [] and child is not parent else b"stale"

    assert in_forked_child(report) == b"fresh"
    assert local.get(key) is parent


# --- JobThread -----------------------------------------------------------------


def test_jobs_run_in_the_order_they_were_submitted(jobs: JobThread) -> None:
    ran: list[int] = []
    for n in range(200):
        assert jobs.submit(ran.append, n)
    assert jobs.flush(WAIT)
    assert ran == list(range(200))


def test_jobs_run_on_the_named_daemon_thread(jobs: JobThread) -> None:
    seen: list[threading.Thread] = []
    jobs.submit(lambda: seen.append(threading.current_thread()))
    assert jobs.flush(WAIT)
    assert seen[0].name == "celery-leases-test-jobs"
    assert seen[0].daemon
    assert seen[0] is not threading.current_thread()


def test_a_failing_job_is_logged_and_the_thread_carries_on(
    jobs: JobThread, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("broken on purpose")

    with caplog.at_level(logging.ERROR, logger="celery_leases"):
        jobs.submit(broken)
        jobs.submit(ran.append, "after")
        assert jobs.flush(WAIT)
    assert ran == ["after"]
    assert jobs.running
    (record,) = [r for r in caplog.records if r.exc_info]
    assert "broken on purpose" in str(record.exc_info[1])  # type: ignore[index]


def test_stop_runs_what_is_queued_then_ends_and_joins_the_thread(jobs: JobThread) -> None:
    gate = threading.Event()
    ran: list[int] = []
    jobs.submit(gate.wait, WAIT)
    for n in range(5):
        jobs.submit(ran.append, n)
    thread = next(t for t in threading.enumerate() if t.name == "celery-leases-test-jobs")
    gate.set()
    jobs.stop(WAIT)
    assert ran == [0, 1, 2, 3, 4]
    assert not thread.is_alive()
    assert not jobs.running


def test_a_job_after_stop_starts_the_thread_again(jobs: JobThread) -> None:
    jobs.submit(lambda: None)
    jobs.stop(WAIT)
    assert not jobs.running
    done = threading.Event()
    jobs.submit(done.set)
    assert done.wait(WAIT)
    assert jobs.running


def test_stop_calls_on_stop_on_the_thread() -> None:
    stopped_on: list[threading.Thread] = []
    jobs = JobThread(
        "celery-leases-test-stop", on_stop=lambda: stopped_on.append(threading.current_thread())
    )
    jobs.submit(lambda: None)
    jobs.stop(WAIT)
    assert [t.name for t in stopped_on] == ["celery-leases-test-stop"]


def test_stop_without_a_thread_does_nothing(jobs: JobThread) -> None:
    jobs.stop(WAIT)
    assert not jobs.running


def test_a_job_beyond_maxsize_is_dropped_and_said_so() -> None:
    jobs = JobThread("celery-leases-test-bounded", maxsize=3)
    gate, started = threading.Event(), threading.Event()
    ran: list[int] = []
    try:
        jobs.submit(lambda: (started.set(), gate.wait(WAIT)))
        assert started.wait(WAIT)  # taken off the queue: it no longer counts
        assert [jobs.submit(ran.append, n) for n in range(4)] == [True, True, True, False]
        assert not jobs.flush(0.05), "the gate holds the thread"
    finally:
        gate.set()
    assert jobs.flush(WAIT)
    assert ran == [0, 1, 2]
    assert jobs.submit(ran.append, 3)
    jobs.stop(WAIT)
    assert ran == [0, 1, 2, 3]


def test_a_forked_child_runs_its_own_jobs_not_the_parents(jobs: JobThread) -> None:
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []
    jobs.submit(lambda: (started.set(), gate.wait(WAIT)))
    jobs.submit(ran.append, "parent")  # queued behind the gate at the fork
    assert started.wait(WAIT)

    def report() -> bytes:
        inherited_running = jobs.running
        jobs.submit(ran.append, "child")
        flushed = jobs.flush(WAIT)
        jobs.stop(WAIT)
        return repr((inherited_running, flushed, ran)).encode()

    try:
        assert in_forked_child(report) == repr((False, True, ["child"])).encode()
    finally:
        gate.set()
    assert jobs.flush(WAIT)
    assert ran == ["parent"]


#: run in a fresh interpreter: the green library patches the process first
_GREEN_QUEUE_CHECK = """
import sys
if sys.argv[1] == "gevent":
    from gevent import monkey
    monkey.patch_all()
else:
    import eventlet
    eventlet.monkey_patch()
import _queue
import queue
from celery_leases import per_process, unpatched
assert unpatched.green_library() == sys.argv[1]
assert queue.SimpleQueue is not _queue.SimpleQueue, "the library left SimpleQueue alone"
assert type(unpatched.simple_queue()) is _queue.SimpleQueue
assert type(per_process._ThreadState().queue) is _queue.SimpleQueue
print("ok")
"""


@pytest.mark.parametrize("library", ["gevent", "eventlet"])
def test_the_job_thread_s_queue_is_the_c_one_under_a_green_library(library: str) -> None:
    """Its ``get`` blocks the OS thread (never the hub), its ``put`` never
    switches greenlets, whatever the library put in ``queue``."""
    assert _in_green_interpreter(_GREEN_QUEUE_CHECK, library) == "ok"


#: greenlets submit jobs before the job thread runs: starting it switches
#: greenlets, and the new thread takes its first job at once
_GREEN_START_CHECK = """
import sys
if sys.argv[1] == "gevent":
    from gevent import monkey
    monkey.patch_all()
else:
    import eventlet
    eventlet.monkey_patch()
import threading
from celery_leases.per_process import JobThread
jobs = JobThread("green-jobs")
ran = []
jobs.submit(ran.append, "hub")
submitters = [threading.Thread(target=jobs.submit, args=(ran.append, n)) for n in range(3)]
for submitter in submitters:
    submitter.start()
for submitter in submitters:
    submitter.join()
assert jobs.flush(10), ran
print(sorted(map(str, ran)))
"""


@pytest.mark.parametrize("library", ["gevent", "eventlet"])
def test_greenlets_that_submit_while_the_job_thread_starts_never_hold_the_hub(
    library: str,
) -> None:
    """Under patching, starting the thread switches greenlets: the thread's
    first job and the other submitters take the state's OS lock meanwhile,
    so the start must not hold it (it did: the hub waited for good)."""
    assert _in_green_interpreter(_GREEN_START_CHECK, library) == "['0', '1', '2', 'hub']"


def _in_green_interpreter(script: str, library: str) -> str:
    """What ``script`` prints in a fresh interpreter patched by ``library``
    (a hub held for good ends in a timeout)."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script, library],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
