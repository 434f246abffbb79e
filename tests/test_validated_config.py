"""The configs of the MoE layer check their options through one mixin: every broken rule is listed
when the config is built, and the start-up check names each field as the user spelled it."""

import pytest

from torchtitan_ext.experiments.moe_backends.dispatcher import RoutingDispatcher
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts
from torchtitan_ext.experiments.moe_backends.moe import RoutedMoE
from torchtitan_ext.experiments.moe_backends.router import BalancedTopKRouter
from torchtitan_ext.experiments.moe_backends.startup_checks import VALIDATED_CONFIGS
from torchtitan_ext.experiments.moe_backends.validated_config import (
    ValidatedConfig,
    choice_errors,
    positive_or_off_errors,
)


def test_every_validated_config_uses_the_mixin():
    assert set(VALIDATED_CONFIGS) == {
        RoutedMoE.Config,
        BalancedTopKRouter.Config,
        RoutingDispatcher.Config,
        BackendGroupedExperts.Config,
    }
    assert all(issubclass(config_class, ValidatedConfig) for config_class in VALIDATED_CONFIGS)


def test_construction_lists_every_broken_rule():
    with pytest.raises(ValueError) as error:
        # pyrefly: ignore[bad-argument-type]  # invalid values on purpose: the test checks they are refused
        RoutingDispatcher.Config(num_experts=2, top_k=1, permute_backend="numpy", ep_transport="nvlink", align_size=0)
    assert str(error.value) == (
        "permute_backend = 'numpy': not one of the valid choices: auto, torch, triton; "
        "ep_transport = 'nvlink': not one of the valid choices: auto, all_to_all, symm_mem; "
        "align_size = 0: must be an integer >= 1 (1 = off)"
    )
    with pytest.raises(ValueError, match="compute_backend = 'cuda_magic': unknown backend"):
        BackendGroupedExperts.Config(dim=8, hidden_dim=8, num_experts=2, compute_backend="cuda_magic")


def test_a_valid_config_is_silent_and_names_fields_through_key():
    dispatcher = RoutingDispatcher.Config(num_experts=2, top_k=1)
    assert dispatcher.validation_errors() == []
    dispatcher.align_size = 0
    assert dispatcher.validation_errors(lambda field: f"my.toml:3: moe.{field}") == [
        "my.toml:3: moe.align_size = 0: must be an integer >= 1 (1 = off)"
    ]


def test_rule_helpers():
    assert choice_errors(str, "mode", "b", ("a", "b")) == []
    assert choice_errors(str, "mode", "c", ("a", "b")) == ["mode = 'c': not one of the valid choices: a, b"]
    assert positive_or_off_errors(str, "factor", None) == [] and positive_or_off_errors(str, "factor", 0.5) == []
    assert positive_or_off_errors(str, "factor", 0) == ["factor = 0: must be > 0, or off (None; 0 in TOML)"]
