"""Run Celery's own task tests with LeasedTask as every app's default task class.

Usage (from the repository root, normally through ``scripts/celery-suite``)::

    python -m tests.celery_suite.run unit [--baseline] [-- PYTEST_ARGS...]
    python -m tests.celery_suite.run integration [--baseline] [-- PYTEST_ARGS...]

Steps: download the sdist of the installed Celery version once (cached in
``.cache/celery-suite``), unpack only its ``t/``, ``pyproject.toml`` and
``requirements/`` (so the installed ``celery`` is the one tested), install
the few test requirements the profile needs at the versions the sdist pins,
run pytest there with ``tests.celery_suite.plugin``, and compare the failing
tests with ``expected.txt``. Exit status 0 only when the failing tests are
exactly the listed ones among those that ran.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "celery-suite"
EXPECTED = Path(__file__).with_name("expected.txt")
#: reason prefixes in expected.txt; ``env:`` tests fail without LeasedTask too
REASON_PREFIXES = ("core:", "by design:", "env:")
#: a strict xfail that passes is reported as failed; a non-strict one is a pass
FAILING = ("failed", "error")


@dataclass(frozen=True)
class Profile:
    paths: tuple[str, ...]
    #: requirement names, installed at the version the sdist pins
    needs: tuple[str, ...]
    redis: bool = False


PROFILES = {
    "unit": Profile(paths=("t/unit/tasks",), needs=()),
    "integration": Profile(
        paths=("t/integration/test_tasks.py", "t/integration/test_canvas.py"),
        needs=("pydantic",),
        redis=True,
    ),
}


def log(message: str) -> None:
    print(f"[celery-suite] {message}", flush=True)


# --- the sdist ------------------------------------------------------------------


def download_sdist(version: str) -> Path:
    """The cached sdist of ``celery==version``, downloaded on first use."""
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / f"celery-{version}.tar.gz"
    if target.exists():
        return target
    log(f"downloading the sdist of celery {version}")
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", f"celery=={version}", "--dest", tmp],
            check=True,
        )  # fmt: skip
        found = [p for p in Path(tmp).iterdir() if p.name.endswith(".tar.gz")]
        if len(found) != 1:
            raise SystemExit(f"expected one sdist from pip download, got {found}")
        found[0].replace(target)
    return target


def _wanted(name: str, top: str) -> bool:
    parts = Path(name).parts
    if not parts or parts[0] != top or ".." in parts or Path(name).is_absolute():
        return False
    return len(parts) >= 2 and parts[1] in ("t", "requirements", "pyproject.toml")


def unpack_suite(sdist: Path, version: str) -> Path:
    """Unpack the test suite (not the ``celery`` package) next to the sdist."""
    suite = CACHE / f"suite-{version}"
    if (suite / ".unpacked").exists():
        return suite
    top = f"celery-{version}"
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp, tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if _wanted(m.name, top)]
        if not any(Path(m.name).parts[1:2] == ("t",) for m in members):
            raise SystemExit(f"{sdist.name} holds no t/ folder: no test suite to run")
        if hasattr(tarfile, "data_filter"):
            archive.extractall(tmp, members=members, filter="data")
        else:  # pragma: no cover - Python without extraction filters
            archive.extractall(tmp, members=members)  # noqa: S202 - names checked above
        shutil.rmtree(suite, ignore_errors=True)
        (Path(tmp) / top).replace(suite)
    (suite / ".unpacked").write_text(version)
    return suite


# --- test requirements ----------------------------------------------------------


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_requirements(suite: Path) -> dict[str, str]:
    """Requirement lines of the sdist's requirements/*.txt, by normalized name."""
    pins: dict[str, str] = {}
    for path in sorted((suite / "requirements").rglob("*.txt")):
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)", line)
            if line and not line.startswith("-") and match:
                pins.setdefault(_normalize(match.group(1)), line)
    return pins


def needed_requirements(profile: Profile) -> list[str]:
    needs = list(profile.needs)
    # pytest 9 has the subtests fixture built in; older ones need the plugin
    if int(importlib.metadata.version("pytest").split(".")[0]) < 9:
        needs.append("pytest-subtests")
    return needs


