"""docs/adding_an_experiment.md, followed: a toy experiment package with one flavor is found by
the registry, and its config loads through --flavor's registry and torchtitan's ConfigManager."""

import re
import sys
import textwrap
from pathlib import Path

import pytest
from torchtitan.config.manager import ConfigManager
from torchtitan.trainer import Trainer

import torchtitan_ext.experiments as experiments_package
from torchtitan_ext import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding_an_experiment.md"
TOY = "toy_experiment"


def documented_flavors_module() -> str:
    """The flavors.py example of step 3 of the doc."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (example,) = [block for block in blocks if "@register_flavor" in block]
    return textwrap.dedent(example)


@pytest.fixture
def toy_experiment(tmp_path, monkeypatch):
    """Steps 1 and 3: the package folder on the experiments path, its flavors.py from the doc."""
    package = tmp_path / TOY
    package.mkdir()
    (package / "__init__.py").write_text('"""A toy experiment: one flavor."""\n')
    (package / "flavors.py").write_text(documented_flavors_module())
    registry.load_experiments()  # the real experiments register into the real table first
    monkeypatch.setattr(experiments_package, "__path__", [*experiments_package.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_FLAVORS", dict(registry._FLAVORS))
    yield f"{experiments_package.__name__}.{TOY}"
    for name in [m for m in sys.modules if m.startswith(f"{experiments_package.__name__}.{TOY}")]:
        del sys.modules[name]


def test_registry_finds_the_flavor_and_its_config_builds(toy_experiment):
    flavor = registry.get_flavor("my-tiny")
    assert flavor.experiment == TOY
    assert isinstance(flavor.build(), Trainer.Config)
    assert flavor.torchtitan_args == ["--module", f"{toy_experiment}.flavors", "--config", "my_tiny"]


def test_torchtitan_loads_the_flavor_with_module_and_config(toy_experiment):
    config = ConfigManager().parse_args(
        ["--module", f"{toy_experiment}.flavors", "--config", "my_tiny", "--training.steps", "3"]
    )
    assert isinstance(config, Trainer.Config) and config.training.steps == 3
