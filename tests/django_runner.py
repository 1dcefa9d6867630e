"""Run the Django tests (tests/django_app and the shop's) in a pytest process of their own.

Django's settings are one per process, and pytest-django is off in this
suite (``-p no:django``), so each run is a pytest process on
``example_project/django_shop/pytest.ini``, with the Python given (this
one, or another virtualenv's with another Django).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["DJANGO_APP", "RUN_TIMEOUT", "SHOP", "TESTS", "run_django_tests"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SHOP = REPO_ROOT / "example_project" / "django_shop"
INI = SHOP / "pytest.ini"
DJANGO_APP = REPO_ROOT / "tests" / "django_app"
#: the shop's own tests (with their fixtures in tests/conftest.py), then the
#: tests of celery_leases.contrib.django
TESTS = [SHOP / "tests" / "test_orders.py", DJANGO_APP]
#: seconds one run of the Django tests may take: they start real workers,
#: and on a loaded machine the whole set takes two to four minutes
RUN_TIMEOUT = 300


def _arguments(tests: list[Path]) -> list[str]:
    """pytest's arguments for ``tests``. A file outside the shop's folder is
    named by its folder and ``-k``: given by its own path, pytest would show
    its tests' ids without the file's name."""
    outside = [t for t in tests if t.suffix == ".py" and SHOP not in t.parents]
    arguments = [str(t) for t in tests if t not in outside]
    arguments += sorted({str(t.parent) for t in outside})
    if outside:
        arguments += ["-k", " or ".join(t.stem for t in outside)]
    return arguments


#: the Django tests that need a database over the network (a proxy refuses
#: its connections), left out of the runs on SQLite
NETWORK_ONLY = "test_a_connection_refused_as_the_block_opens_loses_the_lease"


def run_django_tests(
    tmp_path: Path,
    tests: list[Path],
    python: str = sys.executable,
    *,
    leave_out: str | None = None,
    **env: str,
) -> str:
    """Run ``tests`` with ``python``; assert every test module ran and passed.

    ``leave_out`` names the tests (a pytest ``-k`` expression) that do not
    apply to the database of the run, which are deselected rather than
    skipped. The output (pytest's ``-v`` lines and its summary) is returned.
    """
    keyword = [] if leave_out is None else ["-k", f"not ({leave_out})"]
    completed = subprocess.run(
        [python, "-m", "pytest", "-c", str(INI), "-v", *keyword, *_arguments(tests)],
        cwd=SHOP,
        env={
            **os.environ,
            "SHOP_DATA": str(tmp_path),
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    summary = output.strip().splitlines()[-1]
    passed = re.search(r"\b(\d+) passed\b", summary)
    assert passed, output
    # every test module given ran: none was left out of collection
    modules = [m for t in tests for m in ([t] if t.suffix == ".py" else t.glob("test_*.py"))]
    for module in modules:
        assert f"{module.name}::" in output, f"{module.name} did not run:\n{output}"
    assert not re.search(r"skipped|xfailed|error", summary), output
    return output
