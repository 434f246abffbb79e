"""Token dispatcher: local (EP=1) and expert-parallel all-to-all, with a permute backend choice.

``RoutingDispatcher`` subclasses torchtitan's ``AllToAllTokenDispatcher``; without an EP mesh it
dispatches locally. With one, over ``all_to_all``, a token is sent to each EP rank once, however
many of that rank's experts it is routed to (not once per routed slot): the sender copies each
(token, destination rank) pair to one row, and with the rows sends the token's gating weights and
global expert ids. The receiver keeps the slots of its own experts and groups the received rows by
local expert as the local dispatch does, and in combine weights and sums each row's expert outputs
before sending one row back per pair; the sender adds the rows that come back for each token.
Counts go first, in one all-to-all read on the host (the split sizes); the rows, and the weights
and ids, follow in one autograd node (``exchange_rows``: the functional collective ops called
directly, the gradient sent back the same way, without the Python wrappers of
``_functional_collectives`` that the host would pay per call; selective activation checkpointing
still saves their outputs).

Slots are the routed (token, k) pairs in token-major order (``s = t * top_k + k``). Expert id
``num_experts`` marks a slot dropped by the router's capacity limit: it is not sent anywhere
and contributes nothing to the output.

Options (``Config``):
- ``permute_backend``: ``"torch"`` (gathers and an fp32 weighted sum), ``"triton"``
  (``torchtitan_ext.kernels.moe_permute``: one row-copy kernel each way, gather-only
  gradients) or ``"auto"`` (the default: ``"triton"`` for CUDA tokens, ``"torch"`` otherwise);
  used for every row copy and sum of the local and expert-parallel paths.
- ``ep_transport``: how rows move between EP ranks. ``"all_to_all"``: NCCL (or gloo) all-to-alls of
  one row per (token, destination rank), as above (any process group backend). ``"symm_mem"``: one pull kernel in
  dispatch and one push kernel in combine through memory every rank maps (``ep_symm_mem``:
  CUDA symmetric memory, or shared memory for CPU ranks on one host under ``TRITON_INTERPRET=1``).
- ``align_size``: pad each local expert's rows with zero rows to a multiple of it (block-aligned
  kernels). The padded buffer has a static size, the sum of the real rows plus
  ``E * (align_size - 1)`` rounded up to ``align_size``; the slack beyond the padded groups is
  counted in the last expert's group. Padding rows are zeros, are never read back into the
  output, and get no gradient.

After each dispatch, ``last_num_padding_rows`` (a 0-d int64 tensor on the tokens' device) holds
the zero rows the experts computed on top of the real routed rows.

No host sync on the local path; the EP path has one (split sizes / received row count).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import spmd_types as spmd
import torch
import torch.distributed as dist
from torchtitan.distributed.spmd_types import current_spmd_mesh, maybe_set_sparse_mesh
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from torchtitan_ext.experiments.moe_backends import ep_symm_mem
from torchtitan_ext.kernels import moe_permute

from .validated_config import ValidatedConfig, choice_errors

PermuteBackend = Literal["auto", "torch", "triton"]
PERMUTE_BACKENDS: tuple[str, ...] = get_args(PermuteBackend)
EPTransport = Literal["all_to_all", "symm_mem"]
EP_TRANSPORTS: tuple[str, ...] = get_args(EPTransport)

_ROW_OPS_NAMES = ("permute_tokens", "unpermute_tokens", "sum_token_rows")
_ROW_OPS = {
    "torch": {name: getattr(moe_permute, f"{name}_reference") for name in _ROW_OPS_NAMES},
    "triton": {name: getattr(moe_permute, name) for name in _ROW_OPS_NAMES},
}
"""Row copies and sums by permute backend: ``_ROW_OPS[backend][name]`` (``kernels.moe_permute``)."""


def padded_num_rows(num_real_rows: int, num_groups: int, align_size: int) -> int:
    """Static row count of the padded buffer for ``num_real_rows`` rows in ``num_groups`` groups."""
    if align_size == 1:
        return num_real_rows
    bound = num_real_rows + num_groups * (align_size - 1)
    return -(-bound // align_size) * align_size


def padded_groups(counts_G: torch.Tensor, num_rows: int, align_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Start row and row count of each group in a padded buffer of ``num_rows`` rows.

    Every group is rounded up to ``align_size`` rows; the rows left over at the end are added
    to the last group so that the counts sum to ``num_rows``. Returns ``(starts_G, counts_G)``.
    """
    padded_G = (counts_G + align_size - 1) // align_size * align_size
    starts_G = torch.cumsum(padded_G, 0) - padded_G
    padded_G[-1] += num_rows - padded_G.sum()
    return starts_G, padded_G


