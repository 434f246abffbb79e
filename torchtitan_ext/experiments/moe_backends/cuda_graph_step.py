"""Whether a training step of the MoE layers can be captured and replayed as a CUDA graph, what
``moe.ep_receive_rows = "auto"`` becomes, and where a run on one GPU turns the flavor's CUDA graphs on.

A captured step replays kernels only, so nothing may be read on the host (``cuda_graph_blockers``):
not the expert counts of ``for_loop`` / ``batched_mm_padded``, not ``torch._grouped_mm``'s offsets
outside bf16 on Hopper / Blackwell (the FP8 weight gradients' and the emulated FP8 GEMMs' included), not
the EP dispatch's received row count (``ep_receive_rows = "exact"``). ``auto_receive_rows`` picks static
rows where CUDA graphs are on, and turns the flavor's CUDA graphs on where a compiled step over
``symm_mem`` was measured faster with them: with experts that apply the router scores
(``experts_apply_scores``), so that no expert output is kept for the static rows, which hold every row
a rank can receive.
"""

from dataclasses import dataclass

import torch

from .dispatcher import EPReceiveRows, RoutingDispatcher, chosen_ep_transport, row_scores_unsupported_reason
from .ep_symm_mem import static_receive_rows
from .experts import BackendGroupedExperts, experts_row_weighting_error, host_sync_backends
from .fp8_experts import FP8_PRECISIONS
from .grouped_matmul import reads_offsets_on_host
from .layer import routing_dispatchers
from .moe import RoutedMoE


def _compiles_model(config) -> bool:
    """Whether torchtitan compiles the model's blocks (``compile.enable`` with the ``model`` component; the
    start-up line's ``run_training.compiles_model``, which this layer may not import)."""
    return config.compile.enable and "model" in config.compile.components


def experts_graph_blockers(config) -> list[str]:
    """Why the experts of this config cannot be replayed as a CUDA graph (empty: they can)."""
    experts = [e for _, e, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)]
    reasons = []
    syncing = sorted({e.compute_backend for e in experts} & host_sync_backends())
    if syncing:
        reasons.append(
            f"compute_backend {', '.join(syncing)} reads expert counts on the host (use grouped_mm or triton)"
        )
    dtype = getattr(torch, config.training.mixed_precision_param)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    grouped_mm_users = sorted(
        {"compute_backend grouped_mm" for e in experts if e.compute_backend == "grouped_mm"}
        | {"FP8 weight gradients" for e in experts if e.expert_precision in FP8_PRECISIONS}
    )
    if grouped_mm_users and reads_offsets_on_host(dtype, capability):
        device = f" on compute capability {capability[0]}.{capability[1]}" if capability else ""
        reasons.append(
            f"{' and '.join(grouped_mm_users)} in {config.training.mixed_precision_param}{device}: "
            "torch._grouped_mm reads its group offsets on the host (it has one grouped kernel only for bfloat16 "
            "on compute capability 9.x or 10.x: set training.mixed_precision_param = 'bfloat16' there, or use "
            "triton in native precision)"
        )
    if any(e.expert_precision == "fp8_rowwise_emulated" for e in experts):
        reasons.append(
            "expert_precision fp8_rowwise_emulated computes its GEMMs with torch._grouped_mm in float32, which "
            "reads its group offsets on the host (use fp8_rowwise)"
        )
    return reasons


def cuda_graph_blockers(config) -> list[str]:
    """Why a CUDA-graph capture of this config's training step would not replay correctly (empty: it would)."""
    reasons = experts_graph_blockers(config)
    if config.parallelism.expert_parallel_degree > 1 and not all(d.host_sync_free for d in routing_dispatchers(config)):
        reasons.append("the EP dispatch reads its row counts on the host (set moe.ep_receive_rows = 'static')")
    return reasons


STATIC_ROWS_AUTO_UP_TO = 4
"""The most received rows, as a multiple of a balanced step's, for which ``ep_receive_rows = "auto"`` turns
on static rows and CUDA graphs, as far as they were measured against stock compiled and exact rows (all
on H200s, docs/results/gpu_training.md): 2 (olmoe-1b-7b at FSDP 2 x EP 2, batch 4 x 2048: 1.29-1.34x
stock compiled, where exact rows gave 1.00-1.25x) and 4 (FSDP 4 x EP 4, batch 1 x 2048: deepseek-v3-16b
1.64x, where exact rows gave 0.59-0.62x; qwen3-30b-a3b 1.46x)."""


@dataclass(frozen=True)
class ReceiveRowsChoice:
    """What ``ep_receive_rows = "auto"`` becomes (``rows``), why, and whether the choice turns on the
    CUDA graphs the flavor left off (``turns_on_cuda_graphs``)."""

    rows: EPReceiveRows
    why: str
    turns_on_cuda_graphs: bool = False


@dataclass(frozen=True)
class SetBy:
    """Where a TOML file or the command line set the options ``auto_receive_rows`` weighs ("file:line",
    "command line"; None: the flavor's default)."""

    disable_cuda_graphs: str | None = None
    experts_apply_scores: str | None = None


