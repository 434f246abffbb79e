"""Fused Triton MoE expert compute: public entry points and plain-torch references.

Weight layouts are torchtitan's: w1_EFD [E, F, D], w2_EDF [E, D, F], w3_EFD [E, F, D];
each expert computes ``(silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T``.

Dtypes: compute runs in x's dtype with fp32 accumulation; weights of another dtype are
cast to x's dtype for the compute, and their gradients come back in their own dtype.
The output has x's dtype. All entry points are differentiable w.r.t. x, the weights and
(routed) the router scores, and give the same result from run to run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_ext.kernels.availability import triton_available_reason
from torchtitan_ext.kernels.moe_permute import grouped_metadata, routing_metadata
from torchtitan_ext.kernels.swiglu_experts import swiglu_experts

__all__ = [
    "fused_moe_grouped",
    "fused_moe_routed",
    "fused_moe_row_weighted",
    "reference_grouped",
    "reference_routed",
    "reference_row_weighted",
    "triton_available_reason",
]


def fused_moe_grouped(
    x_RD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
    recompute_preactivations: bool = False,
) -> torch.Tensor:
    """SwiGLU experts on rows already grouped by expert (torchtitan's GroupedExperts contract).

    Args:
        x_RD: [R, D]; expert e owns the next num_tokens_per_expert_E[e] rows, in expert order.
        num_tokens_per_expert_E: [E] integer counts with sum <= R. Rows past the sum belong to
            no expert: they change no weight gradient, and their output and input-gradient rows
            are unset (not written; ``ExpertCompute``'s contract).
        recompute_preactivations: keep no gate/up pre-activations ([R, F] each) for backward,
            which computes them again (one more gate/up GEMM).

    Returns:
        out_RD: [R, D] in x's dtype.
    """
    metadata = grouped_metadata(num_tokens_per_expert_E)
    return swiglu_experts(x_RD, w1_EFD, w2_EDF, w3_EFD, metadata, recompute_preactivations=recompute_preactivations)


def fused_moe_row_weighted(
    x_RD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
    row_scores_R: torch.Tensor,
    recompute_preactivations: bool = False,
) -> torch.Tensor:
    """:func:`fused_moe_grouped` with each output row multiplied by ``row_scores_R[r]`` ([R], any float
    dtype, differentiable) in the down projection's epilogue (fp32). The scores' gradient comes from
    the backward's own reads (the pre-activations), not from a kept output."""
    metadata = grouped_metadata(num_tokens_per_expert_E)
    return swiglu_experts(
        x_RD,
        w1_EFD,
        w2_EDF,
        w3_EFD,
        metadata,
        scores_S=row_scores_R,
        recompute_preactivations=recompute_preactivations,
    )


def fused_moe_routed(
    x_TD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    topk_expert_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_k topk_scores[t, k] * SwiGLU_{topk_expert_ids[t, k]}(x[t]).

    Tokens are copied into expert order once (each token row read once, written to its k
    rows) and the weighted expert outputs are written per (token, k) slot, then summed over k.

    Args:
        x_TD: [T, D] tokens.
        topk_expert_ids_TK: [T, K] integer ids in [0, E).
        topk_scores_TK: [T, K] router weights (any float dtype; its gradient keeps that dtype).

    Returns:
        out_TD: [T, D] in x's dtype.
    """
    top_k = topk_expert_ids_TK.shape[1]
    row_slot_S, slot_row_S, group_end_E = routing_metadata(topk_expert_ids_TK, w1_EFD.shape[0])
    out_TD = swiglu_experts(
        x_TD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, topk_scores_TK.reshape(-1), top_k, slot_row_S
    )
    return out_TD


def _swiglu_expert(x_ND, w1_FD, w2_DF, w3_FD):
    """One expert's SwiGLU block on its rows: ``(silu(x @ w1.T) * (x @ w3.T)) @ w2.T``, [N, D] -> [N, D]."""
    return (F.silu(x_ND @ w1_FD.T) * (x_ND @ w3_FD.T)) @ w2_DF.T


def reference_grouped(x_RD, w1_EFD, w2_EDF, w3_EFD, num_tokens_per_expert_E) -> torch.Tensor:
    """The plain-torch reference of the expert block: one matmul chain per expert.

    Same contract as :func:`fused_moe_grouped`. Every compute backend is tested against it,
    and it is the ``for_loop`` backend (the fallback on any device). Reads the token counts on
    the host (one sync: one copy, as ``tolist()`` of a device tensor under compile reads each element
    with a sync of its own).
    """
    w1, w2, w3 = (w.to(x_RD.dtype) for w in (w1_EFD, w2_EDF, w3_EFD))
    counts = num_tokens_per_expert_E.cpu().tolist()
    for count in counts:
        torch._check(count >= 0)  # under compile the counts are unbacked sizes: tell the compiler their range
    rows_after_experts = x_RD.shape[0] - sum(counts)
    torch._check(rows_after_experts >= 0)
    # split, not slices: its backward is one cat, where slices' scatters make Inductor decide signs
    # of expressions in the unbacked sizes (EP's received rows), which it cannot
    *expert_rows, rest_RD = torch.split(x_RD, [*counts, rows_after_experts])
    outputs = [_swiglu_expert(rows, w1[e], w2[e], w3[e]) for e, rows in enumerate(expert_rows)]
    return torch.cat([*outputs, torch.zeros_like(rest_RD)])


def reference_row_weighted(x_RD, w1_EFD, w2_EDF, w3_EFD, num_tokens_per_expert_E, row_scores_R) -> torch.Tensor:
    """The plain-torch reference of :func:`fused_moe_row_weighted`: the expert block, then each row
    times its score in fp32."""
    out_RD = reference_grouped(x_RD, w1_EFD, w2_EDF, w3_EFD, num_tokens_per_expert_E)
    return (out_RD.float() * row_scores_R.float()[:, None]).to(x_RD.dtype)


def reference_routed(x_TD, w1_EFD, w2_EDF, w3_EFD, topk_expert_ids_TK, topk_scores_TK) -> torch.Tensor:
    """Per-expert loop version of :func:`fused_moe_routed` (same dtype contract), on the same
    per-expert block as :func:`reference_grouped`."""
    w1, w2, w3 = (w.to(x_TD.dtype) for w in (w1_EFD, w2_EDF, w3_EFD))
    out_TD = torch.zeros_like(x_TD)
    for expert in range(w1.shape[0]):
        token_idx, k_idx = torch.nonzero(topk_expert_ids_TK == expert, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        y_ND = _swiglu_expert(x_TD[token_idx], w1[expert], w2[expert], w3[expert])
        weights_N = topk_scores_TK[token_idx, k_idx].to(x_TD.dtype)
        out_TD = out_TD.index_add(0, token_idx, y_ND * weights_N[:, None])
    return out_TD
