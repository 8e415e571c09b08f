"""Packaging rules: import contracts, a light client import, docstrings, the README quick start."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted((ROOT / "rametfs").rglob("*.py"))


def test_import_contracts_hold():
    # lint-imports reads the contracts from pyproject.toml in its working directory.
    lint_imports = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint_imports), "--no-cache", "--no-logo"], cwd=ROOT, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("statement", ["import rametfs", "from rametfs import Ramet"])
def test_client_import_stays_light(statement):
    code = (f"{statement}; import json, sys; "
            "print(json.dumps([m for m in ('pyfuse3', 'lmdb', 'trio') if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_has_docstring(path):
    assert ast.get_docstring(ast.parse(path.read_text(), str(path)))


def test_no_top_level_module_shadows_the_standard_library():
    """tools/setup runs rametfs/pyfuse3_build.py by path, which puts rametfs/ first on the
    import path: a rametfs/types.py there made the build import it for the standard
    library's ``types``, fail, and fall back to plain mode on a fresh machine."""
    package = Path(__file__).resolve().parent.parent / "rametfs"
    names = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir()
                                                      if (p / "__init__.py").exists()}
    assert sorted(names & set(sys.stdlib_module_names)) == []


def test_readme_quick_start_is_two_commands():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start.*?$(.*?)(?=^## )", readme, re.M | re.S)
    assert section, "README.md has no '## Quick start' section"
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", section.group(1), re.M | re.S)
    commands = [(lang, line.strip()) for lang, body in blocks
                for line in body.splitlines() if line.strip()]
    assert commands == [("sh", "tools/demo"), ("sh", "tools/test")]
