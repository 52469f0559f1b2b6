"""MkDocs hooks: what the docs site takes from the repository rather than from docs/.

- The measurements: every ``bench/RESULTS*.md`` (and ``bench/results.png``) becomes a
  page of the site at the same path, listed under "Measurements", so the guides link
  to the figures' provenance instead of copying it. A guide links ``../bench/X`` (right
  on GitHub too); the link is read as ``bench/X`` here.
- The option tables: ``<!-- options: dataset -->`` in a page becomes the table of every
  ``Dataset``/``sampled_batcher`` option with its default, read from
  ``distlearn.dataset.options`` and the signatures, and described by ``docs/options.yml``.
  An option without a description, or a description of an option that no longer exists,
  fails the build: the table cannot drift from the code.
- The API reference: mkdocstrings reads ``distlearn.dataset`` and ``distlearn.ipc``, which
  the repository keeps at its top level (``dataset/``, ``ipc/``). A temporary folder holds
  the tree as installed (``distlearn/`` with ``dataset`` and ``ipc`` inside it, as links).
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
_tree: Path | None = None

# ------------------------------------------------------------------ the installed tree


@event_priority(100)  # before mkdocstrings makes its handler, which reads the paths
def on_config(config: Any) -> Any:
    global _tree
    _tree = Path(tempfile.mkdtemp(prefix="distlearn-docs-"))
    atexit.register(shutil.rmtree, _tree, ignore_errors=True)  # a failed build too
    pkg = _tree / "distlearn"
    pkg.mkdir()
    for path in (REPO / "distlearn").iterdir():
        (pkg / path.name).symlink_to(path)
    for name in ("dataset", "ipc"):
        (pkg / name).symlink_to(REPO / name)
    handlers = config["plugins"]["mkdocstrings"].config["handlers"]
    handlers.setdefault("python", {})["paths"] = [str(_tree)]
    _add_measurements_to_nav(config)
    return config


# ------------------------------------------------------------------ the measurements


def _measurements() -> list[Path]:
    return sorted((REPO / "bench").glob("RESULTS*.md"))


def _add_measurements_to_nav(config: Any) -> None:
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Measurements" in entry:
            first = entry["Measurements"]
            pages = [{p.name: f"bench/{p.name}"} for p in _measurements()]
            entry["Measurements"] = [first if isinstance(first, str) else first[0], *pages]
            return
    raise ValueError("mkdocs.yml: the nav has no 'Measurements' entry for bench/RESULTS*.md")


def on_files(files: Any, config: Any) -> Any:
    extra = [*_measurements(), REPO / "bench" / "results.png"]
    for path in extra:
        files.append(File.generated(config, f"bench/{path.name}", abs_src_path=str(path)))
    return files


# ------------------------------------------------------------------ page text

_UP_TO_BENCH = re.compile(r"\]\(\.\./bench/")
_MARKER = re.compile(r"<!-- options: (\w+) -->")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if not page.file.src_uri.startswith("bench/"):
        markdown = _UP_TO_BENCH.sub("](bench/", markdown)
    markdown = markdown.replace("<!-- measurements -->", _measurements_list())
    return _MARKER.sub(lambda m: _options_table(m.group(1)), markdown)


def _measurements_list() -> str:
    out = []
    for path in _measurements():
        title = next(
            (line[2:].strip() for line in path.read_text().splitlines() if line.startswith("# ")),
            path.name,
        )
        out.append(f"- [{path.name}](bench/{path.name}): {title}")
    return "\n".join(out)


def _options_table(which: str) -> str:
    if which != "dataset":
        raise ValueError(f"unknown options table {which!r}")
    from distlearn.dataset import Dataset
    from distlearn.dataset import options as opts

    described = yaml.safe_load((REPO / "docs" / "options.yml").read_text())
    rows: list[tuple[str, str, str, str]] = []  # (name, where, default, group)

    def own(fn: Any, skip: tuple[str, ...]) -> list[tuple[str, Any]]:
        params = inspect.signature(fn).parameters.values()
        return [
            (p.name, p.default)
            for p in params
            if p.name not in skip and p.kind == p.POSITIONAL_OR_KEYWORD
        ]

    for name, default in own(Dataset.__init__, ("self",)):
        rows.append((name, "`Dataset`", _show(default), "dataset"))
    for name, default in own(Dataset.sampled_batcher, ("self",)):
        rows.append((name, "`sampled_batcher`", _show(default), "batcher"))
    batcher_groups = ("fetch", "cache", "workers", "sampling")
    for group, cls in opts.GROUPS.items():
        where = "both" if group in batcher_groups else "`Dataset`"
        for f in dataclasses.fields(cls):
            if any(r[0] == f.name for r in rows):
                continue  # pool_size, prefetch: the batcher's own arguments
            rows.append((f.name, where, _show(_default(f)), group))

    names = [r[0] for r in rows]
    missing = [n for n in names if n not in described]
    stale = [n for n in described if n not in names]
    if missing or stale:
        raise ValueError(
            f"docs/options.yml does not match the code: no description for {missing}, "
            f"descriptions of options that do not exist: {stale}"
        )
    out = ["| option | given to | default | group | what it does |", "|---|---|---|---|---|"]
    for name, where, default, group in rows:
        text = " ".join(str(described[name]).split())
        out.append(f"| `{name}` | {where} | {default} | {group} | {text} |")
    return "\n".join(out)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _show(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        for unit, shift in (("GiB", 30), ("MiB", 20)):
            if value % (1 << shift) == 0:
                return f"{value >> shift} {unit}"
    return f"`{value!r}`"
