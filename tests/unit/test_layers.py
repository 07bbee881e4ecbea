"""The package's layers (docs/DESIGN.md, "Layers"): the import-linter contracts of pyproject.toml hold
for the package as it is, and they do fail on a wrong import (checked on a copy with one added)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _lint(package_parent: Path) -> subprocess.CompletedProcess:
    """Run import-linter with the repository's contracts on the ``p2p_diloco`` found in ``package_parent``."""
    env = os.environ | {"PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
         "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        capture_output=True, text=True, env=env, cwd=package_parent, timeout=120)


def test_every_import_follows_the_layers():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout


def test_an_import_against_the_layers_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "p2p_diloco", tmp_path / "p2p_diloco", ignore=shutil.ignore_patterns("__pycache__", "static"))
    outer = tmp_path / "p2p_diloco" / "algo" / "outer.py"
    outer.write_text(outer.read_text() + "\nfrom p2p_diloco.island import syncer  # noqa: E402 (the maths importing the island)\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "p2p_diloco.algo.outer -> p2p_diloco.island.syncer" in done.stdout, done.stdout
