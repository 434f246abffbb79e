"""Short TOML keys of the MoE backends experiment (``[moe]`` table), its start-up checks, run description and start-up note.

Every ``moe.*`` key sets one option on every MoE layer of the flavor's model; see
docs/routing_and_ep.md. A key only converts the TOML spelling (0 = off becomes None); each
option is checked once, by its config's ``validation_errors``. ``check_moe_config`` runs those
on the final config (after TOML and CLI), with the rules that need several configs, the parallel
layout or this machine, before any process group is built.
"""

import os
from typing import Literal

import torch
from torchtitan.models.common.moe import GroupedExperts

from torchtitan_ext.kernels.availability import interpreter_enabled, triton_available_reason
from torchtitan_ext.overrides import ConfigError, register_config_check, register_short_key
from torchtitan_ext.registry import register_run_description, register_startup_note
from torchtitan_ext.validation import data_parallel_shard_degree, launch_command, named
from torchtitan_ext.validation import world_size as current_world_size

from .auto_backend import AutoBackendError, resolve_auto_compute_backend
from .dispatcher import EPTransport, PermuteBackend, RoutingDispatcher
from .experts import AUTO_BACKEND, DEFAULT_BACKEND, BackendGroupedExperts, ComputeBackendChoice, get_backend
from .moe import AuxLossType, RoutedMoE
from .router import BalancedTopKRouter


@register_short_key(
    "moe.compute_backend",
    ComputeBackendChoice,
    "expert compute backend of every MoE layer (auto: fastest here, chosen at start-up)",
)
def set_compute_backend(config, backend: str) -> None:
    experts = list(config.model_spec.model.traverse(BackendGroupedExperts.Config))
    if not experts:
        raise ConfigError("moe.compute_backend: this flavor's model has no backend-switchable experts")
    for _, experts_config, _, _ in experts:
        experts_config.compute_backend = backend


@register_run_description
def compute_backend_of_run(config) -> dict:
    """``compute_backend`` of the run metadata: the backend of every experts module (torchtitan's own
    computes as the default backend), one name when they agree."""
    backends = []
    if config.model_spec is not None:
        backends = sorted(
            {
                experts.compute_backend if isinstance(experts, BackendGroupedExperts.Config) else DEFAULT_BACKEND
                for _, experts, _, _ in config.model_spec.model.traverse(GroupedExperts.Config)
            }
        )
    return {"compute_backend": backends[0] if len(backends) == 1 else backends}


def routing_dispatchers(config) -> list[RoutingDispatcher.Config]:
    """The project's token dispatchers of every MoE layer (none for torchtitan's own MoE)."""
    if config.model_spec is None:
        return []
    return [
        moe.routed_experts.token_dispatcher
        for _, moe, _, _ in config.model_spec.model.traverse(RoutedMoE.Config)
        if isinstance(moe.routed_experts.token_dispatcher, RoutingDispatcher.Config)
    ]


@register_run_description
def ep_transport_of_run(config) -> dict:
    """``ep_transport`` of the run metadata under expert parallelism: how EP rows move, one name when
    every MoE layer agrees; nothing without EP or without the project's dispatcher."""
    transports = sorted({dispatcher.ep_transport for dispatcher in routing_dispatchers(config)})
    if config.parallelism.expert_parallel_degree <= 1 or not transports:
        return {}
    return {"ep_transport": transports[0] if len(transports) == 1 else transports}


@register_startup_note
def symm_mem_within_a_host(config) -> str | None:
    """A note when EP rows go through all-to-alls on CUDA GPUs although every EP group fits in this
    host, where ``symm_mem`` moves them with one kernel each way."""
    ep = config.parallelism.expert_parallel_degree
    if ep_transport_of_run(config).get("ep_transport") != "all_to_all":
        return None
    if not torch.cuda.is_available() or interpreter_enabled():
        return None
    if symm_mem_errors(ep):
        return None
    return (
        f"moe.ep_transport = 'all_to_all': every EP group of {ep} ranks fits in this host, where "
        "moe.ep_transport = 'symm_mem' (--toml examples/ep_symm_mem.toml) moves the rows over NVLink "
        "with one kernel each way and trains faster (docs/routing_and_ep.md, GPU results)"
    )


def moe_configs(config, key: str) -> list[RoutedMoE.Config]:
    """Every ``RoutedMoE.Config`` of the model; ConfigError naming ``key`` when there is none."""
    moes = [moe for _, moe, _, _ in config.model_spec.model.traverse(RoutedMoE.Config)]
    if not moes:
        raise ConfigError(f"{key}: this flavor's model has no configurable MoE layers")
    return moes


def dispatcher_configs(config, key: str) -> list[RoutingDispatcher.Config]:
    dispatchers = [moe.routed_experts.token_dispatcher for moe in moe_configs(config, key)]
    if not all(isinstance(d, RoutingDispatcher.Config) for d in dispatchers):
        raise ConfigError(
            f"{key}: this flavor's token dispatcher ({type(dispatchers[0]).__qualname__}) has no such option"
        )
    return dispatchers


