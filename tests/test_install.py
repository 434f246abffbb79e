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
from torchtitan_ext.train import FlavorConfigManager

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_python_version_and_parallel_tests():
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"  # torchtitan 0.3.0 needs 3.11
    assert "pytest-xdist" in PYPROJECT["project"]["optional-dependencies"]["test"]
    addopts = PYPROJECT["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert "-n" in addopts and "-rfEs" in addopts


@pytest.mark.parametrize("command, entry", [("moe-train", "torchtitan_ext.train:cli"),
                                            ("moe-flavors", "torchtitan_ext.flavors:main")])
def test_installed_commands_point_at_the_entry_points(command, entry):
    assert PYPROJECT["project"]["scripts"][command] == entry
    module, function = entry.split(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert f"`{command}`" in (ROOT / "README.md").read_text()


def test_readme_moe_train_commands_parse(monkeypatch):
    commands = [line for line in (ROOT / "README.md").read_text().splitlines()
                if re.search(r"(^|--no-python )moe-train ", line)]
    assert len(commands) >= 2
    for line in commands:
        nproc = re.search(r"--nproc_per_node[= ](\d+)", line)
        monkeypatch.setenv("WORLD_SIZE", nproc.group(1) if nproc else "1")
        args = split_launcher_args(shlex.split(line.split("moe-train", 1)[1].split("#")[0]))[1]
        FlavorConfigManager().parse_args(args)


def test_checkout_imports_without_install_or_symlinks(tmp_path):
    """PYTHONPATH=<checkout> alone imports kernels/ and experiments/ under torchtitan_ext.

    ``python -S`` skips the site .pth files, so the editable install's finder is not there;
    the dependencies come from site-packages put on PYTHONPATH by hand.
    """
    assert not [p for folder in ("torchtitan_ext", "kernels", "experiments") for p in (ROOT / folder).rglob("*")
                if p.is_symlink()]
    site_packages = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "torch").is_dir())
    code = (
        "import sys, torchtitan_ext.kernels.fused_moe as k, torchtitan_ext.experiments.moe_backends.flavors as f;"
        "assert not any('editable' in type(m).__name__.lower() for m in sys.meta_path), sys.meta_path;"
        "print(k.__file__); print(f.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site_packages}"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(ROOT / "kernels" / "fused_moe.py"),
                                     str(ROOT / "experiments" / "moe_backends" / "flavors.py")]
