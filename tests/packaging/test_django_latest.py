"""The Django tests on the newest Django, installed from the built wheel.

The project's own virtualenv holds Django's LTS (tests/integration/test_django.py
runs the Django tests there); the newest Django needs a newer Python than the
LTS does, so this test makes a virtualenv with Python 3.12 or newer (found on
``PATH`` or among pyenv's versions), installs the wheel with its ``django``
and ``sqlalchemy`` extras and the newest Django into it, and runs the same
Django tests on SQLite with that Python. The pip cache makes a repeat run quick.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.django_runner import NETWORK_ONLY, TESTS, run_django_tests
from tests.packaging.steps import run_step

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

#: the oldest Python the newest Django installs on
NEWER_PYTHON = (3, 12)
#: what the Django tests import beside the package: pytest and its plugins
#: of the shop's pytest.ini, redis-py for the workers' side channel
TEST_REQUIREMENTS = ["pytest>=8.0", "pytest-django>=4.9", "pytest-timeout>=2.3", "redis>=5.0"]


def _candidates() -> list[str]:
    names = [f"python3.{minor}" for minor in range(20, NEWER_PYTHON[1] - 1, -1)]
    found = [path for name in names if (path := shutil.which(name))]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found += sorted(
        (str(p) for p in pyenv.glob("3.*/bin/python3.*") if "-" not in p.name), reverse=True
    )
    return found


def newer_python() -> str | None:
    """A Python at :data:`NEWER_PYTHON` or newer that runs, or ``None``."""
    for candidate in _candidates():
        probe = subprocess.run(
            [candidate, "-c", f"import sys; print(sys.version_info >= {NEWER_PYTHON})"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    return None


def test_the_django_tests_pass_on_the_newest_django(tmp_path: Path, wheel: Path) -> None:
    python = newer_python()
    if python is None:
        # not a server the suite starts but an interpreter the machine may
        # lack (Debian 12 packages none): skipped, also in CI, with the reason
        pytest.skip(f"no Python {'.'.join(map(str, NEWER_PYTHON))}+ for the newest Django")
    run_step([python, "-m", "venv", "--without-pip", str(tmp_path / "venv")], cwd=tmp_path)
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    run_step(
        [sys.executable, "-m", "pip", "--python", venv_python, "install", "-q",
         f"{wheel}[django,sqlalchemy]", "django>=6", *TEST_REQUIREMENTS],
        cwd=tmp_path,
    )  # fmt: skip
    data = tmp_path / "data"
    data.mkdir()
    output = run_django_tests(data, TESTS, python=venv_python, leave_out=NETWORK_ONLY)
    # pytest-django's header names the Django that ran the tests
    ran = re.search(r"^django: version: (\d+)\.(\d+)", output, re.MULTILINE)
    assert ran, output
    assert int(ran[1]) >= 6, output
