"""What the MoE backends experiment says about a run: its run metadata and its start-up note.

``compute_backend``, ``expert_precision``, ``ep_transport``, static ``ep_receive_rows``,
``experts_apply_scores``, ``recompute_preactivations`` and ``experts_fsdp = "always"`` identify a run in
the metrics' run metadata (``registry.register_run_description``); notes before training
(``registry.register_startup_note``) suggest ``symm_mem`` where every EP group fits in this host.
"""

from torchtitan.models.common.moe import GroupedExperts

from torchtitan_ext.registry import register_run_description, register_startup_note

from .dispatcher import symm_mem_unfit_reason
from .experts import DEFAULT_BACKEND, BackendGroupedExperts
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
    pre-activations in backward: true in every MoE layer, "N of M MoE layers" in some; nothing for the
    default (they keep them)."""
    if config.model_spec is None:
        return {}
    recomputing = [
        isinstance(experts, BackendGroupedExperts.Config) and experts.recompute_preactivations
        for _, experts, _, _ in config.model_spec.model.traverse(GroupedExperts.Config)
    ]
    if not any(recomputing):
        return {}
    if all(recomputing):
        return {"recompute_preactivations": True}
    return {"recompute_preactivations": f"{sum(recomputing)} of {len(recomputing)} MoE layers"}


@register_run_description
def experts_fsdp_of_run(config) -> dict:
    """``experts_fsdp`` of the run metadata where FSDP wraps the project's routed experts on every layout
    (``"always"``); nothing for the default, ``"auto"``."""
    choice = experts_setting(config, "fsdp", "auto")
    return {} if choice == "auto" else {"experts_fsdp": choice}


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
