"""Start-up checks of the MoE backends experiment, on the final config before any process group.

``check_moe_config`` checks every option of every MoE layer once (its config's
``validation_errors``), then what the options need together: top_k shared by router and
dispatcher, Triton or one host where chosen, the parallel layout against the experts, align_size
against the routed rows of a step. ``check_compute_backends_run_here`` refuses a backend this
machine cannot run; ``resolve_auto_backend`` then replaces "auto" by the fastest backend here,
and ``resolve_auto_ep_transport`` an "auto" EP transport by the one that runs fastest here,
``resolve_auto_ep_receive_rows`` an "auto" ``ep_receive_rows`` by static rows under CUDA graphs where
they replay the step, else exact rows.
``warn_of_ep_options_without_ep`` warns of EP options set for a run without expert parallelism;
``check_experts_apply_scores`` refuses ``experts_apply_scores`` where the backend or the transport
(both resolved by then) cannot apply it.
"""

import shlex

import torch
from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.checks import register_config_check, register_value_check
from torchtitan_ext.config.short_keys import keys_setting
from torchtitan_ext.config.value_sources import resolved_from, value_source
from torchtitan_ext.kernels.availability import triton_available_reason
from torchtitan_ext.parallel_layout import degree_errors, expert_share_errors, layout_errors
from torchtitan_ext.place_in_launch import is_rank_zero
from torchtitan_ext.place_in_launch import world_size as launch_world_size
from torchtitan_ext.validation import named

from .auto_backend import (
    AUTO_COMMAND_OUTLINE,
    AutoBackendError,
    UncachedAutoChoice,
    resolve_auto_compute_backend,
)
from .cuda_graph_step import SetBy, auto_receive_rows, experts_apply_scores_errors, one_gpu_graphs_left_off_reason
from .dispatcher import (
    RoutingDispatcher,
    chosen_ep_transport,
    symm_mem_errors,
    symm_mem_unfit_reason,
)
from .experts import (
    BackendGroupedExperts,
    backend_unavailable_reason,
    resolved_at_startup,
    runnable_backends,
)
from .fp8_experts import fp8_unavailable_reason
from .hf.attention import ProjectionQKNormAttention
from .layer import routing_dispatchers
from .moe import RoutedMoE
from .router import BalancedTopKRouter

VALIDATED_CONFIGS = (
    RoutedMoE.Config,
    BalancedTopKRouter.Config,
    RoutingDispatcher.Config,
    BackendGroupedExperts.Config,
)
"""The experiment's configs with a ``validation_errors`` method (``ValidatedConfig``), in the order
their problems are listed."""


def nvidia_gpu_here() -> bool:
    """Whether this process runs on an NVIDIA CUDA GPU (CUDA available and not a ROCm build)."""
    return torch.cuda.is_available() and torch.version.hip is None


def option_key(field: str) -> str:
    """How the start-up checks name an option of a MoE layer: its ``moe.*`` key and where its value came
    from, or another short key that set it (``keys_setting``: ``moe.recompute_preactivations_layers``
    sets ``moe.recompute_preactivations`` in the first N layers) and where that came from."""
    key = f"moe.{field}"
    if value_source(key) is None:
        for other in keys_setting(key):
            if (source := value_source(other)) is not None:
                return f"{source}: {other} sets {key}"
    return named(key)


def validated_nodes(model_config):
    """Every node of ``VALIDATED_CONFIGS`` in the model config, but experts whose backend is still
    resolved at start-up ("auto": ``resolve_auto_backend`` runs after this check)."""
    for config_class in VALIDATED_CONFIGS:
        for _, node, _, _ in model_config.traverse(config_class):
            if not (isinstance(node, BackendGroupedExperts.Config) and resolved_at_startup(node.compute_backend)):
                yield node


@register_value_check
def check_moe_config(config) -> None:
    """The options of every MoE layer, checked once on the final config, then what they need together:
    top_k shared by router and dispatcher, Triton or one host where chosen, EP degree vs experts,
    world and the other degrees, align_size vs the routed rows of a step. One ``ConfigError`` lists all.
    """
    if config.model_spec is None:
        return
    model = config.model_spec.model
    errors = [error for node in validated_nodes(model) for error in node.validation_errors(option_key)]
    located = [(fqn, moe) for fqn, moe, _, _ in model.traverse(RoutedMoE.Config)]
    moes = [moe for _, moe in located]
    for fqn, moe in located:
        router, dispatcher = moe.router, moe.routed_experts.token_dispatcher
        if isinstance(dispatcher, RoutingDispatcher.Config):
            reason = triton_available_reason()
            if dispatcher.permute_backend == "triton" and reason is not None:
                errors.append(f"{option_key('permute_backend')} = 'triton': {reason}")
            if dispatcher.ep_transport == "symm_mem":
                errors.extend(symm_mem_errors(config.parallelism.expert_parallel_degree, option_key("ep_transport")))
        if router.top_k != dispatcher.top_k:
            layer = f"model.{fqn}" if fqn else "model"
            errors.append(
                f"{layer}: router top_k ({router.top_k}) differs from the dispatcher's ({dispatcher.top_k}); set "
                f"{layer}.router.top_k (which sets both) or moe.top_k (every layer)"
            )
    errors.extend(parallelism_errors(config, moes))
    errors.extend(align_size_errors(config))
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))


