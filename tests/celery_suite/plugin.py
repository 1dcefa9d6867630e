"""pytest plugin: run Celery's own test suite with every task leased.

``run.py`` loads it with ``-p tests.celery_suite.plugin`` into a pytest
session rooted at Celery's unpacked test suite, so the suite's own
``conftest.py`` files run as usual. Unless ``LEASES_SUITE_BASELINE=1``:

- ``Celery.task_cls`` (the class attribute an app falls back to when it is
  given no ``task_cls``) names :class:`SuiteTask`, a plain subclass of
  :class:`~celery_leases.LeasedTask`. So ``app.Task``, and with it every
  ``@app.task``, ``shared_task`` and Celery's built-in tasks, is leased;
  only a test that names its own base class or ``task_cls`` keeps it.
- ``Celery.on_init`` (a no-op hook Celery calls at the end of
  ``__init__``) adds ``leases_store`` as a default setting (``memory://``,
  or ``LEASES_SUITE_STORE``) and calls :func:`celery_leases.install`.

After each test body, ``celery_leases.stop()`` stops the heartbeat thread
(the suite checks that no thread outlives a test); until that function
exists, ``celery_leases.worker.release_held_leases`` does the same.

Every test's outcome, the first line of each failure, and counts of the
tasks seen (leased or not) are written as JSON to ``LEASES_SUITE_REPORT``.
"""

from __future__ import annotations

import json
import os
import weakref
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import celery
import pytest
from celery import Celery, _state

import celery_leases
from celery_leases import LeasedTask, open_store, signals
from celery_leases.worker import release_held_leases

BASELINE = os.environ.get("LEASES_SUITE_BASELINE", "") not in ("", "0")
STORE_URL = os.environ.get("LEASES_SUITE_STORE", "memory://")
REPORT = os.environ.get("LEASES_SUITE_REPORT", "")
#: leave the heartbeat running after each test, to see the suite's thread check
KEEP_HEARTBEAT = os.environ.get("LEASES_SUITE_KEEP_HEARTBEAT", "") not in ("", "0")

#: worst outcome wins when a test reports several phases (or subtests)
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 4}


class SuiteTask(LeasedTask):
    """The default task class of every app the suite makes (unchanged LeasedTask)."""


_SUITE_TASK = f"{__name__}:SuiteTask"


class _Tally:
    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}
        self.seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self.seen_apps: weakref.WeakSet[Any] = weakref.WeakSet()
        self.tasks: Counter[str] = Counter()
        self.plain: Counter[str] = Counter()
        self.claims = 0
        self.apps = 0
        #: apps made before the suite ran (another plugin's) are not counted
        self.before: weakref.WeakSet[Any] = weakref.WeakSet()
        #: lease records in a shared store at the end (runs in worker processes)
        self.records: int | None = None

    def outcome(self, nodeid: str, outcome: str, message: str | None) -> None:
        if _RANK[outcome] >= _RANK.get(self.outcomes.get(nodeid, "passed"), 0):
            self.outcomes[nodeid] = outcome
        if message and nodeid not in self.messages:
            self.messages[nodeid] = message

    def scan_apps(self) -> None:
        """Count the tasks of every live app once: leased or not, built-in or not."""
        for app in list(_state._apps):
            if app in self.before:
                continue
            if app not in self.seen_apps:
                self.seen_apps.add(app)
                self.apps += 1
            for name, task in list(app._tasks.items()):
                if task in self.seen:
                    continue
                self.seen.add(task)
                kind = "builtin" if name.startswith("celery.") else "suite"
                if isinstance(task, LeasedTask):
                    self.tasks[f"{kind} leased"] += 1
                else:
                    self.tasks[f"{kind} plain"] += 1
                    self.plain[type(task).__mro__[1].__qualname__] += 1


_tally = _Tally()
_undo: list[Callable[[], None]] = []


def _on_claimed(**_: Any) -> None:
    _tally.claims += 1


def _patch_celery() -> None:
    original_task_cls = Celery.__dict__["task_cls"]
    original_on_init = Celery.__dict__["on_init"]

    def on_init(self: Any) -> None:
        original_on_init(self)
        self.add_defaults({"leases_store": STORE_URL})
        celery_leases.install(self)

    Celery.task_cls = _SUITE_TASK
    Celery.on_init = on_init

    def undo() -> None:
        Celery.task_cls = original_task_cls
        Celery.on_init = original_on_init

    _undo.append(undo)


def _stop_leases() -> None:
    stop = getattr(celery_leases, "stop", None)
    if stop is not None:
        stop()
    else:
        release_held_leases("test finished")


def pytest_configure(config: pytest.Config) -> None:
    celery_dir = Path(celery.__file__).resolve().parent
    if Path(config.rootpath).resolve() in celery_dir.parents:
        raise pytest.UsageError(
            f"celery is imported from the unpacked sdist ({celery_dir}), not from the "
            "installed package; unpack only t/ and pyproject.toml"
        )
    _tally.before.update(_state._apps)
    if BASELINE:
        return
    _patch_celery()
    signals.lease_claimed.connect(_on_claimed, weak=False, dispatch_uid="celery_suite.claims")
    _undo.append(lambda: signals.lease_claimed.disconnect(dispatch_uid="celery_suite.claims"))


def pytest_unconfigure(config: pytest.Config) -> None:
    while _undo:
        _undo.pop()()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        # before any fixture's teardown, so the suite's lingering-thread check
        # sees the heartbeat stopped; counted before the test's apps are freed
        _tally.scan_apps()
        if not BASELINE and not KEEP_HEARTBEAT:
            _stop_leases()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    wasxfail = hasattr(report, "wasxfail")
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
    elif report.skipped:
        outcome = "xfailed" if wasxfail else "skipped"
    elif report.when == "call":
        outcome = "xpassed" if wasxfail else "passed"
    else:
        outcome = "passed"
    message = None
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(report.longrepr)
        message = f"{report.when}: {text.strip().splitlines()[0] if text.strip() else ''}"
    _tally.outcome(report.nodeid, outcome, message)


def _count_records() -> int | None:
    """Lease records in the store, when it is shared (the memory store is per app)."""
    if BASELINE or STORE_URL.startswith("memory:"):
        return None
    with open_store(STORE_URL) as store:
        return sum(1 for _ in store.records())


def pytest_terminal_summary(terminalreporter: Any) -> None:
    mode = "baseline (plain Celery)" if BASELINE else f"leased (store {STORE_URL})"
    terminalreporter.section("celery-leases suite")
    terminalreporter.write_line(f"mode: {mode}")
    terminalreporter.write_line(
        f"apps made: {_tally.apps}; tasks seen: {dict(sorted(_tally.tasks.items()))}; "
        f"leased runs (claims in this process): {_tally.claims}"
    )
    if _tally.records is not None:
        terminalreporter.write_line(f"lease records in {STORE_URL}: {_tally.records}")
    if _tally.plain:
        terminalreporter.write_line(f"tasks not leased, by base class: {dict(_tally.plain)}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    # runs before the terminal summary, which prints the count
    _tally.records = _count_records()
    if not REPORT:
        return
    data = {
        "baseline": BASELINE,
        "store": STORE_URL,
        "celery": celery.__version__,
        "outcomes": _tally.outcomes,
        "messages": _tally.messages,
        "tasks": dict(_tally.tasks),
        "plain_bases": dict(_tally.plain),
        "claims": _tally.claims,
        "records": _tally.records,
        "apps": _tally.apps,
    }
    Path(REPORT).write_text(json.dumps(data, indent=1, sort_keys=True))
