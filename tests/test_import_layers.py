"""Imports flow one way: base <- kernels <- experiment <- framework <- experiment registration <- CLIs/benchmarks.

Every ``import`` in the project's source (module level or inside a function) is parsed with
``ast`` and checked against the layer of the importing module; no module imports a layer above
its own. The experiment's registration modules (its flavors, TOML keys and Trainer-feature
checks) plug into the framework's registries, so they sit above the framework; the framework
reaches them only through the registry's package discovery, never by an import. The framework
imports no experiment module at all (the metrics read layers by duck type and torchtitan's
classes, and ask the registry what describes a run); only the registry names the experiments
package, to discover it. The base modules (the process's place in the launch) import nothing of
the project, so every layer may import them.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REGISTRATION_MODULES = {"flavors", "toml_keys", "startup_checks", "run_description", "torchtitan_features"}
"""Modules of an experiment that register with the framework (flavors, TOML keys, start-up checks,
run descriptions and start-up notes)."""
BASE_MODULES = {"torchtitan_ext.place_in_launch"}
"""Framework modules below every layer: they import nothing of the project."""

BASE, KERNELS, EXPERIMENT, FRAMEWORK, REGISTRATION, TOP = range(6)
LAYER_NAMES = ["base", "kernels", "experiment", "framework", "experiment registration", "CLIs and benchmarks"]
TOP_MODULES = {
    "torchtitan_ext.train",
    "torchtitan_ext.run_training",
    "torchtitan_ext.launch",
    "torchtitan_ext.flavors",
    "torchtitan_ext.command_facts",
}
"""The user-facing CLIs of the framework package."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    if module in BASE_MODULES:
        return BASE
    if module.startswith("torchtitan_ext.kernels"):
        return KERNELS
    if module.startswith("torchtitan_ext.experiments"):
        return REGISTRATION if module.rsplit(".", 1)[-1] in REGISTRATION_MODULES else EXPERIMENT
    if module.startswith("torchtitan_ext.bench") or module in TOP_MODULES:
        return TOP
    return FRAMEWORK


def project_imports(path: Path, module: str) -> set[str]:
    """Every ``torchtitan_ext`` module ``path`` imports, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("torchtitan_ext")}


def known(module: str, modules: set[str]) -> str:
    """``module`` itself when it is a project module, else the package it names an attribute of."""
    while module not in modules and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


SOURCES = sorted((ROOT / "torchtitan_ext").rglob("*.py"))


def test_sources_found():
    assert {module_name(p) for p in SOURCES} >= {
        "torchtitan_ext.kernels.fused_moe",
        "torchtitan_ext.experiments.moe_backends.experts",
        "torchtitan_ext.bench.__main__",
    }


def test_base_modules_import_nothing_of_the_project():
    for module in BASE_MODULES:
        assert project_imports(ROOT / (module.replace(".", "/") + ".py"), module) == set(), module


EXPERIMENT_SOURCES = [path for path in SOURCES if module_name(path).startswith("torchtitan_ext.experiments.")]


@pytest.mark.parametrize("path", EXPERIMENT_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_an_experiment_module_registers_with_the_framework_exactly_when_it_is_a_registration_module(path):
    module = module_name(path)
    registers = sorted(
        name
        for name in project_imports(path, module)
        if name.rsplit(".", 1)[-1].startswith("register_") and layer(name.rsplit(".", 1)[0]) == FRAMEWORK
    )
    assert bool(registers) == (layer(module) == REGISTRATION), (module, registers)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_layer_above_its_own(path):
    modules = {module_name(p) for p in SOURCES}
    importer = module_name(path)
    upward = sorted(
        f"{target} ({LAYER_NAMES[layer(target)]})"
        for target in {known(name, modules) for name in project_imports(path, importer)}
        if layer(target) > layer(importer)
    )
    assert not upward, f"{importer} ({LAYER_NAMES[layer(importer)]}) imports a layer above it: {upward}"


REGISTRY = "torchtitan_ext.registry"
"""The one framework module that names the experiments package: it discovers the experiments."""
FRAMEWORK_SOURCES = [path for path in SOURCES if layer(module_name(path)) == FRAMEWORK]


def experiment_imports(path: Path) -> list[str]:
    return sorted(
        name for name in project_imports(path, module_name(path)) if name.startswith("torchtitan_ext.experiments")
    )


def test_framework_sources_found():
    names = {module_name(p) for p in FRAMEWORK_SOURCES}
    assert {
        REGISTRY,
        "torchtitan_ext.metrics.observer",
        "torchtitan_ext.metrics.metadata",
        "torchtitan_ext.validation",
    } <= names


@pytest.mark.parametrize("path", FRAMEWORK_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_framework_reaches_the_experiments_only_through_the_registry(path):
    imported = experiment_imports(path)
    if module_name(path) == REGISTRY:
        assert imported == ["torchtitan_ext.experiments"], imported  # the package, for discovery
    else:
        assert not imported, (
            f"{module_name(path)} imports experiment modules {imported}; use the registry or duck types"
        )


def test_layer_expert_and_ep_benchmarks_do_not_load_the_trainer_stack():
    """``python -m torchtitan_ext.bench layer|expert|ep`` run on torch releases older than the one
    torchtitan's Trainer needs: the CLI loads the Trainer stack only for ``train-step``/``auto``."""
    import subprocess
    import sys

    probe = (
        "import sys, torchtitan_ext.bench.__main__\n"
        "print(sorted(m for m in ('torchtitan.distributed.fsdp', 'torchtitan.trainer', 'torchtitan_ext.train', "
        "'torchtitan_ext.compat.cpu') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "[]", loaded.stdout
