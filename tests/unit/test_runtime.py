"""The process runtime: the bind hooks that install the worker integration."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

from celery import Celery

from celery_leases.runtime import add_bind_hook, app_bound, forget_runtime


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