def routers(config, key: str) -> list:
    return [moe.router for moe in moe_configs(config, key)]


def _as_is(value):
    return value


def _zero_is_off(value):
    """The TOML spelling of off (0) as the config's (None)."""
    return None if value == 0 else value


def _option_key(name: str, annotation, help: str, owners, convert=_as_is) -> None:
    """Register ``moe.<name>``: sets ``<name>`` on every object ``owners(config, key)`` returns.

    ``convert`` only changes the TOML spelling of a value; its range is checked once, with every
    other option, by the owner config's ``validation_errors`` (``check_moe_config``).
    """
    key = f"moe.{name}"

    @register_short_key(key, annotation, help)
    def apply(config, value) -> None:
        value = convert(value)
        for owner in owners(config, key):
            setattr(owner, name, value)


_option_key("score_func", Literal["softmax", "sigmoid"], "router score function", routers)
_option_key("route_norm", bool, "renormalize the top-k scores to sum 1", routers)
_option_key("route_scale", float, "multiply the gating weights by this", routers)
_option_key("num_expert_groups", int, "group-limited routing: expert groups (0 = off)", routers, _zero_is_off)
_option_key(
    "num_limited_groups", int, "group-limited routing: groups each token may use (0 = off)", routers, _zero_is_off
)
_option_key(
    "capacity_factor",
    float,
    "per-expert token capacity as a multiple of the balanced load (0 = no limit)",
    routers,
    _zero_is_off,
)
_option_key("load_balance_coeff", float, "aux-loss-free expert bias update rate (0 = off)", moe_configs, _zero_is_off)
_option_key("aux_loss_coeff", float, "load-balancing loss weight (0 = off)", moe_configs)
_option_key("aux_loss_type", AuxLossType, "load-balancing loss variant: seq, batch or global", moe_configs)
_option_key("z_loss_coeff", float, "router z-loss weight (0 = off)", moe_configs)
_option_key(
    "permute_backend",
    PermuteBackend,
    "token permute/unpermute: auto (triton on CUDA), torch or triton",
    dispatcher_configs,
)
_option_key("align_size", int, "pad each expert's rows to a multiple of this (1 = off)", dispatcher_configs)
_option_key(
    "ep_transport",
    EPTransport,
    "how rows move between EP ranks: all_to_all (collectives) or symm_mem (one kernel each way)",
    dispatcher_configs,
)


@register_short_key("moe.top_k", int, "experts per token (router and dispatcher)")
def set_top_k(config, top_k: int) -> None:
    for moe in moe_configs(config, "moe.top_k"):
        moe.router.top_k = top_k
        moe.routed_experts.token_dispatcher.top_k = top_k


VALIDATED_CONFIGS = (
    RoutedMoE.Config,
    BalancedTopKRouter.Config,
    RoutingDispatcher.Config,
    BackendGroupedExperts.Config,
)
"""The experiment's configs with a ``validation_errors`` method: every option's own check lives there."""


def option_key(field: str) -> str:
    """How the start-up checks name an option of a MoE layer: its ``moe.*`` key and where its value came from."""
    return named(f"moe.{field}")


@register_config_check
def check_moe_config(config) -> None:
    """The options of every MoE layer, checked once on the final config, then what they need together:
    top_k shared by router and dispatcher, Triton or one host where chosen, EP degree vs experts,
    world and the other degrees, align_size vs the routed rows of a step. One ``ConfigError`` lists all.

    Registered before ``resolve_auto_backend``: a ``compute_backend`` still "auto" here is resolved
    there, so it is not an error yet.
    """
    if config.model_spec is None:
        return
    model = config.model_spec.model
    errors = [
        error
        for config_class in VALIDATED_CONFIGS
        for _, node, _, _ in model.traverse(config_class)
        if getattr(node, "compute_backend", None) != AUTO_BACKEND
        for error in node.validation_errors(option_key)
    ]
    moes = [moe for _, moe, _, _ in model.traverse(RoutedMoE.Config)]
    for moe in moes:
        router, dispatcher = moe.router, moe.routed_experts.token_dispatcher
        if isinstance(dispatcher, RoutingDispatcher.Config):
            reason = triton_available_reason()
            if dispatcher.permute_backend == "triton" and reason is not None:
                errors.append(f"moe.permute_backend = 'triton': {reason}")
            if dispatcher.ep_transport == "symm_mem":
                errors.extend(symm_mem_errors(config.parallelism.expert_parallel_degree))
        if router.top_k != dispatcher.top_k:
            errors.append(
                f"moe: router top_k ({router.top_k}) differs from the dispatcher's ({dispatcher.top_k}); set moe.top_k"
            )
    errors.extend(parallelism_errors(config, moes))
    errors.extend(align_size_errors(config))
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))


