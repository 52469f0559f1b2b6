"""The docs' code names what exists: every `from distlearn... import ...` in a Python
block of the README, CONTRIBUTING or docs/ imports. (mkdocs build --strict, in
tests/run.sh, checks the links and the API reference; this checks the examples.)"""

from __future__ import annotations

import importlib
import re

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
IMPORT = re.compile(r"^\s*from (distlearn[\w.]*) import ([\w, ]+)", re.M)


def _imports() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        for block in BLOCK.findall(page.read_text()):
            for module, names in IMPORT.findall(block):
                for name in names.split(","):
                    found.append((page.name, module, name.strip()))
    return found


@pytest.mark.parametrize(("page", "module", "name"), _imports())
def test_what_the_docs_import_exists(page, module, name):
    if not hasattr(importlib.import_module(module), name):
        importlib.import_module(f"{module}.{name}")  # a submodule: `from distlearn import ipc`


def test_the_docs_have_imports_to_check():
    assert len(_imports()) > 20
