"""Every flavor is a torchtitan config-registry function: torchtitan's own ``ConfigManager``
loads it with ``--module <flavors module> --config <function>``, as ``--flavor`` does."""

import importlib
import re

import pytest
from helpers import model_config
from torchtitan.config.manager import ConfigManager
from torchtitan.trainer import Trainer

from torchtitan_ext.registry import all_flavors, get_flavor, register_flavor

FLAVORS_MODULE = "torchtitan_ext.experiments.moe_backends.flavors"


def comparable(config) -> str:
    """The config's repr without object addresses (closures are rebuilt by every call)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(config))


def test_every_flavor_is_a_named_function_of_its_flavors_module():
    for flavor in all_flavors():
        module = importlib.import_module(flavor.build.__module__)
        assert getattr(module, flavor.build.__name__) is flavor.build, flavor.name
        assert flavor.torchtitan_args == ["--module", module.__name__, "--config", flavor.build.__name__]


def test_torchtitan_config_manager_loads_a_flavor():
    flavor = get_flavor("tiny-moe-grouped-mm")
    assert flavor.torchtitan_args == ["--module", FLAVORS_MODULE, "--config", "tiny_moe_grouped_mm"]
    config = ConfigManager().parse_args(flavor.torchtitan_args)
    assert comparable(config) == comparable(flavor.build())


def test_torchtitan_config_manager_applies_its_overrides_to_a_flavor():
    config = ConfigManager().parse_args(
        ["--module", FLAVORS_MODULE, "--config", "tiny_moe_triton", "--training.steps", "3"]
    )
    assert isinstance(config, Trainer.Config)  # torchtitan types the parsed config as object
    assert config.training.steps == 3
    moe = model_config(config).layers[0].moe
    assert moe.routed_experts.inner_experts.compute_backend == "triton"


def test_a_lambda_is_refused_as_a_flavor():
    with pytest.raises(ValueError, match="named function"):
        # pyrefly: ignore[bad-argument-type]  # not a Trainer.Config builder, on purpose: it is refused first
        register_flavor("lambda-flavor", "not reachable as --config")(lambda: None)
