"""The wheel every packaging test installs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.packaging.steps import ROOT, run_step


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package built from this checkout, as a user installs it."""
    dist = tmp_path_factory.mktemp("dist")
    run_step(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--wheel-dir",
            str(dist),
            str(ROOT),
        ],
        cwd=dist,
    )
    (built,) = dist.glob("celery_leases-*.whl")
    return built
