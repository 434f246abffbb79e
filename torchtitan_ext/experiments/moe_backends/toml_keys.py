"""Short TOML keys of the MoE backends experiment: the ``[moe]`` table.

Every ``moe.*`` key sets one option on every MoE layer of the flavor's model (but
``moe.recompute_preactivations_layers``: on the first N, its range the model's MoE layer count, checked
where it is set); see docs/routing_and_ep.md. A key only converts the TOML spelling (0 = off becomes
None); each option is checked once, by its config's ``validation_errors``, in the start-up checks
(``startup_checks``).
"""

from typing import Literal

from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing, FullAC, SelectiveAC

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import register_linked_fields
from torchtitan_ext.config.short_keys import register_short_key
from torchtitan_ext.validation import named

from .activation_checkpoint import MoESelectiveAC
from .dispatcher import EPReceiveRows, EPTransportChoice, PermuteBackend, RoutingDispatcher
from .experts import BackendGroupedExperts, ComputeBackendChoice, ExpertsFSDP, fp8_backends
from .fp8_experts import ExpertPrecision
from .model_shapes import ScoreFunc
from .moe import AuxLossType, RoutedMoE


@register_short_key(
    "moe.compute_backend",
    ComputeBackendChoice,
    "expert compute backend of every MoE layer (auto: fastest here, chosen at start-up)",
)
def set_compute_backend(config, backend: str) -> None:
    for experts in experts_configs(config, "moe.compute_backend"):
        experts.compute_backend = backend


@register_short_key(
    "moe.expert_precision",
    ExpertPrecision,
    "expert GEMMs: native (the activations' dtype), fp8_rowwise (e4m3, rowwise scales; CUDA 9.0+; "
    f"{' or '.join(fp8_backends())}) or fp8_rowwise_emulated (the same numerics in fp32, any device)",
)
def set_expert_precision(config, precision: ExpertPrecision) -> None:
    for experts in experts_configs(config, "moe.expert_precision"):
        experts.expert_precision = precision


def experts_configs(config, key: str) -> list[BackendGroupedExperts.Config]:
    """Every ``BackendGroupedExperts.Config`` of the model; ConfigError naming ``key`` when there is none."""
    experts = [experts for _, experts, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)]
    if not experts:
        raise ConfigError(f"{key}: this flavor's model has no backend-switchable experts")
    return experts


def moe_configs(config, key: str) -> list[RoutedMoE.Config]:
    """Every ``RoutedMoE.Config`` of the model; ConfigError naming ``key`` when there is none."""
    moes = [moe for _, moe, _, _ in config.model_spec.model.traverse(RoutedMoE.Config)]
    if not moes:
        raise ConfigError(f"{key}: this flavor's model has no configurable MoE layers")
    return moes


def dispatcher_configs(config, key: str) -> list[RoutingDispatcher.Config]:
    dispatchers = [moe.routed_experts.token_dispatcher for moe in moe_configs(config, key)]
    ours = [d for d in dispatchers if isinstance(d, RoutingDispatcher.Config)]
    if len(ours) < len(dispatchers):
        raise ConfigError(
            f"{key}: this flavor's token dispatcher ({type(dispatchers[0]).__qualname__}) has no such option"
        )
    return ours


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


_option_key("score_func", ScoreFunc, "router score function", routers)
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
    EPTransportChoice,
    "how rows move between EP ranks: auto (symm_mem where every EP group is on one host of CUDA GPUs, "
    "else all_to_all), all_to_all (collectives) or symm_mem (one kernel each way)",
    dispatcher_configs,
)
_option_key(
    "experts_apply_scores",
    bool,
    "under expert parallelism the experts weight their rows by the router scores and combine sums them "
    "unweighted: no expert output kept for the scores' gradient (less memory; triton and grouped_mm)",
    dispatcher_configs,
)
_option_key(
    "recompute_preactivations",
    bool,
    "the experts keep no gate/up pre-activations (R x 2F) for backward and compute them again there "
    "(one more gate/up GEMM): less memory, more compute (triton, native precision)",
    experts_configs,
)