def padded_group_rows(
    counts_e: torch.Tensor, num_real_rows: int, align_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``num_real_rows`` rows grouped by expert (``counts_e`` per group) goes when
    every group is padded to a multiple of ``align_size`` (``padded_groups``).

    Returns ``(dest_row_N, padded_counts_e, num_rows)``: the padded buffer row of each row (real
    rows first in their group, in order), each group's padded size and the buffer's static row
    count. No host sync.
    """
    num_rows = padded_num_rows(num_real_rows, counts_e.shape[0], align_size)
    starts_e, padded_counts_e = padded_groups(counts_e, num_rows, align_size)
    real_starts_e = torch.cumsum(counts_e, 0) - counts_e
    group_N = torch.repeat_interleave(
        torch.arange(counts_e.shape[0], device=counts_e.device), counts_e, output_size=num_real_rows
    )
    dest_row_N = (starts_e - real_starts_e)[group_N] + torch.arange(num_real_rows, device=counts_e.device)
    return dest_row_N, padded_counts_e, num_rows


def pair_rows(rank_TK: torch.Tensor, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Send rows of the (token, destination rank) pairs, rank-major and in token order per rank.

    ``rank_TK`` is the rank of each slot's expert (``ep_size`` for a dropped slot: sent nowhere).
    Returns ``(pair_row_TW, sent_rows_W)``: the send row of pair (t, r), -1 when token t has no
    slot on rank r, and the rows sent to each rank. No host sync.
    """
    num_tokens = rank_TK.shape[0]
    reached_TW = rank_TK.new_zeros(num_tokens, ep_size + 1, dtype=torch.bool).scatter_(1, rank_TK, True)[:, :ep_size]
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
    """``(E,)`` rows of each expert's group in the buffer, padding included"""
    num_padding_rows: torch.Tensor
    """0-d int64: rows of the buffer that hold no slot"""


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
    num_padding_rows = num_rows - kept_counts_E.sum()

    # A kept slot's row is its place in the stable expert order (dropped slots, id num_experts,
    # sort last), moved down by the padding of the groups before its own.
    _, place_S, _ = moe_permute.routing_metadata(expert_of_slot_S, num_experts)
    if align_size == 1:
        rows_per_expert_E = kept_counts_E.clone()
        rows_per_expert_E[-1] += num_padding_rows
    else:
        group_starts_E, rows_per_expert_E = padded_groups(kept_counts_E, num_rows, align_size)
        padding_before_E = group_starts_E - (torch.cumsum(kept_counts_E, 0) - kept_counts_E)
        place_S = place_S + padding_before_E[expert_of_slot_S.clamp(max=num_experts - 1)]
    dest_row_S = torch.where(expert_of_slot_S < num_experts, place_S, -1)
    return SlotPlan(
        dest_row_S=dest_row_S,
        num_rows=num_rows,
        rows_per_expert_E=rows_per_expert_E,
        num_padding_rows=num_padding_rows,
    )


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_splits, receive_splits, group, *rows):
        ctx.send_splits, ctx.receive_splits, ctx.group = send_splits, receive_splits, group
        return tuple(all_to_all_rows(rows_UD, send_splits, receive_splits, group) for rows_UD in rows)

    @staticmethod
    def backward(ctx, *grads_received):
        grads_sent = tuple(
            all_to_all_rows(grad_UD, ctx.receive_splits, ctx.send_splits, ctx.group) if needed else None
            for grad_UD, needed in zip(grads_received, ctx.needs_input_grad[3:])
        )
        return None, None, None, *grads_sent


def all_to_all_rows(rows_UD, send_splits: list[int], receive_splits: list[int], group) -> torch.Tensor:
    """The functional collective op itself, without autograd: ordered on the current stream (the
    host does not wait), and selective activation checkpointing saves its output instead of
    re-sending."""
    received_UD = torch.ops._c10d_functional.all_to_all_single(
        rows_UD.contiguous(), receive_splits, send_splits, group.group_name
    )
    return torch.ops._c10d_functional.wait_tensor(received_UD)