def install_requirements(suite: Path, needs: list[str]) -> None:
    pins = pinned_requirements(suite)
    missing = []
    for name in needs:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(pins.get(_normalize(name), name))
    if missing:
        log(f"installing the suite's test requirements: {' '.join(missing)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *missing], check=True)


# --- servers --------------------------------------------------------------------


@contextmanager
def redis_env(enabled: bool) -> Iterator[dict[str, str]]:
    """A throwaway redis-server as broker (db 0), backend (db 1) and lease store (db 2)."""
    if not enabled:
        yield {}
        return
    from tests.servers import RedisServer

    server = RedisServer("--appendonly", "no")
    base = f"redis://127.0.0.1:{server.port}"
    log(f"redis-server on port {server.port}")
    try:
        yield {
            "TEST_BROKER": f"{base}/0",
            "TEST_BACKEND": f"{base}/1",
            "REDIS_HOST": "127.0.0.1",
            "REDIS_PORT": str(server.port),
            "LEASES_SUITE_STORE": f"{base}/2",
        }
    finally:
        server.close()


# --- the comparison -------------------------------------------------------------


def read_expected(path: Path = EXPECTED) -> dict[str, str]:
    """``test id | reason`` lines; ``#`` starts a comment line."""
    expected: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        nodeid, sep, reason = (part.strip() for part in line.partition(" | "))
        if not sep or not reason.startswith(REASON_PREFIXES):
            raise SystemExit(
                f"{path.name}:{number}: write 'test id | reason', the reason starting with "
                f"one of {', '.join(REASON_PREFIXES)}"
            )
        if nodeid in expected:
            raise SystemExit(f"{path.name}:{number}: {nodeid} is listed twice")
        expected[nodeid] = reason
    return expected


def compare(report: dict[str, Any], expected: dict[str, str], baseline: bool) -> list[str]:
    """Problems: unlisted failures, and listed tests that ran and did not fail."""
    outcomes: dict[str, str] = report["outcomes"]
    messages: dict[str, str] = report["messages"]
    if baseline:
        expected = {k: v for k, v in expected.items() if v.startswith("env:")}
    problems: list[str] = []
    for nodeid, outcome in sorted(outcomes.items()):
        if outcome in FAILING and nodeid not in expected:
            problems.append(f"not listed, {outcome}: {nodeid}\n    {messages.get(nodeid, '')}")
    for nodeid, reason in sorted(expected.items()):
        ran = outcomes.get(nodeid)
        # an environment failure depends on timing: passing is no news
        if ran is not None and ran not in FAILING and not reason.startswith("env:"):
            problems.append(f"listed but {ran} now (remove it): {nodeid}\n    ({reason})")
    return problems


def summarize(report: dict[str, Any], mode: str, seconds: float) -> str:
    counts: Counter[str] = Counter(report["outcomes"].values())
    parts = ", ".join(
        f"{name} {counts.get(name, 0)}"
        for name in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    )
    return f"Celery {report['celery']} suite, {mode}: {parts}; {seconds:.0f} s"


# --- main -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", choices=sorted(PROFILES))
    parser.add_argument(
        "--baseline",
        action="store_true",
        default=os.environ.get("LEASES_SUITE_BASELINE", "") not in ("", "0"),
        help="plain Celery, no LeasedTask (also LEASES_SUITE_BASELINE=1)",
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: passed on to pytest")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    mode = "baseline (plain Celery)" if args.baseline else "leased"

    version = importlib.metadata.version("celery")
    suite = unpack_suite(download_sdist(version), version)
    install_requirements(suite, needed_requirements(profile))
    expected = read_expected()

    report_path = CACHE / f"report-{args.profile}-{'baseline' if args.baseline else 'leased'}.json"
    report_path.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "pytest", "-p", "tests.celery_suite.plugin",
        "-p", "no:cacheprovider", "--disable-warnings", "--tb=short", "-q",
        *profile.paths, *args.pytest_args,
    ]  # fmt: skip
    pythonpath = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    started = time.monotonic()
    with redis_env(profile.redis) as server_env:
        env = {
            **os.environ,
            **server_env,
            "PYTHONPATH": os.pathsep.join([str(REPO), *pythonpath]),
            "LEASES_SUITE_REPORT": str(report_path),
            "LEASES_SUITE_BASELINE": "1" if args.baseline else "0",
        }
        log(f"{mode}: {' '.join(command[1:])}  (in {suite.relative_to(REPO)})")
        status = subprocess.run(command, cwd=suite, env=env, check=False).returncode
    seconds = time.monotonic() - started
    if not report_path.exists():
        log(f"pytest wrote no report (exit status {status})")
        return status or 1
    report = json.loads(report_path.read_text())
    problems = compare(report, expected, args.baseline)
    for problem in problems:
        log(problem)
    log(summarize(report, mode, seconds))
    if status not in (0, 1):  # 1: tests failed, which the comparison judges
        log(f"pytest stopped with exit status {status}")
        return status
    if problems:
        log(f"{len(problems)} difference(s) from {EXPECTED.name}: see above")
        return 1
    listed = sum(1 for k in expected if report["outcomes"].get(k) in FAILING)
    log(f"every failing test is listed in {EXPECTED.name} ({listed} listed failures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
