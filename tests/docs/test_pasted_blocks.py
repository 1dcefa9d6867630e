"""Code blocks copied from the docs run in a reader's own folder.

A page that shows part of a file links the complete file (the site serves
what is under ``docs/``). The tutorial's blocks, pasted in order into the
files it names, make files that run: its tests pass in an empty folder,
without writing into the shop's data. The testing guide's files pass in an
empty folder too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.test_code_blocks import PYTHON, ROOT, SNIPPET, Block, is_included
from tests.servers import RedisServer

DOCS = ROOT / "docs"
LINK = re.compile(r"\]\((?P<target>[^)\s#]+)\)")


def _includes(block: Block) -> list[tuple[Path, str | None]]:
    found = []
    for line in block.body.splitlines():
        match = SNIPPET.match(line.strip())
        if match:
            found.append((ROOT / match["path"], match["section"]))
    return found


PARTIAL = [
    (block, path)
    for block in PYTHON
    if is_included(block)
    for path, section in _includes(block)
    if section is not None
]


@pytest.mark.parametrize(("block", "path"), PARTIAL, ids=lambda v: str(v).rsplit("/", 1)[-1])
def test_a_page_that_shows_part_of_a_file_links_the_complete_file(block: Block, path: Path) -> None:
    assert DOCS in path.parents, f"{block}: {path.relative_to(ROOT)} is not served by the site"
    text = block.page.read_text()
    linked = {(block.page.parent / m["target"]).resolve() for m in LINK.finditer(text)}
    assert path.resolve() in linked, f"{block}: no link to {path.relative_to(ROOT)}"


def _section_text(path: Path, section: str | None) -> str:
    text = path.read_text()
    if section is None:
        return text
    start = text.index(f"# --8<-- [start:{section}]\n") + len(f"# --8<-- [start:{section}]\n")
    return text[start : text.index(f"# --8<-- [end:{section}]")]


def _pasted(page: Path) -> dict[str, str]:
    """What a reader has after pasting each block of ``page`` into the file it includes."""
    files: dict[str, str] = {}
    for block in PYTHON:
        if block.page == page and is_included(block):
            for path, section in _includes(block):
                files[path.name] = files.get(path.name, "") + _section_text(path, section)
    return files


def _code(text: str) -> str:
    """The lines that run: no module docstring, no include markers, no blank lines."""
    text = re.sub(r'^"""(.*?)"""\n', "", text, count=1, flags=re.S)
    return "\n".join(line for line in text.splitlines() if line.strip() and "# --8<--" not in line)


def test_the_tutorials_blocks_pasted_in_order_make_its_complete_files() -> None:
    pasted = _pasted(DOCS / "tutorial.md")
    assert set(pasted) == {"shop.py", "send.py", "conftest.py", "test_shop.py"}
    for name, text in pasted.items():
        assert _code(text) == _code((DOCS / "examples" / "tutorial" / name).read_text()), name


def test_the_django_pages_settings_run_in_a_startproject_settings_file(tmp_path: Path) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "django", "startproject", "proj", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    settings = tmp_path / "proj" / "settings.py"
    pasted = _pasted(DOCS / "django.md")["settings.py"]
    assert "DATABASES" in pasted
    settings.write_text(f"{settings.read_text()}\n{pasted}")
    loaded = subprocess.run(
        [sys.executable, "-c", "import proj.settings"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr


def test_the_django_pages_redis_broker_settings_are_read_as_written() -> None:
    from celery import Celery

    from celery_leases.broker_checks import keep_invisible
    from celery_leases.spelling import misspelled_settings

    (block,) = [
        b
        for b in PYTHON
        if b.page.name == "django.md" and "CELERY_LEASES_BROKER_KEEP_INVISIBLE" in b.body
    ]
    settings: dict[str, object] = {}
    exec(block.body, settings)  # noqa: S102 - the page's own block
    app = Celery("project", set_as_current=False)
    app.config_from_object({k: v for k, v in settings.items() if k.isupper()}, namespace="CELERY")
    assert app.conf.broker_url.startswith("redis://")
    assert app.conf.broker_transport_options["visibility_timeout"] < 3600  # below kombu's hour
    assert keep_invisible(app)
    assert misspelled_settings(app.conf) == []
    assert "howto/worker.md#keep-a-running-message-invisible" in block.page.read_text()


def _pytest(folder: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder), *args],
        cwd=folder,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_the_tutorials_pasted_tests_pass_and_leave_the_shops_data_alone(tmp_path: Path) -> None:
    folder, data = tmp_path / "shop", tmp_path / "data"
    folder.mkdir()
    data.mkdir()
    for name, text in _pasted(DOCS / "tutorial.md").items():
        (folder / name).write_text(text)
    completed = _pytest(folder, {"SHOP_DATA": str(data)})
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "2 passed" in completed.stdout
    assert sorted(p.name for p in data.iterdir()) == []


def test_the_testing_guides_files_pass_on_a_real_redis_store(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # the app's ttl is 30 s: lose() and steal() must not wait it out, or the
    # lost-lease test times out and its worker thread cannot stop
    for name in ("payments.py", "test_payments.py"):
        shutil.copy(DOCS / "examples" / "testing" / name, tmp_path / name)
    store = f"redis://127.0.0.1:{redis_server.port}/3"
    completed = _pytest(tmp_path, {}, "--leases-store", store)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "3 passed" in completed.stdout


def test_the_testing_guides_files_pass_in_an_empty_folder(tmp_path: Path) -> None:
    for name in ("payments.py", "test_payments.py"):
        shutil.copy(DOCS / "examples" / "testing" / name, tmp_path / name)
    completed = _pytest(tmp_path, {})
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "3 passed" in completed.stdout
    assert not (tmp_path / "payments.db").exists()
