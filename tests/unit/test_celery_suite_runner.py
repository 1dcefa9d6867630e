"""The comparison of the Celery suite harness with its list of expected failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.celery_suite.run import EXPECTED, _wanted, compare, read_expected


def _report(**outcomes: str) -> dict[str, object]:
    return {"outcomes": outcomes, "messages": {}, "celery": "5.x"}


def _expected(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "expected.txt"
    path.write_text(text)
    return read_expected(path)


def test_the_shipped_list_parses() -> None:
    expected = read_expected(EXPECTED)
    assert expected
    assert all(nodeid.startswith("t/") for nodeid in expected)


def test_expected_lines_need_a_classified_reason(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="reason starting with"):
        _expected(tmp_path, "t/a.py::test_x | because\n")


def test_expected_lines_need_a_separator(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="test id \\| reason"):
        _expected(tmp_path, "t/a.py::test_x core: no bar\n")


def test_a_test_listed_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="listed twice"):
        _expected(tmp_path, "t/a.py::x | core: a\nt/a.py::x | core: b\n")


def test_comments_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    expected = _expected(tmp_path, "# note\n\nt/a.py::x | by design: why\n")
    assert expected == {"t/a.py::x": "by design: why"}


def test_an_unlisted_failure_is_a_problem() -> None:
    problems = compare(_report(**{"t/a.py::x": "failed", "t/a.py::y": "passed"}), {}, False)
    assert len(problems) == 1
    assert "not listed, failed: t/a.py::x" in problems[0]


def test_an_unlisted_teardown_error_is_a_problem() -> None:
    problems = compare(_report(**{"t/a.py::x": "error"}), {}, False)
    assert "not listed, error" in problems[0]


def test_a_non_strict_xfail_that_passes_is_fine() -> None:
    assert compare(_report(**{"t/a.py::x": "xpassed"}), {}, False) == []


def test_a_listed_failure_is_fine() -> None:
    expected = {"t/a.py::x": "core: bug"}
    assert compare(_report(**{"t/a.py::x": "failed"}), expected, False) == []


def test_a_listed_test_that_passes_now_is_a_problem() -> None:
    expected = {"t/a.py::x": "core: bug"}
    problems = compare(_report(**{"t/a.py::x": "passed"}), expected, False)
    assert "listed but passed now" in problems[0]


def test_an_environment_failure_that_passes_is_fine() -> None:
    expected = {"t/a.py::x": "env: slow machine"}
    assert compare(_report(**{"t/a.py::x": "passed"}), expected, False) == []


def test_a_listed_test_that_did_not_run_is_fine() -> None:
    expected = {"t/a.py::x": "core: bug"}
    assert compare(_report(**{"t/a.py::y": "passed"}), expected, False) == []


def test_the_baseline_expects_only_environment_failures() -> None:
    expected = {"t/a.py::x": "core: bug", "t/a.py::y": "env: no server"}
    report = _report(**{"t/a.py::x": "passed", "t/a.py::y": "failed"})
    assert compare(report, expected, True) == []
    problems = compare(_report(**{"t/a.py::x": "failed"}), expected, True)
    assert "not listed, failed: t/a.py::x" in problems[0]


@pytest.mark.parametrize(
    ("name", "wanted"),
    [
        ("celery-5.7.0/t/unit/conftest.py", True),
        ("celery-5.7.0/pyproject.toml", True),
        ("celery-5.7.0/requirements/test.txt", True),
        ("celery-5.7.0/celery/app/base.py", False),
        ("celery-5.7.0/../evil/t/x.py", False),
        ("/etc/t/passwd", False),
        ("other-1.0/t/x.py", False),
    ],
)
def test_only_the_test_suite_is_unpacked(name: str, wanted: bool) -> None:
    assert _wanted(name, "celery-5.7.0") is wanted
