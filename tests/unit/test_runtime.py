"""The process runtime: the bind hooks that install the worker integration."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import Any

from celery import Celery

from celery_leases.notify import notify
from celery_leases.runtime import add_bind_hook, app_bound, forget_runtime, store_for


def test_a_bind_hook_is_called_for_apps_bound_before_and_after_it() -> None:
    before = Celery("bound-before", set_as_current=False)
    after = Celery("bound-after", set_as_current=False)
    seen: list[Any] = []
    app_bound(before)
    add_bind_hook(seen.append)
    assert before in seen
    app_bound(after)
    assert seen.count(after) == 1
    for app in (before, after):
        forget_runtime(app)
        app.close()


def test_a_leased_task_alone_installs_the_bootstep_and_the_inspect_command() -> None:
    # a fresh interpreter that imports only the task module, as an app does
    script = textwrap.dedent(
        """
        from celery import Celery
        from celery.worker.control import Panel

        from celery_leases.task import LeasedTask
        from celery_leases.worker import LeasesStep

        app = Celery("alone", set_as_current=False)

        @app.task(shared=False, base=LeasedTask)
        def job() -> None:
            pass

        app.finalize()
        options = sorted(o.name for o in app.user_options["worker"])
        print(LeasesStep in app.steps["worker"], options, "leases" in Panel.data)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split("\n")[0] == (
        "True ['leases_metrics_port', 'leases_store', 'leases_ttl'] True"
    )


def test_forgetting_an_app_closes_its_store_after_the_queued_notices() -> None:
    """A run's end takes its waiters on the notifier: the store it used
    closes only after that notice ran, or a SQL store's disposed engine
    would open a connection for it that nothing closes."""
    app = Celery("forget", set_as_current=False)
    app.conf.leases_store = "memory://"
    store = store_for(app)
    seen: list[str] = []
    closing = store.close

    def close() -> None:
        seen.append("closed")
        closing()

    store.close = close  # type: ignore[method-assign]
    gate = threading.Event()
    notify(gate.wait, 10)
    notify(lambda: seen.append("notice ran"))
    gate.set()
    forget_runtime(app)
    assert seen == ["notice ran", "closed"]