@register_config_check
def check_compute_backends_run_here(config) -> None:
    """Before training: every chosen backend can run on this machine (its spec says why not); a
    backend the flavor chose is named as its default, with one that runs here."""
    if config.model_spec is None:
        return
    experts = [experts for _, experts, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)]
    chosen_by = "" if value_source("moe.compute_backend") else " (the flavor's default)"
    errors = [
        f"{option_key('compute_backend')} = {name!r}{chosen_by}: {reason}; "
        f"--moe.compute_backend {runnable_backends()[0]} runs here"
        for name in sorted({e.compute_backend for e in experts})
        if (reason := backend_unavailable_reason(name)) is not None
    ]
    errors += [
        f"{option_key('expert_precision')} = {precision!r}: {reason}"
        for precision in sorted({e.expert_precision for e in experts})
        if (reason := fp8_unavailable_reason(precision)) is not None
    ]
    if errors:
        raise ConfigError("\n".join(errors))


@register_config_check
def resolve_auto_backend(config) -> None:
    """Before training: ``moe.compute_backend = "auto"`` becomes the fastest backend here."""
    if config.model_spec is None:
        return
    try:
        resolve_auto_compute_backend(config, key=named)
    except UncachedAutoChoice as e:
        raise ConfigError(e.message(auto_choice_command(config))) from None
    except AutoBackendError as e:
        raise ConfigError(str(e)) from None


@register_config_check
def resolve_auto_ep_transport(config) -> None:
    """Before training, under expert parallelism: ``moe.ep_transport = "auto"`` becomes the transport
    ``chosen_ep_transport`` picks here; rank 0 logs the choice and why."""
    ep = config.parallelism.expert_parallel_degree
    dispatchers = [dispatcher for dispatcher in routing_dispatchers(config) if dispatcher.ep_transport == "auto"]
    if ep <= 1 or not dispatchers:
        return
    choice = chosen_ep_transport("auto", ep)
    for dispatcher in dispatchers:
        dispatcher.ep_transport = choice
    if is_rank_zero():
        if choice == "symm_mem":
            why = f"every EP group of {ep} ranks is on one host of CUDA GPUs; --moe.ep_transport all_to_all uses NCCL"
        else:
            why = symm_mem_unfit_reason(ep)
        logger.info(f"moe.ep_transport = 'auto' -> {choice!r} ({why})")


@register_config_check
def resolve_auto_ep_receive_rows(config) -> None:
    """Before training: ``moe.ep_receive_rows = "auto"`` becomes ``"exact"`` without expert parallelism,
    else the choice of ``auto_receive_rows``. Where that choice turns CUDA graphs on, the experts also
    apply the router scores (``experts_apply_scores``, which the choice needs); rank 0 logs the choice
    and why (on NVIDIA GPUs, or where it is static)."""
    dispatchers = [dispatcher for dispatcher in routing_dispatchers(config) if dispatcher.ep_receive_rows == "auto"]
    if not dispatchers:
        return
    ep = config.parallelism.expert_parallel_degree
    if ep <= 1:
        for dispatcher in dispatchers:
            dispatcher.ep_receive_rows = "exact"
        return
    on_nvidia_gpu = nvidia_gpu_here()
    set_by = SetBy(value_source("training.disable_cuda_graphs"), value_source("moe.experts_apply_scores"))
    choice = auto_receive_rows(config, on_nvidia_gpu, set_by)
    for dispatcher in dispatchers:
        dispatcher.ep_receive_rows = choice.rows
    turned_on = []
    if choice.turns_on_cuda_graphs:
        config.training.disable_cuda_graphs = False
        turned_on.append("training.disable_cuda_graphs -> false")
        if not set_by.experts_apply_scores:
            for dispatcher in routing_dispatchers(config):
                dispatcher.experts_apply_scores = True
            turned_on.append("moe.experts_apply_scores -> true")
    if is_rank_zero() and (on_nvidia_gpu or choice.rows == "static"):
        opt_out = "; --moe.ep_receive_rows exact keeps them off" if choice.turns_on_cuda_graphs else ""
        logger.info(
            f"moe.ep_receive_rows = 'auto' -> {choice.rows!r}{''.join(', ' + t for t in turned_on)} "
            f"({choice.why}{opt_out})"
        )


