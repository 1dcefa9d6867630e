"""The package's layout: no module reaches into another's private names.

An underscore name is private to the module that defines it, and a module
whose own name starts with an underscore is private to its package (the
store families ``celery_leases.stores.redis`` and ``celery_leases.stores.sql``
keep their scripts, statements and dialects so). The tests read every
module's source (its syntax tree, so an import inside a function counts too)
and name each place that breaks either rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery._state import _task_stack

import celery_leases

#: the package as imported: the checkout's, or the installed wheel's (the
#: support matrix runs these tests without the checkout's package)
PACKAGE = Path(celery_leases.__file__).resolve().parent

#: underscore names of other libraries imported where they have no public
#: API, each with the test that pins the behaviour relied on
FOREIGN_PRIVATE_NAMES = {
    # Celery's stack of running tasks, which Task.__call__ pushes
    # (tests/unit/test_layout.py::test_celery_keeps_its_running_tasks_on_its_task_stack)
    ("celery._state", "_task_stack"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_our_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _owner_of_private_module(name: str) -> str | None:
    """The package a private module of ours (``a.b._c.d``) belongs to (``a.b``), else None."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if _private(part):
            return ".".join(parts[:index])
    return None


def _absolute(node: ast.ImportFrom, module: str, package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def _reaches_into(importer: str, target: str) -> bool:
    """Whether ``importer`` imports ``target``, a private module of another package."""
    if not target.startswith("celery_leases"):
        return False
    owner = _owner_of_private_module(target)
    return owner is not None and not (importer == owner or importer.startswith(owner + "."))


def _breaks(module: str, source: str, *, package: bool = False) -> Iterator[str]:
    """Where ``source``, the module named ``module``, breaks the layout's two rules."""
    tree = ast.parse(source)
    # names bound to a module of ours, for reads of module._name
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        where = f"{module}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _reaches_into(module, alias.name):
                    yield f"{where}: imports {alias.name}, a private module of another package"
                if alias.name.startswith("celery_leases"):
                    bound = alias.asname or alias.name.split(".")[0]
                    modules[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(node, module, package)
            if _reaches_into(module, origin):
                yield f"{where}: imports from {origin}, a private module of another package"
            for alias in node.names:
                full = f"{origin}.{alias.name}"
                ours = origin.startswith("celery_leases") and _is_our_module(full)
                if (
                    _private(alias.name)
                    and not ours  # a module: the rule on private modules judges it
                    and (origin, alias.name) not in FOREIGN_PRIVATE_NAMES
                ):
                    yield f"{where}: imports {alias.name}, a private name of {origin}"
                if ours:
                    if _reaches_into(module, full):
                        yield f"{where}: imports {full}, a private module of another package"
                    modules[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in modules:
            continue
        where = f"{module}:{node.lineno}"
        dotted = modules[value.id]
        for attr in reversed(chain):
            if not _is_our_module(dotted):
                break
            if _private(attr):
                target = f"{dotted}.{attr}"
                if _is_our_module(target) and not _reaches_into(module, target):
                    break  # a private module of its own package
                yield f"{where}: reads {dotted}.{attr}, a private name of another module"
                break
            dotted = f"{dotted}.{attr}"


def _all_breaks() -> list[str]:
    found: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        found.update(_breaks(_module_name(path), path.read_text(), package=_is_package(path)))
    return sorted(found)


def test_no_module_reaches_into_another_modules_private_names() -> None:
    assert _all_breaks() == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("celery_leases.task", "from celery_leases.stores.base import _helper"),
        (
            "celery_leases.task",
            "from celery_leases.stores.base import (\n    LeaseStore,\n    _helper,\n)",
        ),
        ("celery_leases.task", "def f():\n    from celery_leases.runtime import _runtimes"),
        ("celery_leases.task", "from redis.client import _private_thing"),
        ("celery_leases.cli", "from celery_leases.stores.sql._store import SqlStore"),
        ("celery_leases.cli", "import celery_leases.stores.redis._scripts"),
        ("celery_leases.cli", "from celery_leases.stores.sql import _store"),
        ("celery_leases.fencing.sql", "from ..stores.redis._scripts import CLAIM_SCRIPT"),
        ("celery_leases.cli", "from celery_leases import runtime\nruntime._runtimes"),
        ("celery_leases.cli", "import celery_leases.runtime\ncelery_leases.runtime._runtimes"),
        ("celery_leases.cli", "from celery_leases.stores import base as b\nb._x"),
        ("celery_leases.cli", "from celery_leases import stores\nstores.sql._store"),
    ],
)
def test_a_reach_into_private_names_is_named(module: str, source: str) -> None:
    assert len(list(_breaks(module, source))) == 1


@pytest.mark.parametrize(
    ("module", "source", "package"),
    [
        (
            "celery_leases.stores.sql._store",
            "from celery_leases.stores.sql._table import lease_table",
            False,
        ),
        ("celery_leases.stores.sql._store", "from ._table import lease_table", False),
        ("celery_leases.stores.sql", "from ._store import SqlStore", True),
        ("celery_leases.stores.sql", "from celery_leases.stores.sql import _store", True),
        ("celery_leases.cli", "from celery_leases.stores.sql import SqlStore, __all__", False),
        ("celery_leases.cli", "import _thread\nfrom celery._state import _task_stack", False),
        (
            "celery_leases.cli",
            "from celery_leases import runtime\nruntime.settings_for\nruntime.__name__",
            False,
        ),
        ("celery_leases.cli", "import celery_leases.runtime as r\nr.settings_for", False),
    ],
)
def test_what_keeps_to_public_names_is_not_named(module: str, source: str, package: bool) -> None:
    assert list(_breaks(module, source, package=package)) == []


def test_celery_keeps_its_running_tasks_on_its_task_stack() -> None:
    """What celery_leases.task and celery_leases.publish rely on in Celery's
    private ``_task_stack`` (no public API pushes a running task or hides it):
    ``Task.__call__`` pushes the task, and the task on top whose request the
    worker made is the one Celery names the parent of what is sent."""
    app = Celery("layout", set_as_current=False)
    seen = []

    @app.task(shared=False)
    def body() -> None:
        seen.append(_task_stack.top)

    body()
    assert seen == [body]
    assert _task_stack.top is None
    body.push_request(id="worker-run", called_directly=False)
    _task_stack.push(body)
    try:
        assert app.current_worker_task is body
        _task_stack.pop()
        assert app.current_worker_task is None
    finally:
        body.pop_request()
