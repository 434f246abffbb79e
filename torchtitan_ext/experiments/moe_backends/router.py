"""Token-choice top-k router with load-balancing losses, z-loss and token capacity.

``BalancedTopKRouter`` is torchtitan's ``TokenChoiceTopKRouter`` (score function, top_k,
route_norm, route_scale, group-limited routing, aux-loss-free expert bias) and adds:

- ``capacity_factor``: each expert keeps at most
  ``ceil(capacity_factor * T * top_k / num_experts)`` routed slots of the ``T`` local tokens,
  first come first served in token order. A dropped slot gets expert id ``num_experts`` (the
  dispatchers skip it) and score 0, so its token contributes nothing there (with the residual
  connection it passes through the layer unchanged).
- ``route(x_BLD, expert_bias_E)`` returning a ``RouterOutput`` that also carries the gate logits,
  the normalized scores the MoE layer needs for its auxiliary and z losses, and the slot count
  of every expert.

Under tensor parallelism the tokens and the routing are DTensors (replicated over TP, or split
over it by the sequence under EP): the counts and the capacity limit are computed on this rank's
tokens and handed on as DTensors again, the counts Partial where the tokens are split.

On CPU, with every extra option off, ``forward`` returns exactly what torchtitan's router
returns. On CUDA the gate runs on bf16 tensor cores (see ``RouterGate``), and the score
function, expert bias, top-k, normalisation and counts run in one Triton kernel each way
(``kernels.topk_routing``: same routing up to fp32 rounding, ties to the lowest expert id)
unless group-limited routing or torchtitan's debug load balancing is on.

``RouterGate`` is torchtitan's gate (a ``Linear``) that, when torchtitan's router asks for fp32
logits from bf16 tokens and a bf16 weight on CUDA, computes them on bf16 tensor cores with fp32
accumulation instead of copying both operands to fp32 for an fp32 GEMM: the products of bf16
values are exact in fp32, so only the order of the fp32 sums differs. Its backward splits the
fp32 logit gradient into three bf16 parts (hi + mid + lo, 24 significant bits) so the two
gradient GEMMs also run on tensor cores, with fp32 accumulation, at fp32 accuracy.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import TokenChoiceTopKRouter

from torchtitan_ext.kernels.moe_permute import slot_counts, stable_expert_order
from torchtitan_ext.kernels.topk_routing import topk_routing, topk_routing_unsupported_reason

from .dtensor_parts import laid_out_like, local_part
from .validated_config import ValidatedConfig, positive_or_off_errors


@dataclass(frozen=True, kw_only=True)
class RouterOutput:
    """What the MoE layer needs from one routing pass (B, L leading dims, E experts, K top-k)."""

    topk_scores_BLK: torch.Tensor
    """gating weights; 0 for dropped slots"""
    topk_expert_ids_BLK: torch.Tensor
    """chosen experts; ``num_experts`` for dropped slots"""
    routed_expert_ids_BLK: torch.Tensor
    """chosen experts before capacity dropping (load statistics, aux loss)"""
    scores_BLE: torch.Tensor
    """scores after the score function (softmax or sigmoid)"""
    logits_BLE: torch.Tensor
    """gate output before the score function, fp32 (z-loss)"""
    num_dropped_slots: torch.Tensor
    """scalar int64: routed slots dropped by the capacity limit"""
    num_routed_per_expert_E: torch.Tensor
    """(E,) int64: slots routed to each expert, before capacity dropping"""
    num_kept_per_expert_E: torch.Tensor
    """(E,) int64: slots each expert computes (``num_routed_per_expert_E`` capped at the capacity)"""


def bf16_parts(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``hi, mid, lo`` with ``hi + mid + lo == values`` (fp32) to 2^-24 relative.

    Each part is what is left of ``values`` after the parts before it, rounded to bf16.
    """
    hi = values.to(torch.bfloat16)
    remainder = values - hi
    mid = remainder.to(torch.bfloat16)
    return hi, mid, (remainder - mid).to(torch.bfloat16)


