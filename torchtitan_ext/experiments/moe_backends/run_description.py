"""What the MoE backends experiment says about a run: its run metadata and its start-up note.

``compute_backend``, ``expert_precision``, ``ep_transport``, static ``ep_receive_rows``,
``experts_apply_scores`` and ``recompute_preactivations`` identify a run in the metrics' run metadata
(``registry.register_run_description``); notes before training (``registry.register_startup_note``)
suggest ``symm_mem`` where every EP group fits in this host, and ``examples/cuda_graphs.toml`` where
a compiled exact-rows step over ``symm_mem`` could replay as a CUDA graph at no more than twice a
balanced step's received rows.
"""

import torch
from torchtitan.models.common.moe import GroupedExperts

from torchtitan_ext.registry import register_run_description, register_startup_note

from .dispatcher import symm_mem_unfit_reason
from .ep_symm_mem import static_receive_rows
from .experts import DEFAULT_BACKEND, BackendGroupedExperts, experts_row_weighting_error
from .layer import routing_dispatchers


def experts_setting(config, field: str, torchtitan_value: str | bool) -> str | bool | list:
    """``field`` of every experts module of the model (``torchtitan_value`` for torchtitan's own), one
    value when they agree, else the sorted values."""
    values = []
    if config.model_spec is not None:
        values = sorted(
            {
                getattr(experts, field) if isinstance(experts, BackendGroupedExperts.Config) else torchtitan_value
                for _, experts, _, _ in config.model_spec.model.traverse(GroupedExperts.Config)
            }
        )
    return values[0] if len(values) == 1 else values


@register_run_description
def compute_backend_of_run(config) -> dict:
    """``compute_backend`` of the run metadata (torchtitan's own experts compute as the default backend)."""
    return {"compute_backend": experts_setting(config, "compute_backend", DEFAULT_BACKEND)}


@register_run_description
def expert_precision_of_run(config) -> dict:
    """``expert_precision`` of the run metadata (torchtitan's own experts compute in "native" precision)."""
    return {"expert_precision": experts_setting(config, "expert_precision", "native")}


def dispatchers_setting(config, field: str) -> str | list[str] | None:
    """``field`` of every MoE layer's dispatcher under expert parallelism, one value when they agree,
    else the sorted values; None without EP or without the project's dispatcher."""
    values = sorted({getattr(dispatcher, field) for dispatcher in routing_dispatchers(config)})
    if config.parallelism.expert_parallel_degree <= 1 or not values:
        return None
    return values[0] if len(values) == 1 else values


@register_run_description
def ep_transport_of_run(config) -> dict:
    """``ep_transport`` of the run metadata under expert parallelism: how EP rows move."""
    transport = dispatchers_setting(config, "ep_transport")
    return {} if transport is None else {"ep_transport": transport}


@register_run_description
def ep_receive_rows_of_run(config) -> dict:
    """``ep_receive_rows`` of the run metadata where EP dispatches read nothing on the host (static
    received rows); nothing for the default, exact rows."""
    receive_rows = dispatchers_setting(config, "ep_receive_rows")
    return {} if receive_rows in (None, "exact") else {"ep_receive_rows": receive_rows}


@register_run_description
def experts_apply_scores_of_run(config) -> dict:
    """``experts_apply_scores`` of the run metadata where the experts weight their rows under expert
    parallelism; nothing for the default (combine weights them)."""
    apply_scores = dispatchers_setting(config, "experts_apply_scores")
    return {"experts_apply_scores": apply_scores} if apply_scores else {}


@register_run_description
def recompute_preactivations_of_run(config) -> dict:
    """``recompute_preactivations`` of the run metadata where the experts recompute their gate/up
    pre-activations in backward; nothing for the default (they keep them)."""
    recompute = experts_setting(config, "recompute_preactivations", False)
    return {"recompute_preactivations": recompute} if recompute else {}


@register_startup_note
def symm_mem_within_a_host(config) -> str | None:
    """A note when EP rows go through all-to-alls on CUDA GPUs although every EP group fits in this
    host, where ``symm_mem`` moves them with one kernel each way."""
    ep = config.parallelism.expert_parallel_degree
    if ep_transport_of_run(config).get("ep_transport") != "all_to_all":
        return None
    if symm_mem_unfit_reason(ep) is not None:
        return None
    return (
        f"moe.ep_transport = 'all_to_all': every EP group of {ep} ranks fits in this host, where "
        "moe.ep_transport = 'symm_mem' (--toml examples/ep_symm_mem.toml) moves the rows over NVLink "
        "with one kernel each way and trains faster (docs/routing_and_ep.md, GPU results)"
    )


STATIC_ROWS_NOTED_UP_TO = 4
"""The most received rows, as a multiple of a balanced step's, for which the CUDA-graph note is given, as
far as it was measured: 2 (olmoe-1b-7b at EP 2) and 4 (deepseek-v3-16b at FSDP 4 x EP 4, batch 1 x 2048,
4x H200: 2.5x the exact rows' tokens/s, 74.1 against 70.7 GiB reserved)."""


@register_startup_note
def cuda_graphs_over_symm_mem(config) -> str | None:
    """A note when a compiled step over ``symm_mem`` reads the received rows on the host although
    ``examples/cuda_graphs.toml`` (static rows, CUDA graphs, experts that apply the scores) would run
    here, and its static receive buffers hold at most ``STATIC_ROWS_NOTED_UP_TO`` times a balanced
    step's rows."""
    if config.model_spec is None or not (
        torch.cuda.is_available() and config.compile.enable and config.training.disable_cuda_graphs
    ):
        return None
    if ep_transport_of_run(config).get("ep_transport") != "symm_mem":
        return None
    if dispatchers_setting(config, "ep_receive_rows") != "exact":
        return None
    model = config.model_spec.model
    experts_configs = [experts for _, experts, _, _ in model.traverse(GroupedExperts.Config)]
    if any(isinstance(e, GroupedExperts.Config) and experts_row_weighting_error(e) for e in experts_configs):
        return None
    ep = config.parallelism.expert_parallel_degree
    factor = max(static_receive_rows(1, ep, d.top_k, d.num_experts) / d.top_k for d in routing_dispatchers(config))
    if factor > STATIC_ROWS_NOTED_UP_TO:
        return None
    return (
        "every EP dispatch reads its received row count on the host, so the compiled step waits for "
        "Python; --toml examples/cuda_graphs.toml (static received rows, CUDA graphs, experts that apply "
        f"the router scores) replays it as a CUDA graph, with static receive buffers {factor:g}x a balanced "
        "step's rows: the fastest EP configuration measured on one host (docs/routing_and_ep.md)"
    )