@register_config_check
def check_compute_backends_run_here(config) -> None:
    """Before training: every chosen backend can run on this machine (its spec says why not)."""
    if config.model_spec is None:
        return
    names = {
        experts.compute_backend for _, experts, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)
    }
    errors = []
    for name in sorted(names - {AUTO_BACKEND}):
        reason = get_backend(name).unavailable_reason()
        if reason is not None:
            errors.append(f"moe.compute_backend = {name!r}: {reason}")
    if errors:
        raise ConfigError("\n".join(errors))


@register_config_check
def resolve_auto_backend(config) -> None:
    """Before training: ``moe.compute_backend = "auto"`` becomes the fastest backend here."""
    if config.model_spec is None:
        return
    try:
        resolve_auto_compute_backend(config)
    except AutoBackendError as e:
        raise ConfigError(str(e)) from None


MAX_ALIGN_SIZE = 4096
"""Largest ``moe.align_size``: every expert's rows are padded to a multiple of it."""


def align_size_errors(config) -> list[str]:
    """``align_size`` at most MAX_ALIGN_SIZE and the routed rows of a step (its lower bound is the dispatcher's)."""
    routed_rows = config.training.local_batch_size * config.training.seq_len
    errors = []
    for dispatcher in routing_dispatchers(config):
        limit = min(MAX_ALIGN_SIZE, max(1, routed_rows * dispatcher.top_k))
        if dispatcher.align_size > limit:
            errors.append(
                f"{option_key('align_size')} = {dispatcher.align_size}: must be in [1, {limit}] (at most {MAX_ALIGN_SIZE} "
                f"and the routed rows per step, batch x seq_len x top_k = {routed_rows * dispatcher.top_k})"
            )
    return errors


def symm_mem_errors(expert_parallel_degree: int) -> list[str]:
    """Why ``moe.ep_transport = 'symm_mem'`` cannot run here (empty list: it can)."""
    if expert_parallel_degree <= 1:
        return []
    errors = []
    reason = triton_available_reason()
    if reason is not None:
        errors.append(f"moe.ep_transport = 'symm_mem': {reason}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", current_world_size()))
    if local_world < expert_parallel_degree:
        errors.append(
            f"moe.ep_transport = 'symm_mem' needs every rank of an EP group on one host, but "
            f"expert_parallel_degree ({expert_parallel_degree}) exceeds the processes per host "
            f"({local_world}); use moe.ep_transport = 'all_to_all' across hosts"
        )
    return errors


def parallelism_errors(config, moes: list[RoutedMoE.Config], world_size: int | None = None) -> list[str]:
    """Why this parallel layout cannot run the MoE layers (empty list: it can)."""
    p = config.parallelism
    world = current_world_size() if world_size is None else world_size
    ep, tp, cp, pp = (
        p.expert_parallel_degree,
        p.tensor_parallel_degree,
        p.context_parallel_degree,
        p.pipeline_parallel_degree,
    )
    dp_replicate, dp_shard = p.data_parallel_replicate_degree, p.data_parallel_shard_degree
    errors = []
    if min(ep, tp, cp, pp, dp_replicate) < 1 or (dp_shard < 1 and dp_shard != -1):
        return [
            f"parallelism: degrees must be >= 1 (data_parallel_shard_degree may be -1); got ep={ep}, tp={tp}, cp={cp}, pp={pp}, dp_replicate={dp_replicate}, dp_shard={dp_shard}"
        ]
    if dp_shard == -1 and world % (dp_replicate * cp * tp * pp):
        return [
            f"parallelism: world size {world} is not divisible by dp_replicate*cp*tp*pp = {dp_replicate * cp * tp * pp}"
        ]
    dp_shard = data_parallel_shard_degree(p, world)
    if dp_replicate * dp_shard * cp * tp * pp != world:
        errors.append(
            f"parallelism: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}) * tp({tp}) * pp({pp}) != world size {world}"
        )
    if ep > 1:
        if ep > world:
            errors.append(
                f"parallelism.expert_parallel_degree ({ep}) needs at least {ep} processes but this run has "
                f"{world}; launch one process per rank: {launch_command(ep)}"
            )
        elif world % ep:
            errors.append(f"parallelism.expert_parallel_degree ({ep}) does not divide the world size ({world})")
        elif (dp_shard * cp * tp) % ep:
            errors.append(
                f"parallelism.expert_parallel_degree ({ep}) must divide dp_shard*cp*tp = {dp_shard * cp * tp} "
                "(EP borrows ranks from data-shard, context and tensor parallelism)"
            )
        for num_experts in sorted({moe.num_experts for moe in moes}):
            if num_experts % ep:
                errors.append(
                    f"parallelism.expert_parallel_degree ({ep}) does not divide the number of experts ({num_experts})"
                )
    if tp > 1 and any(moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0 for moe in moes):
        errors.append("moe.aux_loss_coeff / moe.z_loss_coeff are not supported with tensor parallelism (tp > 1)")
    return errors
