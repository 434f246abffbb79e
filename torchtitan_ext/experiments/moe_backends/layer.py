"""Layer-level configs of the MoE backends experiment (no model, no Trainer imports).

``use_backend_experts`` swaps every ``GroupedExperts.Config`` in any torchtitan config for
``BackendGroupedExperts.Config`` so the compute backend becomes a config field;
``use_routing`` swaps torchtitan's MoE, routed-experts, router, router gate and standard
token dispatcher configs for ``RoutedMoE`` / ``FusedRoutedExperts`` / ``BalancedTopKRouter`` /
``RouterGate`` / ``RoutingDispatcher`` (same defaults, extra knobs off). ``stock_moe_config``
is torchtitan's own MoE layer config and ``moe_layer_config`` the same layer with ours;
``routing_dispatchers`` finds our dispatchers in a ``Trainer.Config``.
"""

from collections.abc import Callable
from functools import partial
from typing import TypeVar, overload

from torch import nn
from torchtitan.config.override import derive
from torchtitan.models.common.config_utils import (
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
)

from .dispatcher import RoutingDispatcher
from .experts import BackendGroupedExperts, ComputeBackend, FusedRoutedExperts
from .fp8_experts import ExpertPrecision
from .model_shapes import ScoreFunc
from .moe import RoutedMoE
from .router import BalancedTopKRouter, RouterGate


def use_backend_experts(model_config, compute_backend: ComputeBackend):
    """Replace every ``GroupedExperts.Config`` in ``model_config`` (in place) by ours."""
    for _, experts, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        _replace(parent, attr, derive(experts, BackendGroupedExperts.Config, compute_backend=compute_backend))
    return model_config


def _replace(parent, attr, replacement) -> None:
    if isinstance(parent, list):
        parent[attr] = replacement
    else:
        setattr(parent, attr, replacement)


ModelConfig = TypeVar("ModelConfig")


@overload
def use_routing(model_config: MoE.Config) -> RoutedMoE.Config: ...
@overload
def use_routing(model_config: ModelConfig) -> ModelConfig: ...
def use_routing(model_config):
    """Swap every torchtitan MoE / router / gate / standard dispatcher config (in place) for ours.

    Returns ``model_config`` (or the replacement when it is itself an ``MoE.Config``).
    Field values carry over through torchtitan's ``derive``, so the routing recipe is
    unchanged; dispatchers of other comm backends (DeepEP, HybridEP, ...) are left alone.
    """
    for _, moe, parent, attr in list(model_config.traverse(MoE.Config)):
        router = moe.router
        if not isinstance(router, BalancedTopKRouter.Config):
            router = derive(router, BalancedTopKRouter.Config)
        if type(router.gate) is Linear.Config:
            router.gate = derive(router.gate, RouterGate.Config)
        if type(moe.routed_experts) is RoutedExperts.Config:
            moe.routed_experts = derive(moe.routed_experts, FusedRoutedExperts.Config)
        dispatcher = moe.routed_experts.token_dispatcher
        if type(dispatcher) in (LocalTokenDispatcher.Config, AllToAllTokenDispatcher.Config):
            moe.routed_experts.token_dispatcher = derive(dispatcher, RoutingDispatcher.Config)
        if not isinstance(moe, RoutedMoE.Config):
            replacement = derive(moe, RoutedMoE.Config, router=router)
            if parent is None:
                return replacement
            _replace(parent, attr, replacement)
    return model_config


def stock_moe_config(
    *,
    dim: int,
    hidden_dim: int,
    num_experts: int,
    top_k: int,
    score_func: ScoreFunc = "softmax",
    route_norm: bool = True,
    load_balance_coeff: float | None = 1e-3,
    init_std: float = 0.02,
    gate_param_init: dict[str, Callable] | None = None,
    experts_param_init: dict[str, Callable] | None = None,
) -> MoE.Config:
    """torchtitan's own MoE layer (router, standard dispatcher, grouped_mm experts).

    Parameters initialise from ``normal(0, init_std)`` unless ``gate_param_init`` /
    ``experts_param_init`` (torchtitan ``param_init`` dicts) say otherwise.
    """
    normal: Callable = partial(nn.init.normal_, std=init_std)
    return make_moe_config(
        num_experts=num_experts,
        router=make_router_config(
            dim=dim,
            num_experts=num_experts,
            gate_param_init=gate_param_init or {"weight": normal},
            top_k=top_k,
            score_func=score_func,
            route_norm=route_norm,
        ),
        routed_experts=make_routed_experts_config(
            dim=dim,
            hidden_dim=hidden_dim,
            num_experts=num_experts,
            top_k=top_k,
            param_init=experts_param_init or {"w1_EFD": normal, "w2_EDF": normal, "w3_EFD": normal},
            comm_backend="standard",
        ),
        load_balance_coeff=load_balance_coeff,
    )


def moe_layer_config(*, compute_backend: ComputeBackend, **shape) -> RoutedMoE.Config:
    """``stock_moe_config(**shape)`` with this experiment's router, dispatcher and experts."""
    return use_routing(use_backend_experts(stock_moe_config(**shape), compute_backend))


def with_expert_precision(config: RoutedMoE.Config, precision: ExpertPrecision) -> RoutedMoE.Config:
    """``config`` (a ``moe_layer_config``) with its experts' GEMMs computing in ``precision``."""
    experts = config.routed_experts.inner_experts
    if not isinstance(experts, BackendGroupedExperts.Config):
        raise TypeError(f"the layer's experts ({type(experts).__qualname__}) have no expert_precision")
    experts.expert_precision = precision
    return config


def routing_dispatchers(config) -> list[RoutingDispatcher.Config]:
    """The project's token dispatchers of every MoE layer of a ``Trainer.Config`` (none for torchtitan's own MoE)."""
    if config.model_spec is None:
        return []
    return [
        moe.routed_experts.token_dispatcher
        for _, moe, _, _ in config.model_spec.model.traverse(RoutedMoE.Config)
        if isinstance(moe.routed_experts.token_dispatcher, RoutingDispatcher.Config)
    ]
