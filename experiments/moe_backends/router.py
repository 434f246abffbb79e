"""Token-choice top-k router with load-balancing losses, z-loss and token capacity.

``BalancedTopKRouter`` is torchtitan's ``TokenChoiceTopKRouter`` (score function, top_k,
route_norm, route_scale, group-limited routing, aux-loss-free expert bias) and adds:

- ``capacity_factor``: each expert keeps at most
  ``ceil(capacity_factor * T * top_k / num_experts)`` routed slots of the ``T`` local tokens,
  first come first served in token order. A dropped slot gets expert id ``num_experts`` (the
  dispatchers skip it) and score 0, so its token contributes nothing there (with the residual
  connection it passes through the layer unchanged).
- ``route(x_BLD, expert_bias_E)`` returning a ``RouterOutput`` that also carries the gate logits
  and normalized scores the MoE layer needs for its auxiliary and z losses.

With every extra option off, ``forward`` returns exactly what torchtitan's router returns.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchtitan.models.common.moe import TokenChoiceTopKRouter


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


def capacity_keep_mask(
    expert_ids_S: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """``(N,)`` bool: slot keeps its expert iff fewer than ``capacity`` earlier slots chose it.

    "Earlier" is slot order (token-major), so the first tokens of the batch win. No host sync.
    """
    order_S = torch.argsort(expert_ids_S, stable=True)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids_S.device)
    counts_E.scatter_add_(0, expert_ids_S, torch.ones_like(expert_ids_S))
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_ids_S = expert_ids_S[order_S]
    rank_sorted_S = torch.arange(expert_ids_S.shape[0], device=expert_ids_S.device) - starts_E[sorted_ids_S]
    rank_S = torch.empty_like(rank_sorted_S).scatter_(0, order_S, rank_sorted_S)
    return rank_S < capacity


class BalancedTopKRouter(TokenChoiceTopKRouter):
    """torchtitan's top-k router plus token capacity; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        capacity_factor: float | None = None
        """Per-expert slot limit as a multiple of the balanced load; None: no limit."""

        def __post_init__(self):
            if errors := self.validation_errors():
                raise ValueError("; ".join(errors))

        def validation_errors(self, key: Callable[[str], str] = str) -> list[str]:
            """Every invalid option, one message each; ``key(field)`` is how a message names a field."""
            errors = []
            if not 1 <= self.top_k <= self.num_experts:
                errors.append(f"{key('top_k')} = {self.top_k}: must be in [1, {self.num_experts}] (the number of experts)")
            if self.route_scale <= 0:
                errors.append(f"{key('route_scale')} = {self.route_scale}: must be > 0")
            groups, limited = self.num_expert_groups, self.num_limited_groups
            if groups is None and limited is not None:
                errors.append(f"{key('num_limited_groups')} = {limited}: needs num_expert_groups too (group-limited routing)")
            elif groups is not None and limited is None:
                errors.append(f"{key('num_expert_groups')} = {groups}: needs num_limited_groups too (group-limited routing)")
            elif groups is not None:
                if groups < 1 or self.num_experts % groups:
                    errors.append(f"{key('num_expert_groups')} = {groups}: must divide the number of experts ({self.num_experts})")
                elif self.num_experts // groups < 2:
                    errors.append(f"{key('num_expert_groups')} = {groups}: leaves fewer than 2 experts per group")
                elif not 1 <= limited <= groups:
                    errors.append(f"{key('num_limited_groups')} = {limited}: must be in [1, {groups}] (num_expert_groups)")
                elif self.top_k > limited * (self.num_experts // groups):
                    errors.append(f"{key('top_k')} = {self.top_k}: exceeds the experts in {limited} limited groups")
            if self.capacity_factor is not None and self.capacity_factor <= 0:
                errors.append(f"{key('capacity_factor')} = {self.capacity_factor}: must be > 0, or off (None; 0 in TOML)")
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

    def route(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None) -> RouterOutput:
        """Route ``x_BLD``; torchtitan's routing, then the capacity limit."""
        topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = super().forward(x_BLD, expert_bias_E)
        logits_BLE, self._last_logits_BLE = self._last_logits_BLE, None
        routed_expert_ids_BLK = topk_expert_ids_BLK
        num_dropped_slots = torch.zeros((), dtype=torch.int64, device=topk_expert_ids_BLK.device)
        capacity = self.capacity(x_BLD.shape[0] * x_BLD.shape[1])
        if capacity is not None:
            keep_BLK = capacity_keep_mask(
                topk_expert_ids_BLK.reshape(-1), self.num_experts, capacity
            ).view_as(topk_expert_ids_BLK)
            topk_expert_ids_BLK = torch.where(keep_BLK, topk_expert_ids_BLK, self.num_experts)
            topk_scores_BLK = topk_scores_BLK * keep_BLK
            num_dropped_slots = (~keep_BLK).sum()
        return RouterOutput(
            topk_scores_BLK=topk_scores_BLK,
            topk_expert_ids_BLK=topk_expert_ids_BLK,
            routed_expert_ids_BLK=routed_expert_ids_BLK,
            scores_BLE=scores_BLE,
            logits_BLE=logits_BLE,
            num_dropped_slots=num_dropped_slots,
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

