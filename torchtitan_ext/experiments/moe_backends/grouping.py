"""Where routed rows go: slot plans grouped by expert with ``align_size`` padding, the EP sender's
(token, destination rank) pair rows, and the row copies and sums of each permute backend.

Slots are the routed (token, k) pairs in token-major order (``s = t * top_k + k``). Expert id
``num_experts`` marks a slot dropped by the router's capacity limit: it gets no row and
contributes nothing to the output.

Padding (``align_size``): each expert's group of rows is padded with zero rows to a multiple of
it (block-aligned kernels). Padding rows are zeros, are never read back into the output, and get
no gradient. The buffer has a static size, the slots plus ``E * (align_size - 1)`` rounded up to
``align_size``; the rows after the groups (that bound's slack, the rows of dropped slots) belong
to no expert: no expert computes them, and they and their gradients are left unwritten (the
contract of ``experts.ExpertCompute``), so with ``align_size`` 1 no buffer is zero-filled.

Nothing here syncs with the host.
"""

from dataclasses import dataclass

import torch

from torchtitan_ext.kernels import moe_permute

ROW_OP_NAMES = ("permute_tokens", "unpermute_tokens", "sum_token_rows")
ROW_OPS = {
    "torch": {name: getattr(moe_permute, f"{name}_reference") for name in ROW_OP_NAMES},
    "triton": {name: getattr(moe_permute, name) for name in ROW_OP_NAMES},
}
"""Row copies and sums by permute backend: ``ROW_OPS[backend][name]`` (``kernels.moe_permute``)."""


@dataclass(frozen=True)
class RowOps:
    """The row copies and sums of one permute backend: ``"torch"`` (gathers and an fp32 weighted
    sum), ``"triton"`` (one row-copy kernel each way, gather-only gradients) or ``"auto"`` (the
    kernels for CUDA rows, torch otherwise). Each method is the ``kernels.moe_permute`` op of its
    name."""

    permute_backend: str

    def ops_for(self, rows: torch.Tensor) -> dict:
        """The ops of the backend that handles ``rows`` (``ROW_OPS``)."""
        if self.permute_backend != "auto":
            return ROW_OPS[self.permute_backend]
        return ROW_OPS["triton" if rows.is_cuda else "torch"]

    def permute_rows(
        self, x_TD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int, num_rows: int, zero_padding: bool = True
    ) -> torch.Tensor:
        """``(num_rows, D)``: row ``dest_row_S[s]`` holds token ``s // top_k``; other rows zero (or unset)."""
        return self.ops_for(x_TD)["permute_tokens"](x_TD, dest_row_S, top_k, num_rows, zero_padding)

    def unpermute_rows(
        self,
        rows_RD: torch.Tensor,
        dest_row_S: torch.Tensor,
        scores_S: torch.Tensor,
        top_k: int,
        zero_padding: bool = True,
    ) -> torch.Tensor:
        """``(T, D)``: each token's rows weighted by its slots' scores and summed (fp32 accumulation); the
        gradient of rows no slot maps to is zero (or, without ``zero_padding``, may be unset)."""
        return self.ops_for(rows_RD)["unpermute_tokens"](rows_RD, dest_row_S, scores_S, top_k, zero_padding)

    def sum_token_rows(self, rows_RD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int) -> torch.Tensor:
        """``(T, D)``: each token's rows summed; with ``top_k`` 1 and no repeated index, a gather."""
        return self.ops_for(rows_RD)["sum_token_rows"](rows_RD, dest_row_S, top_k)


def row_scores_of_slots(dest_row_S: torch.Tensor, scores_S: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(num_rows,)`` fp32: row ``dest_row_S[s]`` gets slot ``s``'s score (``scores_S``, any shape of
    ``S`` elements); rows no slot names (padding, rows past the received ones) get 0. Each row is named
    by at most one slot. Differentiable in ``scores_S``."""
    here_S = dest_row_S >= 0
    index_S = torch.where(here_S, dest_row_S.long(), num_rows)
    values_S = torch.where(here_S, scores_S.reshape(-1).float(), 0.0)
    return values_S.new_zeros(num_rows + 1).scatter(0, index_S, values_S)[:num_rows]


def padded_num_rows(num_real_rows: int, num_groups: int, align_size: int) -> int:
    """Static row count of the padded buffer for ``num_real_rows`` rows in ``num_groups`` groups."""
    if align_size == 1:
        return num_real_rows
    bound = num_real_rows + num_groups * (align_size - 1)
    return -(-bound // align_size) * align_size


def padded_groups(counts_G: torch.Tensor, align_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Start row and row count of each group, every group rounded up to ``align_size`` rows (in a
    buffer of ``padded_num_rows`` rows, the rows after the groups belong to none). Returns
    ``(starts_G, counts_G)``."""
    padded_G = (counts_G + align_size - 1) // align_size * align_size
    starts_G = torch.cumsum(padded_G, 0) - padded_G
    return starts_G, padded_G


