"""MoE layer with auxiliary load-balancing loss, router z-loss and router statistics.

``RoutedMoE`` is torchtitan's ``MoE`` (router -> routed experts -> combine, shared experts,
aux-loss-free expert bias) with a ``BalancedTopKRouter`` and these additions:

- ``aux_loss_coeff`` (0 = off) and ``aux_loss_type``: the load-balancing loss
  ``aux = sum_e f_e * P_e`` with ``f_e = E * (slots routed to e) / (K * tokens)``,
  ``P_e = mean over tokens of p_{t,e}`` where ``p`` are the router scores normalized to sum 1
  over experts (the softmax itself for softmax routing). A perfectly balanced router has
  ``aux = 1``. ``aux_loss_type``:
    - ``"seq"``: computed per sequence and averaged over sequences (DeepSeek-V3),
    - ``"batch"``: over the local micro-batch (Switch Transformer),
    - ``"global"``: ``f`` counted over the micro-batches of all data-parallel ranks
      (all-reduced, no host sync), ``P`` local (Megatron's global aux loss).
- ``z_loss_coeff`` (0 = off): ``mean over tokens of logsumexp(logits_t)^2`` (ST-MoE).

The losses enter training through their gradients only: ``inject_loss_gradient`` returns the
layer output unchanged and adds ``d(coeff * scale * loss)`` in backward, so torchtitan's
Trainer and loss function are untouched (the logged loss stays the language-model loss).
``loss_scale`` (set by ``configure_router_losses`` at parallelize time) is
``1 / (data-parallel ranks * gradient-accumulation steps * pipeline micro-batches)``: torchtitan
sums gradients over ranks and micro-batches, so the objective becomes
``LM loss + coeff * mean over micro-batches and ranks of the loss``, the same for every EP degree.

After every forward, ``last_router_statistics`` holds that forward's ``RouterStatistics``
(detached tensors on the tokens' device, read without a host sync by the metrics observer).
"""

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch.distributed._functional_collectives import all_reduce
from torchtitan.models.common.moe import MoE

from .router import BalancedTopKRouter, RouterOutput
from .validated_config import ValidatedConfig, choice_errors, positive_or_off_errors

AuxLossType = Literal["seq", "batch", "global"]
AUX_LOSS_TYPES: tuple[str, ...] = get_args(AuxLossType)


class _InjectLossGradient(torch.autograd.Function):
    """Identity on ``output``; backward feeds gradient 1 into ``weighted_loss``."""

    @staticmethod
    def forward(ctx, output, weighted_loss):
        ctx.loss_shape, ctx.loss_dtype, ctx.loss_device = (
            weighted_loss.shape,
            weighted_loss.dtype,
            weighted_loss.device,
        )
        return output.view_as(output)

    @staticmethod
    # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); torch documents one argument per output
    def backward(ctx, grad_output):
        return grad_output, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=ctx.loss_device)


