"""What the docs name is importable from the package's top level."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import celery_leases

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*ROOT.joinpath("docs").rglob("*.md"), ROOT / "README.md"]


def _exported_by_a_module() -> dict[str, str]:
    found: dict[str, str] = {}
    for info in pkgutil.walk_packages(celery_leases.__path__, "celery_leases."):
        if info.name.startswith("celery_leases.contrib."):
            continue  # framework integrations import only inside their framework
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            found.setdefault(name, info.name)
    return found


def _named_in_the_docs() -> set[str]:
    names: set[str] = set()
    for page in PAGES:
        names |= set(re.findall(r"`([A-Z][A-Za-z]+)(?:\(|`)", page.read_text()))
    return names


EXPORTED = _exported_by_a_module()
NAMED = sorted(n for n in _named_in_the_docs() if n in EXPORTED)


def test_the_docs_name_classes_of_the_package() -> None:
    assert "Token" in NAMED


@pytest.mark.parametrize("name", NAMED)
def test_a_class_the_docs_name_is_importable_from_celery_leases(name: str) -> None:
    value = getattr(celery_leases, name)
    assert value is getattr(importlib.import_module(EXPORTED[name]), name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Tokn'"):
        _ = celery_leases.Tokn  # type: ignore[attr-defined]
