"""Which of torchtitan's Trainer features this experiment's MoE layers run under.

Checked once on the final config, before any process group or model is built; a setting the
layers cannot honour is refused with the reason (exit 2), never silently ignored:

- ``parallelism.spmd_backend``: only ``"partial_dtensor"`` (DTensor on model-parallel axes).
  ``"spmd_types"`` and ``"full_dtensor"`` make FSDP require every parameter to be a DTensor
  on the full SPMD mesh, which needs sharding annotations these model configs do not carry.
- ``compile.enable``: every compute backend and EP transport compiles (the Triton kernels and
  EP moves are ``torch.library`` ops, the metrics count on the device); the host reads of
  ``for_loop``, ``batched_mm_padded`` and the EP row counts become unbacked sizes, as in
  torchtitan's own EP path.
- CUDA graphs (``training.disable_cuda_graphs = false``): a captured step replays kernels only,
  so nothing may be read on the host: refused for the ``for_loop`` / ``batched_mm_padded``
  backends (they read expert counts), for ``grouped_mm`` outside bf16 parameters or on GPUs other
  than Hopper / Blackwell (``torch._grouped_mm`` then reads its offsets on the host,
  ``grouped_matmul.reads_offsets_on_host``) and, under expert parallelism, unless every dispatcher is
  sync-free (``moe.ep_receive_rows = "static"``, over either EP transport, which ``"auto"`` becomes
  where CUDA graphs are on: ``cuda_graph_step``; torchtitan's own check is told so by
  ``compat.cuda_graph_dispatchers``).
- Quantizing converters subclass the experts module, but this experiment's experts compute
  through their backend function. torchtitan's float8 grouped-experts converter
  (``Float8GroupedExpertsConverter``, rowwise) is taken as ``moe.expert_precision =
  "fp8_rowwise"`` (``adopt_torchtitan_float8_experts``); any other (MXFP8, ...) would leave the
  model computing in bf16: refused.
"""

from torchtitan.config.override import derive
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.checks import register_config_check
from torchtitan_ext.config.value_sources import record_value_sources
from torchtitan_ext.registry import register_config_adapter
from torchtitan_ext.validation import named

from .cuda_graph_step import cuda_graph_blockers
from .dispatcher import RoutingDispatcher
from .experts import BackendGroupedExperts

SUPPORTED_SPMD_BACKEND = "partial_dtensor"


FLOAT8_CONVERTER_SOURCE = "the flavor's model converters (torchtitan's Float8GroupedExpertsConverter)"
"""Where start-up errors say ``moe.expert_precision = "fp8_rowwise"`` came from when the converter set it."""
TORCHTITAN_FLOAT8_MODULE = "torchtitan.components.quantization.float8"
"""Where torchtitan defines ``Float8GroupedExpertsConverter`` and the experts subclasses it builds."""


def is_torchtitan_float8_experts(experts_config) -> bool:
    """True for the experts config torchtitan's float8 converter made of a ``BackendGroupedExperts.Config``."""
    owner = getattr(type(experts_config), "_owner", None)
    return (
        isinstance(experts_config, BackendGroupedExperts.Config)
        and type(experts_config) is not BackendGroupedExperts.Config
        and owner is not None
        and owner.__module__ == TORCHTITAN_FLOAT8_MODULE
    )


@register_config_adapter
def adopt_torchtitan_float8_experts(config) -> None:
    """On a flavor's built config, before TOML files and the command line: the MoE layers torchtitan's
    ``Float8GroupedExpertsConverter`` converted compute their experts with ``expert_precision =
    "fp8_rowwise"`` in this experiment's experts module (its torchao subclass is not built), and route
    through this experiment's dispatcher again, with its default options (the converter's padding
    dispatcher is not needed: the FP8 weight gradient is computed in high precision, so expert groups
    need no 16-row alignment)."""
    if config.model_spec is None:
        return
    for _, routed, _, _ in config.model_spec.model.traverse(RoutedExperts.Config):
        if not (isinstance(routed, RoutedExperts.Config) and is_torchtitan_float8_experts(routed.inner_experts)):
            continue
        # Set after the copy, as an override is: the flavor's compute backend may have no FP8 GEMMs,
        # which the TOML files and the command line can still change; the start-up check refuses what
        # remains, naming the converter as where the precision came from.
        routed.inner_experts = derive(routed.inner_experts, BackendGroupedExperts.Config)
        routed.inner_experts.expert_precision = "fp8_rowwise"
        record_value_sources({"moe.expert_precision": FLOAT8_CONVERTER_SOURCE})
        dispatcher = routed.token_dispatcher
        if not isinstance(dispatcher, RoutingDispatcher.Config):
            routed.token_dispatcher = RoutingDispatcher.Config(
                num_experts=dispatcher.num_experts, top_k=dispatcher.top_k
            )


@register_config_check
def check_torchtitan_features(config) -> None:
    """Refuse torchtitan features the MoE layers cannot honour (see the module docstring)."""
    model_spec = config.model_spec
    if model_spec is None or not any(model_spec.model.traverse(BackendGroupedExperts.Config)):
        return
    errors = []
    if config.parallelism.spmd_backend != SUPPORTED_SPMD_BACKEND:
        errors.append(
            f"parallelism.spmd_backend = {config.parallelism.spmd_backend!r} is not supported by this "
            f"experiment's models (they carry no SPMD sharding annotations); use {SUPPORTED_SPMD_BACKEND!r}"
        )
    if not config.training.disable_cuda_graphs and (blockers := cuda_graph_blockers(config)):
        errors.append(
            f"{named('training.disable_cuda_graphs')} = false: a CUDA graph cannot replay this MoE step ("
            + "; ".join(blockers)
            + ")"
        )
    for fqn, experts, _, _ in model_spec.model.traverse(GroupedExperts.Config):
        if type(experts) is not BackendGroupedExperts.Config:
            name = type(experts).__qualname__.rpartition("<locals>.")[2]  # a class a function built
            errors.append(
                f"{fqn or 'model'}: experts config {name} (from a quantizing "
                "converter such as MXFP8 grouped experts) is not supported: this experiment's experts compute "
                "through their compute_backend and would silently stay in bf16 (FP8 rowwise experts: "
                "moe.expert_precision = 'fp8_rowwise', or torchtitan's Float8GroupedExpertsConverter)"
            )
            break
    if errors:
        raise ConfigError("\n".join(errors))