def inject_loss_gradient(output: torch.Tensor, weighted_loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged; in backward, ``weighted_loss`` receives gradient 1 (Megatron-style)."""
    return _InjectLossGradient.apply(output, weighted_loss)


def normalized_probs(scores_BLE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Router scores as a distribution over experts (softmax scores already are one)."""
    if score_func == "softmax":
        return scores_BLE
    return scores_BLE / (scores_BLE.sum(dim=-1, keepdim=True) + 1e-20)


def load_balancing_loss(
    probs_BLE: torch.Tensor,
    routing_map_BLE: torch.Tensor,
    top_k: int,
    loss_type: AuxLossType,
    group=None,
) -> torch.Tensor:
    """``sum_e f_e * P_e`` (see the module docstring); differentiable in ``probs_BLE``.

    ``routing_map_BLE``: True where a token routed a slot to an expert. ``group``: process
    group over which ``"global"`` sums the counts (None: local only).
    """
    num_experts = probs_BLE.shape[-1]
    if loss_type == "seq":
        seq_len = probs_BLE.shape[1]
        f_BE = routing_map_BLE.sum(dim=1).float() * num_experts / (top_k * seq_len)
        return (f_BE * probs_BLE.mean(dim=1)).sum(dim=-1).mean()
    counts_and_tokens = torch.cat(
        [
            routing_map_BLE.sum(dim=(0, 1)).float(),
            routing_map_BLE.new_full((1,), probs_BLE.shape[0] * probs_BLE.shape[1], dtype=torch.float32),
        ]
    )
    if loss_type == "global" and group is not None:
        counts_and_tokens = all_reduce(counts_and_tokens, "sum", group)
    f_E = counts_and_tokens[:-1] * num_experts / (top_k * counts_and_tokens[-1])
    return (f_E * probs_BLE.mean(dim=(0, 1))).sum()


def router_z_loss(logits_BLE: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``logsumexp(logits)^2``."""
    return torch.logsumexp(logits_BLE.float(), dim=-1).square().mean()


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterStatistics:
    """What one forward of a ``RoutedMoE`` routed, as detached tensors on the tokens' device.

    ``tokens_per_expert_E``: ``(E,)`` int64, slots routed to each expert (before dropping).
    ``num_dropped_slots``: 0-d int64, routed slots dropped by the capacity limit.
    ``num_padding_rows``: 0-d int64, zero rows the experts computed (align_size padding);
    None when the layer's token dispatcher has not reported any.
    ``aux_loss`` / ``z_loss``: 0-d fp32, this rank's load-balancing / router z-loss
    (unscaled, without coeff); None when that loss is off.
    """

    tokens_per_expert_E: torch.Tensor
    num_dropped_slots: torch.Tensor
    num_padding_rows: torch.Tensor | None
    aux_loss: torch.Tensor | None
    z_loss: torch.Tensor | None


class RoutedMoE(MoE):
    """torchtitan's MoE plus aux/z losses and router statistics; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(ValidatedConfig, MoE.Config):
        # pyrefly: ignore[bad-override-mutable-attribute]  # narrows torchtitan's field to this experiment's router
        router: BalancedTopKRouter.Config
        aux_loss_coeff: float = 0.0
        """Weight of the load-balancing loss in the objective (0: off)."""
        aux_loss_type: AuxLossType = "batch"
        """``"seq"``, ``"batch"`` or ``"global"``; see the module docstring."""
        z_loss_coeff: float = 0.0
        """Weight of the router z-loss in the objective (0: off)."""

        def validation_errors(self, key: Callable[[str], str] = str) -> list[str]:
            """Every invalid option, one message each; ``key(field)`` is how a message names a field."""
            errors = [
                f"{key(name)} = {value!r}: must be a finite number >= 0 (0 = off)"
                for name, value in (("aux_loss_coeff", self.aux_loss_coeff), ("z_loss_coeff", self.z_loss_coeff))
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0)
            ]
            errors += choice_errors(key, "aux_loss_type", self.aux_loss_type, AUX_LOSS_TYPES)
            errors += positive_or_off_errors(key, "load_balance_coeff", self.load_balance_coeff)
            return errors

    def __init__(self, config: Config):
        super().__init__(config)
        self.aux_loss_coeff = config.aux_loss_coeff
        self.aux_loss_type = config.aux_loss_type
        self.z_loss_coeff = config.z_loss_coeff
        self.loss_scale = 1.0
        self.loss_group = None
        self.last_router_statistics: RouterStatistics | None = None

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        """``(B, L, D)`` -> ``(B, L, D)``."""
        routed: RouterOutput = self.router.route(x_BLD, self.expert_bias_E)
        num_routed_per_expert_E = routed.num_routed_per_expert_E
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(num_routed_per_expert_E)

        out_BLD = self.routed_experts(
            x_BLD, routed.topk_scores_BLK, routed.topk_expert_ids_BLK, routed.num_kept_per_expert_E
        )
        if self.shared_experts is not None:
            out_BLD = out_BLD + self.shared_experts(x_BLD)

        out_BLD, aux_loss, z_loss = self._add_router_losses(out_BLD, routed)
        self.last_router_statistics = RouterStatistics(
            tokens_per_expert_E=num_routed_per_expert_E.detach(),
            num_dropped_slots=routed.num_dropped_slots.detach(),
            num_padding_rows=getattr(self.routed_experts.token_dispatcher, "last_num_padding_rows", None),
            aux_loss=aux_loss,
            z_loss=z_loss,
        )
        return out_BLD

    def _add_router_losses(
        self, out_BLD: torch.Tensor, routed: RouterOutput
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(out_BLD with the weighted losses' gradient injected, aux loss, z loss)``.

        The returned losses are detached; each is None when its coefficient is 0.
        """
        weighted_losses = []
        aux_loss_value = z_loss_value = None
        if self.aux_loss_coeff > 0:
            routing_map_BLE = torch.zeros_like(routed.scores_BLE, dtype=torch.bool).scatter_(
                -1, routed.routed_expert_ids_BLK, True
            )
            aux_loss = load_balancing_loss(
                normalized_probs(routed.scores_BLE, self.router.score_func),
                routing_map_BLE,
                self.router.top_k,
                self.aux_loss_type,
                self.loss_group,
            )
            aux_loss_value = aux_loss.detach()
            weighted_losses.append(self.aux_loss_coeff * aux_loss)
        if self.z_loss_coeff > 0:
            z_loss = router_z_loss(routed.logits_BLE)
            z_loss_value = z_loss.detach()
            weighted_losses.append(self.z_loss_coeff * z_loss)
        if weighted_losses and torch.is_grad_enabled():
            out_BLD = inject_loss_gradient(out_BLD, self.loss_scale * functools.reduce(operator.add, weighted_losses))
        return out_BLD, aux_loss_value, z_loss_value


def configure_router_losses(model: torch.nn.Module, *, parallel_dims, training, parallelism) -> None:
    """Set ``loss_scale`` and the ``"global"`` reduction group on every ``RoutedMoE``.

    Data ranks are torchtitan's loss mesh (data parallel x context parallel).
    """
    data_ranks = parallel_dims.dp_replicate * parallel_dims.dp_shard * parallel_dims.cp
    batch_degree = parallel_dims.dp_replicate * parallel_dims.dp_shard
    accumulation_steps = 1
    if training.global_batch_size > 0:
        accumulation_steps = training.global_batch_size // (training.local_batch_size * batch_degree)
    pipeline_microbatches = 1
    if parallel_dims.pp > 1:
        pipeline_microbatches = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    for module in model.modules():
        if isinstance(module, RoutedMoE):
            module.loss_scale = 1.0 / (data_ranks * accumulation_steps * pipeline_microbatches)
            module.loss_group = None if loss_mesh is None else loss_mesh.get_group()
