"""The layers of each package, as folders: no module imports from a layer above its own.

Across packages, lowest first: ``distlearn.common`` (the helpers every layer shares),
then ``distlearn.dataset`` and ``distlearn.ipc`` side by side, then ``distlearn`` itself.
``common`` imports nothing of distlearn but itself; ``dataset`` and ``ipc`` nothing but
themselves and ``common``.

Each package lists its layers lowest first; a module belongs to the first layer one of whose
prefixes names it (``index`` covers ``index.kinds`` and ``index.csv.lines``). An import
counts wherever it stands (module level, inside a function, under ``TYPE_CHECKING``): a
lazy import still runs upward. Modules of one layer may import each other, but the
module-level imports of a whole package hold no cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. The package's own __init__ (the public surface) is above every layer.
LAYERS = {
    "dataset": [
        # shared types and the public leaves that import nothing of the package; the image
        # processors' parts (augment, imagedecode), the batches' copy to a GPU (device),
        # and the loader's metrics, which every stage above feeds
        {"errors", "options", "items", "seeding", "processors", "serve"}
        | {"augment", "imagedecode", "device"}
        | {"metrics"},  # where the loader's time goes: timers, windows, verdicts, exporters
        {"formats"},  # bytes of one part or record -> records
        {"fetch"},  # sources, the Fetcher, the disk cache
        {"index"},  # kinds of index, CSV readers, part files -> Index
        {"sampling"},  # samplers and the item stream: which items each batch holds
        {"workers"},  # fetch + decode into the batch ring: threads or processes
        {"batcher", "mix"},  # the user's iterator, and a mix of datasets into one
    ],
    "ipc": [
        {"errors", "procs"},  # shared: errors, processes (and distlearn.common, below)
        {"transport"},  # the wire format, the secret, authenticated links
        {"rendezvous"},  # finding the other nodes: a Roster
        {"collectives"},  # all_reduce, scatter, barrier over a tree of links
        {"services"},  # client/server, map, work queues and channels on the same links
    ],
}
PACKAGE_NAMES = {"dataset": "distlearn.dataset", "ipc": "distlearn.ipc"}
# Folder -> the packages of distlearn its modules may import (their own included).
MAY_IMPORT = {
    "distlearn/common": {"distlearn.common"},
    "dataset": {"distlearn.dataset", "distlearn.common"},
    "ipc": {"distlearn.ipc", "distlearn.common"},
}


def _modules(package: str) -> dict[str, Path]:
    """Dotted name (relative to the package; "" for its __init__) -> file."""
    top = ROOT / package
    found = {}
    for path in sorted(top.rglob("*.py")):
        parts = list(path.relative_to(top).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(package: str, name: str, path: Path, known: set[str], top_only: bool):
    """The package's modules that `name` imports (resolved to known module names)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if name else []
    base = here if is_pkg else here[:-1]
    absolute = PACKAGE_NAMES[package] + "."
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if not isinstance(node, ast.ImportFrom | ast.Import):
            continue
        targets = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(absolute):
                    targets.append((alias.name[len(absolute) :], []))
        elif node.level:
            up = base[: len(base) - (node.level - 1)]
            target = ".".join([*up, *([node.module] if node.module else [])])
            targets.append((target, [a.name for a in node.names]))
        elif node.module and node.module.startswith(absolute):
            targets.append((node.module[len(absolute) :], [a.name for a in node.names]))
        for target, names in targets:
            subs = [f"{target}.{n}" if target else n for n in names]
            modules = [s for s in subs if s in known]
            found.update(modules or ([target] if target in known else []))
    found.discard(name)
    return found


def _layer(package: str, module: str) -> int:
    if module == "":
        return len(LAYERS[package])
    for i, prefixes in enumerate(LAYERS[package]):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{package}.{module} is in no layer of LAYERS[{package!r}]")


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_import_runs_upward(package):
    modules = _modules(package)
    upward = []
    for name, path in modules.items():
        mine = _layer(package, name)
        for target in _imports(package, name, path, set(modules), top_only=False):
            if _layer(package, target) > mine:
                upward.append(f"{package}.{name or '__init__'} imports {package}.{target}")
    assert not upward, "imports that run upward:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_import_cycle_at_module_level(package):
    modules = _modules(package)
    graph = {
        name: _imports(package, name, path, set(modules), top_only=True)
        for name, path in modules.items()
    }
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        if state.get(m) == 1:
            raise AssertionError(f"import cycle: {' -> '.join([*trail, m])}")
        if state.get(m) == 2:
            return
        state[m] = 1
        for n in sorted(graph[m]):
            visit(n, [*trail, m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


def test_the_packages_do_not_import_each_other():
    for package, other in (("dataset", "distlearn.ipc"), ("ipc", "distlearn.dataset")):
        for name, path in _modules(package).items():
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                bad = [n for n in names if n == other or n.startswith(other + ".")]
                assert not bad, f"{package}.{name or '__init__'} imports {bad[0]}"


def _distlearn_imports(folder: str):
    """(module, what it imports of distlearn) for every import of a module under `folder`,
    relative ones resolved (a relative import that climbs out of the folder, into the
    rest of distlearn, counts as the package it reaches)."""
    top = ROOT / folder
    package = "distlearn." + folder.rsplit("/", 1)[-1] if folder != "distlearn" else "distlearn"
    for path in sorted(top.rglob("*.py")):
        parts = list(path.relative_to(top).with_suffix("").parts)
        here = [*package.split("."), *parts]
        base = here[:-1]  # (an __init__'s own package is its folder: the same base)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                up = base[: len(base) - (node.level - 1)]
                names = [".".join([*up, *([node.module] if node.module else [])])]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name == "distlearn" or name.startswith("distlearn."):
                    yield path.relative_to(ROOT), name


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_a_layer_imports_nothing_of_distlearn_above_it(folder):
    allowed = MAY_IMPORT[folder]
    bad = [
        f"{path} imports {name}"
        for path, name in _distlearn_imports(folder)
        if not any(name == a or name.startswith(a + ".") for a in allowed)
    ]
    assert not bad, "imports that run upward:\n" + "\n".join(bad)


def test_the_checks_see_an_upward_import(tmp_path, monkeypatch):
    """The two kinds the check above must catch (it would pass on nothing seen)."""
    folder = tmp_path / "ipc" / "sub"
    folder.mkdir(parents=True)
    (folder / "m.py").write_text("import distlearn.sgd\nfrom ...dataset import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = sorted(name for _, name in _distlearn_imports("ipc"))
    assert found == ["distlearn.dataset", "distlearn.sgd"]


def test_every_module_is_in_a_layer():
    for package in LAYERS:
        for name in _modules(package):
            _layer(package, name)