def exchange_rows(
    rows: tuple[torch.Tensor, ...], send_splits: list[int], receive_splits: list[int], group
) -> tuple[torch.Tensor, ...]:
    """Differentiable all-to-all of each tensor of rows: ``send_splits[r]`` rows go to rank ``r`` (in
    rank order), ``receive_splits[r]`` arrive from it; gradients go back the same way.

    One collective op per tensor each way, one autograd node for all of them.
    """
    return _ExchangeRows.apply(send_splits, receive_splits, group, *rows)


@dataclass(frozen=True, kw_only=True)
class TokenExchange:
    """EP over ``all_to_all``: what combine needs on both sides of the exchange."""

    pair_row_S: torch.Tensor
    """``(T*W,)`` sender: send row of each (token, rank) pair, ``s = t * W + rank``; -1 when not sent"""
    received_plan: SlotPlan
    """receiver: where each received row's slots (``row * top_k + k``) went in the grouped buffer"""
    received_scores_S: torch.Tensor
    """``(U*K,)`` receiver: gating weight of each received slot (0 for slots of other ranks)"""
    input_splits: list[int]
    output_splits: list[int]


@dataclass(frozen=True, kw_only=True)
class RoutingDispatchMetadata:
    """What ``combine`` needs to undo ``dispatch``."""

    plan: SlotPlan | None
    """local slot plan (None under EP)"""
    scores_S: torch.Tensor
    """``(T*K,)`` gating weight of each slot"""
    token_exchange: TokenExchange | None = None
    """EP over ``all_to_all``"""
    received_dest_row_R: torch.Tensor | None = None
    """EP over ``symm_mem``: the expert-major (padded) row of each received row; None when in place"""
    exchange_route: ep_symm_mem.Route | None = None
    """EP over ``symm_mem``: where the received rows came from"""


