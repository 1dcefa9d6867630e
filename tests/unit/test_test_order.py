"""The suite's own order: the longest test files start first (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FILES

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_longest_file_exists_and_is_named_once() -> None:
    missing = [path for path in LONGEST_FILES if not (REPO_ROOT / path).is_file()]
    assert missing == [], f"LONGEST_FILES names files that are gone: {missing}"
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