@register_config_check
def turn_on_one_gpu_cuda_graphs(config) -> None:
    """Before training, without expert parallelism: where the flavor leaves CUDA graphs off (no TOML file
    or command line set ``training.disable_cuda_graphs``) and the model has this experiment's MoE layers,
    turn them on where ``one_gpu_graphs_left_off_reason`` finds no reason against; rank 0 logs the
    choice or the reason (on NVIDIA GPUs)."""
    if config.parallelism.expert_parallel_degree > 1 or not config.training.disable_cuda_graphs:
        return
    if value_source("training.disable_cuda_graphs") or not routing_dispatchers(config):
        return
    on_nvidia_gpu = nvidia_gpu_here()
    reason = one_gpu_graphs_left_off_reason(config, on_nvidia_gpu, launch_world_size())
    if reason is None:
        config.training.disable_cuda_graphs = False
    if is_rank_zero() and on_nvidia_gpu:
        choice = (
            "-> false (one GPU: the compiled step replays as a CUDA graph, measured faster; "
            "--training.disable_cuda_graphs true keeps them off)"
            if reason is None
            else f"stays true ({reason})"
        )
        logger.info(f"training.disable_cuda_graphs {choice}")


EP_ONLY_OPTIONS = ("ep_transport", "ep_receive_rows", "experts_apply_scores")
"""The dispatcher options that take effect only under expert parallelism."""


@register_config_check
def warn_of_ep_options_without_ep(config) -> None:
    """Rank 0 warns of each ``EP_ONLY_OPTIONS`` key a TOML file or the command line set for a run
    without expert parallelism, where it has no effect (not an error: one TOML file may serve runs
    of several EP degrees). The flavors' defaults are not warned of."""
    ep = config.parallelism.expert_parallel_degree
    if ep > 1 or not is_rank_zero():
        return
    for field in EP_ONLY_OPTIONS:
        if value_source(f"moe.{field}"):
            logger.warning(
                f"{option_key(field)} has no effect: it applies only with "
                f"parallelism.expert_parallel_degree > 1, and this run has {ep}"
            )


@register_config_check
def check_experts_apply_scores(config) -> None:
    """Under expert parallelism, ``experts_apply_scores`` needs a backend that weights its rows (the
    resolved one, in its precision) and a transport that gives each row its score: one
    ``ConfigError`` lists every layer setting it where either cannot."""
    ep = config.parallelism.expert_parallel_degree
    if config.model_spec is None or ep <= 1:
        return
    errors = [
        f"{option_key('experts_apply_scores')} = true: {reason}"
        for _, moe, _, _ in config.model_spec.model.traverse(RoutedMoE.Config)
        if isinstance(moe.routed_experts.token_dispatcher, RoutingDispatcher.Config)
        and moe.routed_experts.token_dispatcher.experts_apply_scores
        for reason in experts_apply_scores_errors(moe, ep)
    ]
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))


def auto_choice_command(config) -> str:
    """The single-process command that measures and caches the "auto" choice of a run of ``config``
    (its flavor, TOML files, batch, sequence length and expert parallel degree)."""
    flavor, toml_files = resolved_from()
    if flavor is None:
        return AUTO_COMMAND_OUTLINE
    arguments = [
        *("--flavor", flavor),
        *(argument for path in toml_files for argument in ("--toml", path)),
        *("--batch-size", str(config.training.local_batch_size), "--seq-len", str(config.training.seq_len)),
        *("--expert-parallel-degree", str(config.parallelism.expert_parallel_degree)),
    ]
    return f"python -m torchtitan_ext.bench auto {shlex.join(arguments)}"


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
                f"{option_key('align_size')} = {dispatcher.align_size}: must be in [1, {limit}] "
                f"(at most {MAX_ALIGN_SIZE} and the routed rows per step, "
                f"batch x seq_len x top_k = {routed_rows * dispatcher.top_k})"
            )
    return errors


def parallelism_errors(config, moes: list[RoutedMoE.Config], world_size: int | None = None) -> list[str]:
    """Why this parallel layout cannot run the model's MoE layers (empty list: it can): the layout of the
    ranks (``parallel_layout``), then the experts each EP rank holds, the router losses and OLMoE's
    whole-projection QK-norm under TP."""
    p = config.parallelism
    world = launch_world_size() if world_size is None else world_size
    if errors := degree_errors(p, world, named):
        return errors
    share_errors = expert_share_errors(p.expert_parallel_degree, (moe.num_experts for moe in moes), named)
    errors = layout_errors(p, world, named, suggest_launch=not share_errors) + share_errors
    if p.tensor_parallel_degree > 1 and any(moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0 for moe in moes):
        errors.append("moe.aux_loss_coeff / moe.z_loss_coeff are not supported with tensor parallelism (tp > 1)")
    if p.tensor_parallel_degree > 1 and any(config.model_spec.model.traverse(ProjectionQKNormAttention.Config)):
        errors.append(
            f"{named('parallelism.tensor_parallel_degree')} = {p.tensor_parallel_degree}: this model normalises "
            "the whole query/key projection (OLMoE), which a rank holding some of the heads cannot; "
            "use data or expert parallelism"
        )
    return errors