class RoutingDispatcher(AllToAllTokenDispatcher):
    """Local and all-to-all token dispatch with permute backend choice and aligned groups."""

    @dataclass(kw_only=True, slots=True)
    class Config(ValidatedConfig, AllToAllTokenDispatcher.Config):
        permute_backend: PermuteBackend = "auto"
        """``"auto"``, ``"torch"`` or ``"triton"``: how rows are permuted and combined."""
        align_size: int = 1
        """Pad each expert's rows to a multiple of this (1: no padding)."""
        ep_transport: EPTransport = "all_to_all"
        """``"all_to_all"`` or ``"symm_mem"``: how rows move between EP ranks."""

        def validation_errors(self, key: Callable[[str], str] = str) -> list[str]:
            """Every invalid option, one message each; ``key(field)`` is how a message names a field."""
            errors = [
                *choice_errors(key, "permute_backend", self.permute_backend, PERMUTE_BACKENDS),
                *choice_errors(key, "ep_transport", self.ep_transport, EP_TRANSPORTS),
            ]
            if isinstance(self.align_size, bool) or not isinstance(self.align_size, int) or self.align_size < 1:
                errors.append(f"{key('align_size')} = {self.align_size!r}: must be an integer >= 1 (1 = off)")
            return errors

    def __init__(self, config: Config):
        super().__init__(config)
        self.permute_backend = config.permute_backend
        self.align_size = config.align_size
        self.ep_transport = config.ep_transport
        self.last_num_padding_rows: torch.Tensor | None = None

    def _row_ops(self, x: torch.Tensor) -> dict:
        """The row ops of the permute backend for rows on ``x``'s device (``"auto"``: the kernels on CUDA)."""
        if self.permute_backend != "auto":
            return _ROW_OPS[self.permute_backend]
        return _ROW_OPS["triton" if x.is_cuda else "torch"]

    def _permute_rows(self, x_TD, dest_row_S, top_k: int, num_rows: int, zero_padding: bool = True) -> torch.Tensor:
        return self._row_ops(x_TD)["permute_tokens"](x_TD, dest_row_S, top_k, num_rows, zero_padding)

    def _group_received_rows(self, received_UD, plan: SlotPlan, top_k: int) -> torch.Tensor:
        """The EP receiver's rows in local-expert order. Without padding (``align_size`` 1) every
        row of the exact-size buffer receives a slot, so it is not zero-filled first."""
        return self._permute_rows(received_UD, plan.dest_row_S, top_k, plan.num_rows, zero_padding=self.align_size > 1)

    def _unpermute_rows(self, rows_RD, dest_row_S, scores_S, top_k: int) -> torch.Tensor:
        return self._row_ops(rows_RD)["unpermute_tokens"](rows_RD, dest_row_S, scores_S, top_k)

    def _sum_token_rows(self, rows_RD, dest_row_S, top_k: int) -> torch.Tensor:
        return self._row_ops(rows_RD)["sum_token_rows"](rows_RD, dest_row_S, top_k)

    @property
    def single_device(self) -> bool:
        """True without expert parallelism: every expert is local and no rows leave the device."""
        return self.ep_mesh is None

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, RoutingDispatchMetadata]:
        """Return ``(rows_RD, rows_per_local_expert_e, metadata)``, rows grouped by local expert.

        ``num_local_tokens_per_expert_E`` counts the kept (not dropped) slots per expert; the
        grouping is built from it, so it must be exact.
        """
        if self.ep_mesh is None:
            plan = plan_slots(topk_expert_ids_TK, num_local_tokens_per_expert_E, self.align_size)
            rows_RD = self._permute_rows(x_TD, plan.dest_row_S, self.top_k, plan.num_rows)
            self.last_num_padding_rows = plan.num_padding_rows
            metadata = RoutingDispatchMetadata(plan=plan, scores_S=topk_scores_TK.reshape(-1))
            return rows_RD, plan.rows_per_expert_E, metadata
        return self._dispatch_expert_parallel(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)

    def combine(
        self,
        routed_output_RD: torch.Tensor,
        metadata: RoutingDispatchMetadata,
        x_TD: torch.Tensor,
    ) -> torch.Tensor:
        """Weight each slot's expert output by its score and sum over top_k -> ``(T, D)``."""
        rows_RD = routed_output_RD
        if metadata.received_dest_row_R is not None:  # EP: back to arrival order, padding dropped
            rows_RD = self._sum_token_rows(rows_RD, metadata.received_dest_row_R, 1)  # a gather
        if metadata.exchange_route is not None:
            return ep_symm_mem.combine(rows_RD, metadata.scores_S, metadata.exchange_route).to(x_TD.dtype)
        if metadata.token_exchange is not None:
            return self._combine_expert_parallel(rows_RD, metadata.token_exchange).to(x_TD.dtype)
        return self._unpermute_rows(rows_RD, metadata.plan.dest_row_S, metadata.scores_S, self.top_k).to(x_TD.dtype)

    # ------------------------------------------------------------------ expert parallel

    def _ep_group(self):
        """The EP process group, found as torchtitan's dispatcher finds it."""
        with maybe_set_sparse_mesh():
            mesh = current_spmd_mesh() if get_spmd_backend() == "spmd_types" else None
        if mesh is not None:
            return mesh.get_group("ep")
        assert self.ep_mesh is not None
        return self.ep_mesh.get_group()

    def _dispatch_expert_parallel(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        if get_spmd_backend() == "spmd_types" and spmd.is_type_checking():
            raise NotImplementedError("RoutingDispatcher does not support SPMD type checking")
        assert self.ep_mesh is not None
        if self.ep_transport == "symm_mem":
            return self._dispatch_over_exchange(x_TD, topk_scores_TK, topk_expert_ids_TK)
        return self._dispatch_over_all_to_all(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)

    def _dispatch_over_all_to_all(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """One row per (token, destination rank) out; received rows grouped by local expert."""
        ep_size = self.ep_mesh.size()
        num_local = self.num_experts // ep_size
        num_tokens, top_k = topk_expert_ids_TK.shape
        expert_TK = topk_expert_ids_TK.long()
        pair_row_TW, sent_rows_W = pair_rows(expert_TK // num_local, ep_size)
        pair_row_S = pair_row_TW.view(-1)
        # Every pair row carries the token's K gating weights and global expert ids in one fp32 row
        # (ids are exact in fp32), so that one all-to-all moves both; the receiver keeps the slots
        # of its own experts. The weights keep their autograd graph.
        token_meta_TM = torch.cat([topk_scores_TK.float(), expert_TK.float()], dim=1)
        # The send rows are copied before the host sync, into a buffer of the static bound (a token
        # goes to at most min(ep_size, top_k) ranks): the GPU copies while the host waits, and only
        # the all-to-alls and the receiver's grouping are launched after the sync.
        max_pairs = send_buffer_rows(num_tokens, ep_size, top_k)
        sent_rows_PD, sent_meta_PM = (
            self._permute_rows(rows, pair_row_S, ep_size, max_pairs, zero_padding=False)
            for rows in (x_TD, token_meta_TM)
        )

        kept_per_expert_We = num_local_tokens_per_expert_E.long().view(ep_size, num_local)
        send_counts_Wc = torch.cat([kept_per_expert_We, sent_rows_W.unsqueeze(1)], dim=1)
        group = self._ep_group()
        received_counts_Wc = all_to_all_rows(send_counts_Wc, [1] * ep_size, [1] * ep_size, group)
        send_counts, received_counts = torch.stack([send_counts_Wc, received_counts_Wc]).tolist()
        input_splits = [row[-1] for row in send_counts]
        output_splits = [row[-1] for row in received_counts]
        num_received_slots = sum(sum(row[:-1]) for row in received_counts)
        num_sent = sum(input_splits)
        received_UD, received_meta_UM = exchange_rows(
            (sent_rows_PD[:num_sent], sent_meta_PM[:num_sent]), input_splits, output_splits, group
        )
        received_scores_UK = received_meta_UM[:, :top_k]
        received_ids_UK = received_meta_UM[:, top_k:].detach().long()
        rank = dist.get_rank(group)
        received_experts_UK = torch.where(
            received_ids_UK // num_local == rank, received_ids_UK - rank * num_local, num_local
        )
        received_plan = plan_slots(
            received_experts_UK, received_counts_Wc[:, :-1].sum(dim=0), self.align_size, num_kept=num_received_slots
        )
        grouped_RD = self._group_received_rows(received_UD, received_plan, top_k)
        self.last_num_padding_rows = received_plan.num_padding_rows
        metadata = RoutingDispatchMetadata(
            plan=None,
            scores_S=topk_scores_TK.reshape(-1),
            token_exchange=TokenExchange(
                pair_row_S=pair_row_S,
                received_plan=received_plan,
                received_scores_S=received_scores_UK.reshape(-1),
                input_splits=input_splits,
                output_splits=output_splits,
            ),
        )
        return grouped_RD, received_plan.rows_per_expert_E, metadata

    def _dispatch_over_exchange(self, x_TD, topk_scores_TK, topk_expert_ids_TK):
        """EP dispatch through ``ep_symm_mem``: rows arrive expert-major, no regroup."""
        group = self._ep_group()
        received_RD, rows_per_local_expert_e, route = ep_symm_mem.dispatch(
            x_TD,
            topk_scores_TK.reshape(-1),
            topk_expert_ids_TK.reshape(-1),
            group,
            self.num_experts,
            self.top_k,
        )
        grouped_RD, rows_per_local_expert_e, received_dest_row_R = self._pad_received_groups(
            received_RD, rows_per_local_expert_e
        )
        metadata = RoutingDispatchMetadata(
            plan=None,
            scores_S=topk_scores_TK.reshape(-1),
            received_dest_row_R=received_dest_row_R,
            exchange_route=route,
        )
        return grouped_RD, rows_per_local_expert_e, metadata

    def _pad_received_groups(self, received_RD, rows_per_local_expert_e):
        """Expert-major received rows -> ``align_size``-padded groups; sets ``last_num_padding_rows``.

        Returns ``(rows, rows_per_local_expert_e, received_dest_row_R)``; the last is the padded
        row of each received row, None without padding (the rows stay in place).
        """
        if self.align_size == 1:
            self.last_num_padding_rows = rows_per_local_expert_e.new_zeros((), dtype=torch.int64)
            return received_RD, rows_per_local_expert_e, None
        num_received = received_RD.shape[0]
        dest_row_R, padded_counts_e, num_rows = padded_group_rows(
            rows_per_local_expert_e, num_received, self.align_size
        )
        grouped_RD = self._permute_rows(received_RD, dest_row_R, 1, num_rows)
        self.last_num_padding_rows = padded_counts_e.new_full((), num_rows - num_received, dtype=torch.int64)
        return grouped_RD, padded_counts_e, dest_row_R

    def _combine_expert_parallel(self, routed_output_RD: torch.Tensor, exchange: TokenExchange) -> torch.Tensor:
        """Weighted sum per received row, one row back per (token, rank) pair, sum over ranks."""
        received_plan = exchange.received_plan
        partial_UD = self._unpermute_rows(
            routed_output_RD, received_plan.dest_row_S, exchange.received_scores_S, self.top_k
        )
        group = self._ep_group()
        (returned_UD,) = exchange_rows((partial_UD,), exchange.output_splits, exchange.input_splits, group)
        ep_size = len(exchange.input_splits)
        return self._sum_token_rows(returned_UD, exchange.pair_row_S, ep_size)
