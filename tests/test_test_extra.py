"""The test extra installs what the tests import: the README's set-up collects the suite on a fresh machine."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCAL = {"model", "kernels", "rankwire", "server", "tests", "conftest"}


def _module_level_imports(path: Path) -> set[str]:
    """Top-level module names a file imports when it is imported (module level, `if` blocks included; a `try` block is
    taken as an optional import and left out)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return names


def _installed_closure(requirements: list[str]) -> set[str]:
    """The canonical names of every distribution these requirements pull in, by the installed distributions' own
    metadata (markers evaluated with the extras asked for)."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    stack = [(Requirement(line), "") for line in requirements]
    while stack:
        req, extra = stack.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = (canonicalize_name(req.name), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue
        for line in dist.requires or []:
            sub = Requirement(line)
            for wanted in ("", *req.extras):
                if sub.marker is None or sub.marker.evaluate({"extra": wanted}):
                    stack.append((sub, wanted))
                    break
    return {name for name, _ in seen}


def test_test_extra_installs_every_package_the_tests_import():
    """`pip install -e ".[test]"` must install every third-party module the test suite imports at module level, so
    the README's `python -m pytest -q -n 2 tests` collects on a fresh machine."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    installed = _installed_closure([*project["dependencies"], *project["optional-dependencies"]["test"]])
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    helpers = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    local = LOCAL | scripts | helpers
    std = set(sys.stdlib_module_names)
    importers: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        names = _module_level_imports(path)
        for name in names & scripts:  # conftest puts scripts/ on sys.path; their imports count too
            for sub in _module_level_imports(ROOT / "scripts" / f"{name}.py") - std - local:
                importers.setdefault(sub, set()).add(f"scripts/{name}.py via {path.relative_to(ROOT)}")
        for name in names - std - local:
            importers.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    providers = packages_distributions()
    missing = {}
    for module, where in sorted(importers.items()):
        dists = {canonicalize_name(d) for d in providers.get(module, [module])}
        if not dists & installed:
            missing[module] = sorted(where)[:3]
    assert not missing, (
        f"imported by the tests but installed by neither [project.dependencies] nor the [test] extra (nor anything "
        f"they require): {missing}"
    )
