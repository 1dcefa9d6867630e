"""Every code block of the docs and READMEs is run or checked.

A Python block either includes a file (``--8<-- "docs/examples/x.py:section"``,
rendered by the docs build) that a test runs, or it stands alone: it must
parse, use no name it does not define (ruff's F821), and import only names
that exist. Shell blocks may only name scripts and files that exist.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "README.md",
    ROOT / "example_project" / "README.md",
    ROOT / "bench" / "README.md",  # the benchmarks page includes it
]
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)
SNIPPET = re.compile(r'^--8<--\s+"(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"$')
TEST_FILES = [
    *ROOT.joinpath("tests").rglob("test_*.py"),
    *ROOT.joinpath("example_project").rglob("tests/test_*.py"),
    *ROOT.joinpath("docs", "examples").rglob("test_*.py"),
]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(*langs: str) -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match["lang"] in langs:
                line = text.count("\n", 0, match.start()) + 1
                found.append(Block(page, line, match["lang"], textwrap.dedent(match["body"])))
    return found


PYTHON = code_blocks("python", "py")
SHELL = code_blocks("console", "bash", "sh", "shell")


def is_included(block: Block) -> bool:
    lines = [line for line in block.body.splitlines() if line.strip()]
    return bool(lines) and all(SNIPPET.match(line.strip()) for line in lines)


def test_the_docs_have_code_blocks_of_both_kinds() -> None:
    assert [b for b in PYTHON if is_included(b)]
    assert [b for b in PYTHON if not is_included(b)]


@pytest.mark.parametrize("block", [b for b in PYTHON if is_included(b)], ids=str)
def test_an_included_file_exists_and_a_test_runs_it(block: Block) -> None:
    for line in block.body.split():
        if not line.startswith('"'):
            continue
        match = SNIPPET.match(f"--8<-- {line}")
        assert match, f"{block}: malformed include {line}"
        path = ROOT / match["path"]
        assert path.is_file(), f"{block}: {match['path']} does not exist"
        if match["section"]:
            text = path.read_text()
            assert f"--8<-- [start:{match['section']}]" in text, f"{block}: no such section"
            assert f"--8<-- [end:{match['section']}]" in text
        runners = [
            t
            for t in TEST_FILES
            if path.stem in t.read_text() or t.parent.resolve() == path.parent.resolve()
        ]
        assert runners, f"{block}: no test runs {match['path']}"


@pytest.mark.parametrize("block", [b for b in PYTHON if not is_included(b)], ids=str)
def test_a_standalone_block_parses_and_defines_every_name_it_uses(
    block: Block, tmp_path: Path
) -> None:
    # an include a formatter rewrote (``--8 < --"x"``) still parses: the page
    # would show that line instead of the file
    assert not re.search(r"^\s*--8\s*<\s*--", block.body, re.M), f"{block}: mangled include"
    tree = ast.parse(block.body)  # a SyntaxError fails the test
    source = tmp_path / "block.py"
    source.write_text(block.body)
    ruff = Path(sys.executable).with_name("ruff")
    checked = subprocess.run(
        [str(ruff), "check", "--isolated", "--no-cache", "--select", "F821,F822,F823", str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, f"{block}:\n{block.body}\n{checked.stdout}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("celery_leases"):
            module = importlib.import_module(str(node.module))
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block}: {node.module}.{alias.name}"


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_a_shell_block_names_only_files_that_exist(block: Block) -> None:
    for path in re.findall(r"(?:scripts|example_project|docs|tests|bench)/[\w./-]*\w", block.body):
        assert (ROOT / path).exists(), f"{block}: {path} does not exist"


#: a benchmark command of the docs: the script and the rest of the line
BENCH_COMMAND = re.compile(r"^\$ \.venv/bin/python (?P<script>bench/\w+\.py)(?P<rest>.*)$", re.M)


def test_every_benchmark_command_runs_from_a_checkout_with_the_options_it_shows() -> None:
    commands: dict[str, set[str]] = {}
    for block in SHELL:
        for match in BENCH_COMMAND.finditer(block.body):
            shown = re.findall(r"(?<!\S)(--[\w-]+|-\w)\b", match["rest"].split("#")[0])
            commands.setdefault(match["script"], set()).update(shown)
    assert len(commands) >= 10, sorted(commands)  # every script of bench/README.md
    for script, options in sorted(commands.items()):
        helped = subprocess.run(
            [sys.executable, script, "--help"],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert helped.returncode == 0, f"{script}: {helped.stderr}"
        missing = sorted(o for o in options if o not in helped.stdout)
        assert not missing, f"{script} --help has no {missing}"
