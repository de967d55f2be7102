"""The import contract (pyproject.toml `[tool.importlinter]`): forge_rl's layers and the Monarch,
vLLM and TorchTitan bans, checked by import-linter over the package as it is, and shown to fail on a
copy of the package with one upward or banned import planted in it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the forge_rl package found under `root`, with `root`'s contract."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


def test_the_package_keeps_its_import_contract():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture
def package_copy(tmp_path) -> Path:
    """forge_rl's sources and its contract, copied: a planted import changes nothing of the repo."""
    shutil.copytree(REPO / "forge_rl", tmp_path / "forge_rl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(package_copy: Path, module: str, line: str) -> None:
    path = package_copy / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_an_upward_import_breaks_the_layers(package_copy):
    plant(package_copy, "forge_rl.core.buffer", "import forge_rl.run.loop")
    result = lint_imports(package_copy)
    assert result.returncode != 0
    assert "forge_rl.core is not allowed to import forge_rl.run" in result.stdout


def test_monarch_imported_below_the_shells_breaks_the_contract(package_copy):
    plant(package_copy, "forge_rl.scoring.scorers", "import monarch.actor")
    result = lint_imports(package_copy)
    assert result.returncode != 0
    assert "forge_rl.scoring is not allowed to import monarch" in result.stdout


def test_vllm_imported_by_the_functional_core_breaks_the_contract(package_copy):
    plant(package_copy, "forge_rl.core.columns", "def engine():\n    import vllm")
    result = lint_imports(package_copy)
    assert result.returncode != 0
    assert "forge_rl.core is not allowed to import vllm" in result.stdout
