"""Headless Chromium for the tests of pages: Flower's lease tab, the Django admin."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI

__all__ = ["chromium", "find_chromium"]


def find_chromium() -> str:
    """The path of a Chromium binary; skips the test without one (fails in CI)."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    reason = "no Chromium found (bash scripts/test installs the Debian package chromium)"
    if IN_CI:
        pytest.fail(f"{reason}; CI=true")
    pytest.skip(reason)


def chromium(url: str, tmp_path: Path, *args: str) -> str:
    """Run headless Chromium on ``url`` with ``args``; return its stdout."""
    profile = tmp_path / f"chromium-{len(list(tmp_path.glob('chromium-*')))}"
    done = subprocess.run(
        [
            find_chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            *args,
            url,
        ],
        capture_output=True,
        timeout=90,
        check=True,
    )
    return done.stdout.decode(errors="replace")