def _matmul_fp32_out(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit matrices as fp32: exact products, fp32 sums (tensor cores on CUDA)."""
    if a_MK.is_cuda:
        return torch.mm(a_MK, b_KN, out_dtype=torch.float32)
    return a_MK.float() @ b_KN.float()


class _Bf16GateLogits(torch.autograd.Function):
    """``x_ND @ weight_ED.T`` in fp32 from bf16 operands; gradients come back in bf16.

    Backward multiplies the three bf16 parts of the fp32 logit gradient, side by side along
    the expert dimension ([N, 3E]), with the weight stacked three times ([3E, D]) for d x and
    with x for d weight ([3E, D] in fp32, the parts then summed).
    """

    @staticmethod
    def forward(ctx, x_ND, weight_ED):
        ctx.save_for_backward(x_ND, weight_ED)
        with torch.autocast(x_ND.device.type, enabled=False):
            return _matmul_fp32_out(x_ND, weight_ED.t())

    @staticmethod
    # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); torch documents one argument per output
    def backward(ctx, grad_logits_NE):
        x_ND, weight_ED = ctx.saved_tensors
        num_experts, dim = weight_ED.shape
        grad_x_ND = grad_weight_ED = None
        with torch.autocast(x_ND.device.type, enabled=False):
            parts_N3E = torch.cat(bf16_parts(grad_logits_NE), dim=1)
            if ctx.needs_input_grad[0]:
                grad_x_ND = torch.mm(parts_N3E, torch.cat((weight_ED,) * 3))
            if ctx.needs_input_grad[1]:
                grad_3ED = _matmul_fp32_out(parts_N3E.t(), x_ND).view(3, num_experts, dim)
                grad_weight_ED = grad_3ED.sum(dim=0).to(weight_ED.dtype)
        return grad_x_ND, grad_weight_ED


def bf16_gate_logits(x_BLD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """``(B, L, E)`` fp32 ``x @ weight.T`` of bf16 ``x_BLD`` and ``weight_ED``, differentiable in both."""
    logits_NE = _Bf16GateLogits.apply(x_BLD.reshape(-1, x_BLD.shape[-1]), weight_ED)
    return logits_NE.view(*x_BLD.shape[:-1], weight_ED.shape[0])


class RouterGate(Linear):
    """torchtitan's router gate; fp32 logits of bf16 operands on tensor cores (module docstring).

    Takes that path when fp32 autocast is on (torchtitan's router turns it on around the gate),
    ``x`` and the weight are bf16 CUDA tensors, the weight is not a DTensor and there is no
    bias; otherwise it is ``Linear`` unchanged.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        pass

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._bf16_path_applies(input):
            return bf16_gate_logits(input, self.weight)
        return super().forward(input)

    def _bf16_path_applies(self, x: torch.Tensor) -> bool:
        weight = self.weight
        return (
            x.is_cuda
            and x.dtype == weight.dtype == torch.bfloat16
            and self.bias is None
            and not isinstance(weight, DTensor)
            and not isinstance(x, DTensor)
            and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") == torch.float32
        )


def capacity_keep_mask(expert_ids_S: torch.Tensor, counts_E: torch.Tensor, capacity: int) -> torch.Tensor:
    """``(N,)`` bool: slot keeps its expert iff fewer than ``capacity`` earlier slots chose it.

    ``counts_E``: the slots that chose each expert (``slot_counts`` of ``expert_ids_S``).
    "Earlier" is slot order (token-major), so the first tokens of the batch win. No host sync.
    """
    order_S = stable_expert_order(expert_ids_S, counts_E.shape[0])
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_ids_S = expert_ids_S[order_S]
    rank_sorted_S = torch.arange(expert_ids_S.shape[0], device=expert_ids_S.device) - starts_E[sorted_ids_S]
    rank_S = torch.empty_like(rank_sorted_S).scatter_(0, order_S, rank_sorted_S)
    return rank_S < capacity


class BalancedTopKRouter(TokenChoiceTopKRouter):
    """torchtitan's top-k router plus token capacity; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(ValidatedConfig, TokenChoiceTopKRouter.Config):
        capacity_factor: float | None = None
        """Per-expert slot limit as a multiple of the balanced load; None: no limit."""

        def validation_errors(self, key: Callable[[str], str] = str) -> list[str]:
            """Every invalid option, one message each; ``key(field)`` is how a message names a field."""
            errors = []
            if not 1 <= self.top_k <= self.num_experts:
                errors.append(
                    f"{key('top_k')} = {self.top_k}: must be in [1, {self.num_experts}] (the number of experts)"
                )
            if self.route_scale <= 0:
                errors.append(f"{key('route_scale')} = {self.route_scale}: must be > 0")
            groups, limited = self.num_expert_groups, self.num_limited_groups
            if groups is None and limited is not None:
                errors.append(
                    f"{key('num_limited_groups')} = {limited}: needs num_expert_groups too (group-limited routing)"
                )
            elif groups is not None and limited is None:
                errors.append(
                    f"{key('num_expert_groups')} = {groups}: needs num_limited_groups too (group-limited routing)"
                )
            elif groups is not None and limited is not None:
                if groups < 1 or self.num_experts % groups:
                    errors.append(
                        f"{key('num_expert_groups')} = {groups}: must divide the number of experts ({self.num_experts})"
                    )
                elif self.num_experts // groups < 2:
                    errors.append(f"{key('num_expert_groups')} = {groups}: leaves fewer than 2 experts per group")
                elif not 1 <= limited <= groups:
                    errors.append(
                        f"{key('num_limited_groups')} = {limited}: must be in [1, {groups}] (num_expert_groups)"
                    )
                elif self.top_k > limited * (self.num_experts // groups):
                    errors.append(f"{key('top_k')} = {self.top_k}: exceeds the experts in {limited} limited groups")
            errors += positive_or_off_errors(key, "capacity_factor", self.capacity_factor)
            return errors

    def __init__(self, config: Config):
        super().__init__(config)
        self.capacity_factor = config.capacity_factor
        self._last_logits_BLE: torch.Tensor | None = None
        self.gate.register_forward_hook(self._keep_logits)

    def _keep_logits(self, module, inputs, output) -> None:
        self._last_logits_BLE = output

    def capacity(self, num_tokens: int) -> int | None:
        """Slots each expert keeps out of ``num_tokens`` local tokens (None: unlimited)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def _kernel_routes(self, x_BLD: torch.Tensor) -> bool:
        """Whether ``route`` takes the Triton top-k routing path (module docstring)."""
        return (
            x_BLD.is_cuda
            and not isinstance(x_BLD, DTensor)
            and self.num_expert_groups is None
            and not self._debug_force_load_balance
            and topk_routing_unsupported_reason(self.num_experts, self.top_k, self.score_func, torch.float32) is None
        )

    def _route_with_kernels(
        self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """torchtitan's fp32 gate, then ``topk_routing``: ``(topk_scores_BLK, topk_expert_ids_BLK,
        scores_BLE, num_routed_per_expert_E)``."""
        with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
            logits_BLE = self.gate(x_BLD)
        topk_scores_NK, topk_ids_NK, scores_NE, counts_E = topk_routing(
            logits_BLE.float().reshape(-1, self.num_experts),
            expert_bias_E,
            self.top_k,
            self.score_func,
            self.route_norm,
            self.route_scale,
        )
        leading = x_BLD.shape[:-1]
        return (
            topk_scores_NK.view(*leading, self.top_k),
            topk_ids_NK.view(*leading, self.top_k),
            scores_NE.view(*leading, self.num_experts),
            counts_E,
        )

    def route(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None) -> RouterOutput:
        """Route ``x_BLD``; torchtitan's routing, then the capacity limit.

        Under tensor parallelism ``x_BLD`` and the routing are DTensors: counts and capacity are
        this rank's tokens' (the counts Partial where the tokens are sharded), as without it.
        """
        if self._kernel_routes(x_BLD):
            topk_scores_BLK, topk_expert_ids_BLK, scores_BLE, counts_E = self._route_with_kernels(x_BLD, expert_bias_E)
        else:
            topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = super().forward(x_BLD, expert_bias_E)
            counts_E = laid_out_like(
                slot_counts(local_part(topk_expert_ids_BLK).reshape(-1), self.num_experts),
                topk_expert_ids_BLK,
                sum_over_tokens=True,
            )
        logits_BLE, self._last_logits_BLE = self._last_logits_BLE, None
        assert logits_BLE is not None, "the gate's forward hook keeps the logits of every route"
        routed_expert_ids_BLK = topk_expert_ids_BLK
        num_kept_E = counts_E
        num_dropped_slots = torch.zeros((), dtype=torch.int64, device=topk_expert_ids_BLK.device)
        ids_BLK = local_part(topk_expert_ids_BLK)
        capacity = self.capacity(ids_BLK.shape[0] * ids_BLK.shape[1])
        if capacity is not None:
            keep_BLK = capacity_keep_mask(ids_BLK.reshape(-1), local_part(counts_E), capacity).view_as(ids_BLK)
            topk_expert_ids_BLK = laid_out_like(torch.where(keep_BLK, ids_BLK, self.num_experts), topk_expert_ids_BLK)
            topk_scores_BLK = topk_scores_BLK * laid_out_like(keep_BLK, topk_scores_BLK)
            num_kept_E = laid_out_like(local_part(counts_E).clamp(max=capacity), counts_E)
            num_dropped_slots = (~keep_BLK).sum()
        return RouterOutput(
            topk_scores_BLK=topk_scores_BLK,
            topk_expert_ids_BLK=topk_expert_ids_BLK,
            routed_expert_ids_BLK=routed_expert_ids_BLK,
            scores_BLE=scores_BLE,
            logits_BLE=logits_BLE,
            num_dropped_slots=num_dropped_slots,
            num_routed_per_expert_E=counts_E,
            num_kept_per_expert_E=num_kept_E,
        )

    def forward(
        self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """torchtitan's contract: ``(topk_scores_BLK, topk_expert_ids_BLK, scores_BLE)``."""
        routed = self.route(x_BLD, expert_bias_E)
        return routed.topk_scores_BLK, routed.topk_expert_ids_BLK, routed.scores_BLE

    def extra_repr(self) -> str:
        return (
            f"top_k={self.top_k}, score_func={self.score_func}, route_norm={self.route_norm}, "
            f"route_scale={self.route_scale}, capacity_factor={self.capacity_factor}"
        )