def padded_group_rows(
    counts_e: torch.Tensor, num_real_rows: int, align_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``num_real_rows`` rows grouped by expert (``counts_e`` per group) goes when
    every group is padded to a multiple of ``align_size`` (``padded_groups``).

    Returns ``(dest_row_N, padded_counts_e, num_rows)``: the padded buffer row of each row (real
    rows first in their group, in order), each group's padded size and the buffer's static row
    count.
    """
    num_rows = padded_num_rows(num_real_rows, counts_e.shape[0], align_size)
    starts_e, padded_counts_e = padded_groups(counts_e, align_size)
    real_starts_e = torch.cumsum(counts_e, 0) - counts_e
    group_N = torch.repeat_interleave(
        torch.arange(counts_e.shape[0], device=counts_e.device), counts_e, output_size=num_real_rows
    )
    dest_row_N = (starts_e - real_starts_e)[group_N] + torch.arange(num_real_rows, device=counts_e.device)
    return dest_row_N, padded_counts_e, num_rows


def reached_ranks(rank_TK: torch.Tensor, ep_size: int) -> torch.Tensor:
    """``(T, W)`` bool: whether token t has a slot on rank r. ``rank_TK`` is the rank of each slot's
    expert (``ep_size`` for a dropped slot: sent nowhere)."""
    num_tokens = rank_TK.shape[0]
    return rank_TK.new_zeros(num_tokens, ep_size + 1, dtype=torch.bool).scatter_(1, rank_TK, True)[:, :ep_size]


def pair_rows(rank_TK: torch.Tensor, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Send rows of the (token, destination rank) pairs, rank-major and in token order per rank.

    ``rank_TK`` as ``reached_ranks``. Returns ``(pair_row_TW, sent_rows_W)``: the send row of pair
    (t, r), -1 when token t has no slot on rank r, and the rows sent to each rank.
    """
    num_tokens = rank_TK.shape[0]
    reached_TW = reached_ranks(rank_TK, ep_size)
    place_TW = reached_TW.cumsum(dim=0)
    sent_rows_W = place_TW[-1] if num_tokens else place_TW.new_zeros(ep_size)
    first_row_W = sent_rows_W.cumsum(dim=0) - sent_rows_W
    return torch.where(reached_TW, place_TW + (first_row_W - 1), -1), sent_rows_W


def send_buffer_rows(num_tokens: int, ep_size: int, top_k: int) -> int:
    """Rows of the EP sender's buffer: the most (token, destination rank) pairs there can be."""
    return num_tokens * min(ep_size, top_k)


@dataclass(frozen=True, kw_only=True)
class SlotPlan:
    """Where every slot's row lives in the expert-grouped buffer."""

    dest_row_S: torch.Tensor
    """``(T*K,)`` integer destination row of each slot, -1 when dropped"""
    num_rows: int
    """rows of the grouped buffer (static)"""
    rows_per_expert_E: torch.Tensor
    """``(E,)`` rows of each expert's group in the buffer, padding included (their sum may be less
    than ``num_rows``: the rows after the groups belong to no expert)"""
    num_padding_rows: torch.Tensor
    """0-d int64: the groups' padding rows (zeros the experts compute)"""


def plan_slots(
    topk_expert_ids_TK: torch.Tensor, kept_counts_E: torch.Tensor, align_size: int, num_kept: int | None = None
) -> SlotPlan:
    """Group slots by expert (stable: token order within an expert), dropped slots excluded.

    ``kept_counts_E`` (``(E,)`` integer) counts the kept slots of each expert; a dropped slot
    has expert id ``E``. The buffer is sized for every slot, or for ``num_kept`` rows when the
    caller knows how many slots are kept (it must be exact).
    """
    expert_of_slot_S = topk_expert_ids_TK.reshape(-1).long()
    num_slots = expert_of_slot_S.shape[0]
    num_experts = kept_counts_E.shape[0]
    kept_counts_E = kept_counts_E.long()
    num_rows = padded_num_rows(num_slots if num_kept is None else num_kept, num_experts, align_size)

    # A kept slot's row is its place in the stable expert order (dropped slots, id num_experts,
    # sort last), moved down by the padding of the groups before its own.
    _, place_S, _ = moe_permute.routing_metadata(expert_of_slot_S, num_experts)
    if align_size == 1:
        rows_per_expert_E = kept_counts_E
    else:
        group_starts_E, rows_per_expert_E = padded_groups(kept_counts_E, align_size)
        padding_before_E = group_starts_E - (torch.cumsum(kept_counts_E, 0) - kept_counts_E)
        place_S = place_S + padding_before_E[expert_of_slot_S.clamp(max=num_experts - 1)]
    dest_row_S = torch.where(expert_of_slot_S < num_experts, place_S, -1)
    return SlotPlan(
        dest_row_S=dest_row_S,
        num_rows=num_rows,
        rows_per_expert_E=rows_per_expert_E,
        num_padding_rows=(rows_per_expert_E - kept_counts_E).sum(),
    )
