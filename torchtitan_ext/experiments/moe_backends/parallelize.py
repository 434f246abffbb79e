"""How the MoE backends experiment parallelizes a model: torchtitan's ``parallelize_fn``, with the
router losses configured first and, where FSDP would only copy them, the routed experts left out of FSDP.

Under expert parallelism torchtitan shards the routed experts with FSDP over the ``efsdp`` axis
(``dp_shard * cp * tp / ep`` ranks) and keeps that axis when it has one rank (FSDP 2 x EP 2, FSDP 4 x
EP 4). On one rank FSDP has nothing to shard or reduce, yet every step it copies each expert weight
into an all-gather buffer and out of it (forward, and again in backward), casts it to the
mixed-precision dtype, and copies and casts every expert gradient into a reduce-scatter buffer.

``BackendGroupedExperts.Config.fsdp`` (short key ``moe.experts_fsdp``):

- ``"auto"``: where the ``efsdp`` axis has one rank (and no ``dp_replicate`` axis, no CPU offload),
  the experts stay out of FSDP: their weights stay the fp32 DTensors expert parallelism made them,
  which the backends read in the activations' dtype, and the backward writes their fp32 gradients
  directly. Everything else is sharded as torchtitan does. The math is the same (an FSDP
  reduce-scatter over one rank with torchtitan's divide factor 1 is the identity).
- ``"always"``: torchtitan's way, FSDP over every axis including a one-rank one.

torchtitan's own experts (the ``-torchtitan-moe`` flavors) compute in the weights' dtype, so they
always go through FSDP, as do models whose ``parallelize_fn`` is not one that ``FSDP_STEPS`` knows.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.tools.logging import logger

from .moe import configure_router_losses


def _fsdp_of_decoder(model: nn.Module, *, parallel_dims, training, parallelism) -> None:
    """The FSDP step of ``parallelize_qwen3`` (``partial_dtensor``, no ``dp_replicate``, no CPU offload)."""
    apply_fsdp_to_decoder(
        model,  # pyrefly: ignore[bad-argument-type]  # a torchtitan Decoder, typed as its nn.Module base here
        parallel_dims.get_mesh("fsdp"),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        ep_degree=parallel_dims.ep,
        edp_mesh=parallel_dims.get_optional_mesh("efsdp"),
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )


FSDP_STEPS: dict[Callable, Callable[..., None]] = {parallelize_qwen3: _fsdp_of_decoder}
"""torchtitan ``parallelize_fn`` -> its FSDP step alone, for the functions that take ``skip_dp`` (run
with it, then this step with the experts hidden)."""


def has_known_fsdp_step(parallelize_fn: Callable) -> bool:
    """Whether ``parallelize_fn`` (or the torchtitan function ``moe_parallelize`` wrapped in it) is one whose
    FSDP step ``FSDP_STEPS`` knows, so ``fsdp = "auto"`` can leave the experts out of FSDP."""
    return getattr(parallelize_fn, "__wrapped__", parallelize_fn) in FSDP_STEPS


def experts_outside_fsdp_reason(parallel_dims, training, parallelism) -> str | None:
    """Why this layout leaves the routed experts out of FSDP (``fsdp = "auto"``), None where it does not."""
    efsdp = parallel_dims.dp_shard * parallel_dims.cp * parallel_dims.tp // parallel_dims.ep
    if parallel_dims.ep <= 1 or efsdp != 1 or parallel_dims.dp_replicate > 1 or training.enable_cpu_offload:
        return None
    if parallelism.spmd_backend != "partial_dtensor":
        return None
    return f"each expert lives on one rank (efsdp = dp_shard x cp x tp / ep = 1 at EP {parallel_dims.ep})"


def _routed_experts(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, GroupedExperts)]


def all_experts_fsdp_auto(experts: list) -> bool:
    """Whether there are routed experts (modules or their configs) and every one is ours with
    ``fsdp = "auto"`` (torchtitan's own have no such field: FSDP always wraps them)."""
    return bool(experts) and all(getattr(expert, "fsdp", "always") == "auto" for expert in experts)


def experts_outside_fsdp(
    model: nn.Module, parallelize_fn: Callable, *, parallel_dims, training, parallelism
) -> str | None:
    """Why ``moe_parallelize`` leaves ``model``'s routed experts out of FSDP, None where it does not: every
    one is ours with ``fsdp = "auto"``, ``parallelize_fn`` has a known FSDP step, and the layout gives each
    expert one rank (``experts_outside_fsdp_reason``)."""
    if not all_experts_fsdp_auto(_routed_experts(model)) or not has_known_fsdp_step(parallelize_fn):
        return None
    return experts_outside_fsdp_reason(parallel_dims, training, parallelism)


@contextlib.contextmanager
def _parameters_hidden(modules: list[nn.Module]) -> Iterator[None]:
    """``modules`` without their own parameters inside the block (FSDP then neither shards nor owns them)."""
    kept = [module._parameters for module in modules]
    for module in modules:
        module._parameters = {}
    try:
        yield
    finally:
        for module, parameters in zip(modules, kept):
            module._parameters = parameters


def moe_parallelize(parallelize_fn: Callable) -> Callable:
    """Wrap a torchtitan ``parallelize_fn``: router losses configured first (``configure_router_losses``);
    the routed experts kept out of FSDP where ``experts_outside_fsdp`` says so."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, *, parallel_dims, training, parallelism, **kwargs):
        layout = dict(parallel_dims=parallel_dims, training=training, parallelism=parallelism)
        configure_router_losses(model, **layout)
        reason = None if kwargs.get("skip_dp") else experts_outside_fsdp(model, parallelize_fn, **layout)
        if reason is None:
            return parallelize_fn(model, **layout, **kwargs)
        model = parallelize_fn(model, **layout, **{**kwargs, "skip_dp": True})
        logger.info(f"Routed experts kept out of FSDP, which would only copy them: {reason} (moe.experts_fsdp)")
        with _parameters_hidden(_routed_experts(model)):
            FSDP_STEPS[parallelize_fn](model, **layout)
        return model

    return parallelize