@register_short_key(
    "moe.experts_fsdp",
    ExpertsFSDP,
    "whether FSDP wraps the routed experts: auto (not where each expert lives on one rank, e.g. FSDP 2 x EP 2, "
    "where FSDP would only copy and cast their weights and gradients every step) or always (torchtitan's way)",
)
def set_experts_fsdp(config, choice: ExpertsFSDP) -> None:
    for experts in experts_configs(config, "moe.experts_fsdp"):
        experts.fsdp = choice


@register_short_key(
    "moe.recompute_preactivations_layers",
    int,
    "moe.recompute_preactivations in the first N MoE layers only (their activations are kept longest, "
    "through the whole backward), off in the rest: part of the memory for part of the compute",
    sets=("moe.recompute_preactivations",),
)
def set_recompute_preactivations_layers(config, layers: int) -> None:
    experts = experts_configs(config, "moe.recompute_preactivations_layers")
    if not 0 <= layers <= len(experts):
        raise ConfigError(
            f"moe.recompute_preactivations_layers = {layers}: this flavor has {len(experts)} MoE layers "
            f"(0 to {len(experts)}; moe.recompute_preactivations = true recomputes in all)"
        )
    for index, layer_experts in enumerate(experts):
        layer_experts.recompute_preactivations = index < layers


_option_key(
    "ep_receive_rows",
    EPReceiveRows,
    "rows an EP rank receives: exact (counted on the host), static (the most possible, no host sync, "
    "CUDA graphs can capture the step; all_to_all then sends every rank T rows) or auto (static, with CUDA "
    "graphs turned on, where a compiled step over symm_mem replays as one; else exact)",
    dispatcher_configs,
)


register_linked_fields("moe.router.top_k", "moe.routed_experts.token_dispatcher.top_k")


@register_short_key("moe.top_k", int, "experts per token (router and dispatcher)")
def set_top_k(config, top_k: int) -> None:
    for moe in moe_configs(config, "moe.top_k"):
        moe.router.top_k = top_k
        moe.routed_experts.token_dispatcher.top_k = top_k


ActivationCheckpointMode = Literal["selective", "full", "none"]


@register_short_key(
    "activation_checkpoint.mode",
    ActivationCheckpointMode,
    "activation checkpointing of every block: selective (keeps the matmuls' and MoE ops' outputs; the "
    "flavors' default), full (recomputes the whole block) or none (= torchtitan's activation-checkpoint:MODE)",
)
def set_activation_checkpoint_mode(config, mode: ActivationCheckpointMode) -> None:
    """Selective is the flavor's selective config if it has one, else ``MoESelectiveAC``'s; the options
    every mode shares (``preserve_rng_state``, ``determinism_check``, ``debug``) carry over."""
    current = config.activation_checkpoint
    shared = {}
    if isinstance(current, ActivationCheckpointing.Config):
        shared = {name: getattr(current, name) for name in ("preserve_rng_state", "determinism_check", "debug")}
    if mode != "selective" and isinstance(current, SelectiveAC.Config):
        option = "force_recompute_mm_shapes_by_fqns"
        value, default = getattr(current, option), getattr(type(current)(), option)
        if value != default:
            raise ConfigError(
                f"activation_checkpoint.mode = {mode!r} would drop {named(f'activation_checkpoint.{option}')} = "
                f"{value!r}, an option of selective checkpointing only: remove it, or keep mode 'selective'"
            )
    if mode == "none":
        config.activation_checkpoint = None
    elif mode == "full" and type(current) is not FullAC.Config:
        config.activation_checkpoint = FullAC.Config(**shared)
    elif mode == "selective" and not isinstance(current, SelectiveAC.Config):
        config.activation_checkpoint = MoESelectiveAC.Config(**shared)
