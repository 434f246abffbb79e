"""What pyproject.toml promises a new user: the Python version, the parallel test run, and the
installed commands, whose README examples parse."""

import importlib
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from torchtitan_ext.launch import split_launcher_args
from torchtitan_ext.run_training import FlavorConfigManager

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_python_version_and_parallel_tests():
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"  # torchtitan 0.3.0 needs 3.11
    assert "pytest-xdist" in PYPROJECT["project"]["optional-dependencies"]["test"]
    addopts = PYPROJECT["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert "-n" in addopts and "-rfEs" in addopts


@pytest.mark.parametrize(
    "command, entry", [("moe-train", "torchtitan_ext.train:cli"), ("moe-flavors", "torchtitan_ext.flavors:main")]
)
def test_installed_commands_point_at_the_entry_points(command, entry):
    assert PYPROJECT["project"]["scripts"][command] == entry
    module, function = entry.split(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert f"`{command}`" in (ROOT / "README.md").read_text()


def test_readme_moe_train_commands_parse(monkeypatch):
    commands = [
        line for line in (ROOT / "README.md").read_text().splitlines() if re.search(r"(^|--no-python )moe-train ", line)
    ]
    assert len(commands) >= 2
    for line in commands:
        nproc = re.search(r"--nproc_per_node[= ](\d+)", line)
        monkeypatch.setenv("WORLD_SIZE", nproc.group(1) if nproc else "1")
        args = split_launcher_args(shlex.split(line.split("moe-train", 1)[1].split("#")[0]))[1]
        FlavorConfigManager().parse_args(args)


def test_every_source_file_imports_under_the_name_of_its_folder(tmp_path):
    """PYTHONPATH=<checkout> alone imports every module of the package from the file its dotted name
    spells (no import hook, no install): what editors and type checkers assume.

    ``python -S`` skips the site .pth files, so an editable install's finder is not there; the
    dependencies come from this interpreter's own search path (site-packages, dist-packages, a
    ``pip install --target`` folder) put on PYTHONPATH by hand, after the checkout. The top-level
    ``kernels`` and ``experiments`` entries are links into the package, so the files exist once, at
    their import path.
    """
    for folder in ("kernels", "experiments"):
        assert (ROOT / folder).is_symlink() and (ROOT / folder).resolve() == ROOT / "torchtitan_ext" / folder
    package = ROOT / "torchtitan_ext"
    assert not [p for p in package.rglob("*") if p.is_symlink()]
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for path in package.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    dependencies = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != ROOT]
    code = (
        "import importlib, sys\n"
        "assert not any('editable' in type(m).__name__.lower() for m in sys.meta_path), sys.meta_path\n"
        f"for name in {sorted(modules)!r}:\n"
        "    print(name, importlib.import_module(name).__file__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *dependencies])},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert imported == {name: str(path) for name, path in modules.items()}
