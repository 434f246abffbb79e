"""Lint, format and type checks of the whole project (settings in pyproject.toml): ruff finds
nothing to report or reformat, and pyrefly reports no error, against the packages of the Python
running the tests."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECKS = {
    "ruff check": ["ruff", "check", "."],
    "ruff format": ["ruff", "format", "--check", "."],
    "pyrefly check": ["pyrefly", "check", "--python-interpreter-path", sys.executable],
}


def installed_tool(name: str) -> str:
    """The tool's executable next to this Python (its virtual environment), else on PATH; skip if neither."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (the test extra installs it: pip install -e '.[test]')")
    return found


@pytest.mark.parametrize("check", CHECKS)
def test_the_project_passes(check):
    tool, *arguments = CHECKS[check]
    result = subprocess.run([installed_tool(tool), *arguments], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{check} failed:\n{result.stdout}{result.stderr}"
