"""Routing metadata: the expert-grouped order of routed rows, computed on the device.

A routed row is one (token, k) pair; its slot is ``t * top_k + k`` (token-major order).
The fused kernels read token rows through ``row_slot_N // top_k`` and write each
routed row back to its slot, so no permuted copy of the activations is made.
"""

from __future__ import annotations

import torch


def routing_metadata(
    topk_expert_ids_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group routed rows by expert without a host sync.

    Args:
        topk_expert_ids_TK: [T, K] integer expert ids in [0, num_experts).

    Returns:
        row_slot_N: [N = T*K] int32; grouped row r holds the routed row of slot row_slot_N[r].
            Rows are ordered by expert, and by slot within an expert (stable).
        group_end_E: [E] int32; exclusive end row of each expert's segment (inclusive
            cumsum of the per-expert counts).
    """
    expert_of_slot_N = topk_expert_ids_TK.reshape(-1)
    row_slot_N = torch.argsort(expert_of_slot_N, stable=True)
    sorted_experts_N = expert_of_slot_N[row_slot_N]
    expert_ids_E = torch.arange(num_experts, device=sorted_experts_N.device, dtype=sorted_experts_N.dtype)
    group_end_E = torch.searchsorted(sorted_experts_N, expert_ids_E, right=True)
    return row_slot_N.to(torch.int32), group_end_E.to(torch.int32)


def grouped_metadata(num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """[E] int32 exclusive end row of each expert's contiguous segment."""
    return torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)


def reference_routing_metadata(
    topk_expert_ids_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert loop version of :func:`routing_metadata`, for tests."""
    expert_of_slot_N = topk_expert_ids_TK.reshape(-1).tolist()
    row_slot, group_end = [], []
    for expert in range(num_experts):
        row_slot += [slot for slot, e in enumerate(expert_of_slot_N) if e == expert]
        group_end.append(len(row_slot))
    return torch.tensor(row_slot, dtype=torch.int32), torch.tensor(group_end, dtype=torch.int32)