def auto_receive_rows(config, on_nvidia_gpu: bool, set_by: SetBy) -> ReceiveRowsChoice:
    """The choice for a config under expert parallelism whose transports are resolved: ``"static"``
    where CUDA graphs are on (a captured EP step needs it; without a CUDA device, where they are asked
    for, the rows a GPU run would capture); ``"exact"`` where a TOML file or the command
    line turned them off; else, CUDA graphs being only the flavor's default off, ``"static"`` with CUDA
    graphs turned on where a compiled step over ``symm_mem`` on NVIDIA GPUs replays as a CUDA graph, with
    experts that can apply the router scores (and are not told not to), and
    static receive buffers at most ``STATIC_ROWS_AUTO_UP_TO`` times a balanced step's rows; ``"exact"``
    with the first reason against it otherwise."""
    if not config.training.disable_cuda_graphs:
        if not torch.cuda.is_available():
            return ReceiveRowsChoice(
                "static",
                "CUDA graphs are asked for, and a captured EP step reads nothing on the host; without a CUDA "
                "device no graph is captured, and these are the rows a GPU run would capture",
            )
        return ReceiveRowsChoice("static", "CUDA graphs are on, and a captured EP step reads nothing on the host")
    if set_by.disable_cuda_graphs:
        return ReceiveRowsChoice("exact", f"CUDA graphs are off ({set_by.disable_cuda_graphs})")
    factor = static_rows_factor(config)
    reason = graphs_left_off_reason(config, on_nvidia_gpu, factor, set_by.experts_apply_scores)
    if reason is not None:
        return ReceiveRowsChoice("exact", f"CUDA graphs stay off: {reason}")
    return ReceiveRowsChoice(
        "static",
        f"a compiled step over symm_mem replays as a CUDA graph with static receive buffers {factor:g}x a "
        "balanced step's rows: the fastest EP step measured on one host",
        turns_on_cuda_graphs=True,
    )


def one_gpu_graphs_left_off_reason(config, on_nvidia_gpu: bool, world_size: int) -> str | None:
    """The first reason a run without expert parallelism keeps the flavor's CUDA graphs off (None:
    ``startup_checks.turn_on_one_gpu_cuda_graphs`` turns them on): one NVIDIA GPU, the model compiled, no
    pipeline parallelism and a step a CUDA graph replays (``cuda_graph_blockers``). Measured on one H200
    (docs/results/fp8_experts.md): the whole compiled ``olmoe-1b-7b`` with FP8 ``triton`` experts trained
    5-19% faster with graphs on three loans and bf16 ``triton`` 2% faster, with the same losses; several
    ranks without EP were not measured."""
    if not on_nvidia_gpu:
        return "no NVIDIA CUDA GPU"
    if world_size > 1:
        return f"{world_size} ranks without expert parallelism: measured on one GPU only"
    if not _compiles_model(config):
        return "the model runs eager"
    if config.parallelism.pipeline_parallel_degree > 1:
        return "pipeline parallelism"
    if blockers := cuda_graph_blockers(config):
        return blockers[0]
    return None


def static_rows_factor(config) -> float:
    """The rows a static receive buffer holds at the config's EP degree, as a multiple of the rows a
    balanced step receives (the largest over its MoE layers): EP x min(top_k, local experts) / top_k."""
    ep = config.parallelism.expert_parallel_degree
    return max(static_receive_rows(1, ep, d.top_k, d.num_experts) / d.top_k for d in routing_dispatchers(config))


def graphs_left_off_reason(
    config, on_nvidia_gpu: bool, static_rows_factor: float, apply_scores_set_by: str | None
) -> str | None:
    """The first reason ``auto_receive_rows`` leaves the flavor's CUDA graphs off (None: it turns them
    on); ``static_rows_factor``: the static receive buffers as a multiple of a balanced step's rows;
    ``apply_scores_set_by``: where ``experts_apply_scores`` was set (None: the flavor's default)."""
    ep = config.parallelism.expert_parallel_degree
    if not on_nvidia_gpu:
        return "no NVIDIA CUDA GPU"
    if not _compiles_model(config):
        return "the model runs eager"
    if any(chosen_ep_transport(d.ep_transport, ep) != "symm_mem" for d in routing_dispatchers(config)):
        return "rows move over all_to_all"
    if static_rows_factor > STATIC_ROWS_AUTO_UP_TO:
        return (
            f"static receive buffers would hold {static_rows_factor:g}x a balanced step's rows "
            f"(measured up to {STATIC_ROWS_AUTO_UP_TO}x)"
        )
    if config.parallelism.pipeline_parallel_degree > 1:
        return "pipeline parallelism"
    if blockers := experts_graph_blockers(config):
        return blockers[0]
    layers = [
        moe
        for _, moe, _, _ in config.model_spec.model.traverse(RoutedMoE.Config)
        if isinstance(moe.routed_experts.token_dispatcher, RoutingDispatcher.Config)
    ]
    if scores_errors := [error for moe in layers for error in experts_apply_scores_errors(moe, ep)]:
        return (
            f"the experts cannot apply the router scores ({scores_errors[0]}), so static rows would keep "
            "their outputs for every row a rank can receive"
        )
    if apply_scores_set_by and not all(moe.routed_experts.token_dispatcher.experts_apply_scores for moe in layers):
        return (
            f"experts_apply_scores = false ({apply_scores_set_by}): static rows would keep the experts' "
            "outputs for every row a rank can receive"
        )
    return None


def experts_apply_scores_errors(moe, expert_parallel_degree: int) -> list[str]:
    """Why the MoE layer ``moe`` (with the project's dispatcher) cannot have its experts apply the router
    scores under expert parallelism (empty: it can): its experts (the resolved backend, in its precision)
    must weight their rows and its resolved transport give each row its score."""
    dispatcher, experts = moe.routed_experts.token_dispatcher, moe.routed_experts.inner_experts
    transport = chosen_ep_transport(dispatcher.ep_transport, expert_parallel_degree)
    reasons = (experts_row_weighting_error(experts), row_scores_unsupported_reason(transport, dispatcher.align_size))
    return [reason for reason in reasons if reason is not None]
