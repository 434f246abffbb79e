"""Token transports: how the routed rows reach their experts and come back, one class each.

Every transport has the same two calls (``TokenTransport``), which ``RoutingDispatcher``
delegates to:

- ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)`` ->
  ``(rows_RD, rows_per_local_expert_e, metadata)``: the rows of this rank's experts, grouped by
  local expert, each group padded with zero rows to a multiple of ``align_size`` (``grouping``);
  ``metadata`` is the transport's own record of what combine needs, and says how many padding
  rows the experts compute (``num_padding_rows``);
- ``combine(routed_output_RD, metadata)`` -> ``(T, D)``: each token's expert outputs weighted
  by its router scores and summed over top_k.

The expert-parallel transports except the padded ``symm_mem`` one (``supports_row_scores``) also let
the experts apply the scores: ``row_scores(metadata, num_rows)`` gives each dispatched row its
score (differentiable: the gradient goes back to the router's scores) and ``sum_rows(routed_output_RD,
metadata)`` is the unweighted combine, which keeps no expert output for the scores' gradient.

The transports:

- ``LocalTransport``: no expert parallelism; every expert is local and no row leaves the device.
  No host sync.
- ``AllToAllTransport``: all-to-alls (NCCL or gloo) between the EP ranks. A token is sent to each
  EP rank once, however many of that rank's experts it is routed to (not once per routed slot):
  the sender copies each (token, destination rank) pair to one row, and with the rows sends the
  token's gating weights and global expert ids. The receiver keeps the slots of its own experts
  and groups the received rows by local expert as the local dispatch does, and in combine weights
  and sums each row's expert outputs before sending one row back per pair; the sender adds the
  rows that come back for each token. Counts go first, in one all-to-all read on the host (the
  split sizes: the one host sync); the rows, and the weights and ids, follow in one autograd node
  (``exchange_rows``: the functional collective ops called directly, the gradient sent back the
  same way, without the Python wrappers of ``_functional_collectives`` that the host would pay
  per call; selective activation checkpointing still saves their outputs).
- ``StaticAllToAllTransport`` (``ep_receive_rows = "static"``): the same all-to-alls with nothing read
  on the host: every rank sends every rank ``T`` rows (a token's row where it has a slot), the
  receiver groups its slots on the device into the most rows it can receive.
- ``SymmMemTransport`` (``PaddedSymmMemTransport`` when ``align_size`` > 1): one pull kernel in
  dispatch and one push kernel in combine through memory every EP rank maps (``ep_symm_mem``);
  rows arrive grouped by local expert. One host sync per dispatch.

Each method the benchmarks time on its own (``python -m torchtitan_ext.bench ep``) is a public
step of its transport, the same call its dispatch or combine makes.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed.spmd_types import current_spmd_mesh, maybe_set_sparse_mesh
from torchtitan.distributed.utils import get_spmd_backend

from torchtitan_ext.experiments.moe_backends import ep_symm_mem
from torchtitan_ext.experiments.moe_backends.grouping import (
    RowOps,
    SlotPlan,
    padded_group_rows,
    pair_rows,
    plan_slots,
    reached_ranks,
    row_scores_of_slots,
    send_buffer_rows,
)
from torchtitan_ext.kernels import moe_permute


class DispatchMetadata(Protocol):
    """What every transport's dispatch metadata tells the dispatcher."""

    @property
    def num_padding_rows(self) -> torch.Tensor:
        """0-d int64 on the tokens' device: zero rows the experts compute on top of the routed rows."""
        ...


MetadataT = TypeVar("MetadataT", bound=DispatchMetadata)


class TokenTransport(ABC, Generic[MetadataT]):
    """Moves routed rows to their experts and back; ``num_experts`` and ``top_k`` as the router's."""

    supports_row_scores: ClassVar[bool] = False
    """Whether ``row_scores`` and ``sum_rows`` are implemented (the experts may weight their rows)."""

    def __init__(self, row_ops: RowOps, align_size: int, num_experts: int, top_k: int):
        self.row_ops = row_ops
        self.align_size = align_size
        self.num_experts = num_experts
        self.top_k = top_k

    @property
    def has_padding_rows(self) -> bool:
        """Whether the experts' groups hold rows of no slot (``align_size`` padding), which are zeros and
        get zero gradients; without them, every row no slot maps to lies after the groups and is left
        unwritten, as is its gradient."""
        return self.align_size > 1

    @abstractmethod
    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, MetadataT]:
        """``(rows_RD, rows_per_local_expert_e, metadata)``: rows grouped by local expert, padded groups.

        ``num_local_tokens_per_expert_E`` counts this rank's kept (not dropped) slots per expert
        (every expert, not only the local ones); it must be exact.
        """

    @abstractmethod
    def combine(self, routed_output_RD: torch.Tensor, metadata: MetadataT) -> torch.Tensor:
        """``(T, D)``: each token's expert outputs weighted by its scores and summed over top_k."""

    def row_scores(self, metadata: MetadataT, num_rows: int) -> torch.Tensor:
        """``(num_rows,)`` fp32: the router score of each of dispatch's rows (0 for rows of no slot),
        differentiable in the scores given to dispatch. Only where ``supports_row_scores``."""
        raise NotImplementedError(f"{type(self).__name__} does not give its rows' scores")

    def sum_rows(self, weighted_output_RD: torch.Tensor, metadata: MetadataT) -> torch.Tensor:
        """``(T, D)``: each token's rows, already weighted by ``row_scores``, summed over top_k.
        Only where ``supports_row_scores``."""
        raise NotImplementedError(f"{type(self).__name__} does not sum weighted rows")


@dataclass(frozen=True, kw_only=True)
class LocalMetadata:
    """``LocalTransport``: the slot plan and the gating weights."""

    plan: SlotPlan
    scores_S: torch.Tensor
    """``(T*K,)`` gating weight of each slot"""

    @property
    def num_padding_rows(self) -> torch.Tensor:
        return self.plan.num_padding_rows


class LocalTransport(TokenTransport[LocalMetadata]):
    """No expert parallelism: the slots grouped by expert on this device; no host sync."""

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        plan = plan_slots(topk_expert_ids_TK, num_local_tokens_per_expert_E, self.align_size)
        rows_RD = self.row_ops.permute_rows(
            x_TD, plan.dest_row_S, self.top_k, plan.num_rows, zero_padding=self.has_padding_rows
        )
        return rows_RD, plan.rows_per_expert_E, LocalMetadata(plan=plan, scores_S=topk_scores_TK.reshape(-1))

    def combine(self, routed_output_RD, metadata):
        return self.row_ops.unpermute_rows(
            routed_output_RD,
            metadata.plan.dest_row_S,
            metadata.scores_S,
            self.top_k,
            zero_padding=self.has_padding_rows,
        )


class ExpertParallelTransport(TokenTransport[MetadataT]):
    """A transport between the ranks of ``ep_mesh``, each owning ``num_experts / ep_size``
    consecutive experts."""

    def __init__(self, row_ops: RowOps, align_size: int, num_experts: int, top_k: int, ep_mesh: DeviceMesh):
        super().__init__(row_ops, align_size, num_experts, top_k)
        self.ep_mesh = ep_mesh
        self.ep_size = ep_mesh.size()
        self.num_local_experts = num_experts // self.ep_size

    def group(self) -> dist.ProcessGroup:
        """The EP process group, found as torchtitan's dispatcher finds it."""
        with maybe_set_sparse_mesh():
            mesh = current_spmd_mesh() if get_spmd_backend() == "spmd_types" else None
        if mesh is not None:
            return mesh.get_group("ep")
        return self.ep_mesh.get_group()


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
    re-sending. Under compile, the traceable ``_functional_collectives`` call."""
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single(rows_UD.contiguous(), receive_splits, send_splits, group)
    received_UD = torch.ops._c10d_functional.all_to_all_single(
        rows_UD.contiguous(), receive_splits, send_splits, group.group_name
    )
    return torch.ops._c10d_functional.wait_tensor(received_UD)


def exchange_rows(
    rows: tuple[torch.Tensor, ...], send_splits: list[int], receive_splits: list[int], group
) -> tuple[torch.Tensor, ...]:
    """Differentiable all-to-all of each tensor of rows: ``send_splits[r]`` rows go to rank ``r`` (in
    rank order), ``receive_splits[r]`` arrive from it; gradients go back the same way.

    Eager: one collective op per tensor each way, one autograd node for all of them. Under compile:
    ``_functional_collectives``' differentiable all-to-all per tensor, which Dynamo traces with the
    split sizes as unbacked integers.
    """
    if torch.compiler.is_compiling():
        return tuple(
            funcol.all_to_all_single_autograd(rows_UD.contiguous(), receive_splits, send_splits, group)
            for rows_UD in rows
        )
    return _ExchangeRows.apply(send_splits, receive_splits, group, *rows)


@dataclass(frozen=True, kw_only=True)
class AllToAllMetadata:
    """``AllToAllTransport``: what combine needs on both sides of the exchange."""

    pair_row_S: torch.Tensor
    """``(T*W,)`` sender: send row of each (token, rank) pair, ``s = t * W + rank``; -1 when not sent"""
    received_plan: SlotPlan
    """receiver: where each received row's slots (``row * top_k + k``) went in the grouped buffer"""
    received_scores_S: torch.Tensor
    """``(U*K,)`` receiver: gating weight of each received slot (0 for slots of other ranks)"""
    input_splits: list[int]
    """rows sent to each rank"""
    output_splits: list[int]
    """rows received from each rank"""

    @property
    def num_padding_rows(self) -> torch.Tensor:
        return self.received_plan.num_padding_rows


class AllToAllTransport(ExpertParallelTransport[AllToAllMetadata]):
    """EP over all-to-alls of one row per (token, destination rank); any process group backend."""

    supports_row_scores = True

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """One row per (token, destination rank) out; received rows grouped by local expert."""
        ep_size, num_local = self.ep_size, self.num_local_experts
        top_k = topk_expert_ids_TK.shape[1]
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
        sent_rows_PD, sent_meta_PM = (self.send_rows(rows, pair_row_S) for rows in (x_TD, token_meta_TM))

        kept_per_expert_We = num_local_tokens_per_expert_E.long().view(ep_size, num_local)
        send_counts_Wc = torch.cat([kept_per_expert_We, sent_rows_W.unsqueeze(1)], dim=1)
        group = self.group()
        received_counts_Wc, input_splits, output_splits, num_received_slots = self.exchange_counts(
            send_counts_Wc, group
        )
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
        metadata = AllToAllMetadata(
            pair_row_S=pair_row_S,
            received_plan=received_plan,
            received_scores_S=received_scores_UK.reshape(-1),
            input_splits=input_splits,
            output_splits=output_splits,
        )
        return self.group_received_rows(received_UD, received_plan), received_plan.rows_per_expert_E, metadata

    def combine(self, routed_output_RD, metadata):
        """Weighted sum per received row, one row back per (token, rank) pair, sum over ranks."""
        return self.send_back(self.weight_received_rows(routed_output_RD, metadata), metadata)

    def row_scores(self, metadata, num_rows):
        """The received slots' scores (they came with the rows, differentiable) at their rows."""
        return row_scores_of_slots(metadata.received_plan.dest_row_S, metadata.received_scores_S, num_rows)

    def sum_rows(self, weighted_output_RD, metadata):
        """Unweighted sum per received row, one row back per (token, rank) pair, sum over ranks."""
        partial_UD = self.row_ops.sum_token_rows(weighted_output_RD, metadata.received_plan.dest_row_S, self.top_k)
        return self.send_back(partial_UD, metadata)

    def send_back(self, partial_UD: torch.Tensor, metadata: AllToAllMetadata) -> torch.Tensor:
        """``(T, D)``: each received row's partial sum sent back to its sender, which sums over ranks."""
        (returned_UD,) = exchange_rows((partial_UD,), metadata.output_splits, metadata.input_splits, self.group())
        return self.sum_returned_rows(returned_UD, metadata)

    def send_rows(self, rows_TM: torch.Tensor, pair_row_S: torch.Tensor) -> torch.Tensor:
        """The sender's buffer: row ``pair_row_S[t * W + r]`` holds ``rows_TM[t]``, rank-major; the buffer
        has the static bound of pairs (``send_buffer_rows``), its rows past the sent ones unset."""
        max_pairs = send_buffer_rows(rows_TM.shape[0], self.ep_size, self.top_k)
        return self.row_ops.permute_rows(rows_TM, pair_row_S, self.ep_size, max_pairs, zero_padding=False)

    def exchange_counts(
        self, send_counts_Wc: torch.Tensor, group: dist.ProcessGroup
    ) -> tuple[torch.Tensor, list[int], list[int], int]:
        """All-to-all of one row of counts per rank (``(W, local experts + 1)``: the rows kept for each local
        expert of the receiver, then the rows sent), then what the host needs in one copy (the host sync).

        Returns ``(received_counts_Wc, input_splits, output_splits, num_received_slots)``: the received
        rows; the rows sent to and received from each rank; the slots received for this rank's experts.
        One copy, not ``tolist()`` on the device tensors: under compile that reads every element on its
        own, a host sync each.
        """
        received_counts_Wc = all_to_all_rows(send_counts_Wc, [1] * self.ep_size, [1] * self.ep_size, group)
        on_host = (
            torch.cat([send_counts_Wc[:, -1], received_counts_Wc[:, -1], received_counts_Wc[:, :-1].sum().view(1)])
            .cpu()
            .tolist()
        )
        ep_size = self.ep_size
        return received_counts_Wc, on_host[:ep_size], on_host[ep_size : 2 * ep_size], on_host[-1]

    def group_received_rows(self, received_UD: torch.Tensor, received_plan: SlotPlan) -> torch.Tensor:
        """The receiver's rows in local-expert order. Without padding (``align_size`` 1) every row of
        the exact-size buffer receives a slot, so it is not zero-filled first."""
        return self.row_ops.permute_rows(
            received_UD,
            received_plan.dest_row_S,
            self.top_k,
            received_plan.num_rows,
            zero_padding=self.has_padding_rows,
        )

    def weight_received_rows(self, routed_output_RD: torch.Tensor, metadata: AllToAllMetadata) -> torch.Tensor:
        """``(U, D)``: per received row, its slots' expert outputs weighted by their scores and summed."""
        received_plan = metadata.received_plan
        return self.row_ops.unpermute_rows(
            routed_output_RD,
            received_plan.dest_row_S,
            metadata.received_scores_S,
            self.top_k,
            zero_padding=self.has_padding_rows,
        )

    def sum_returned_rows(self, returned_UD: torch.Tensor, metadata: AllToAllMetadata) -> torch.Tensor:
        """``(T, D)``: the sender's sum of the rows that came back for each token."""
        return self.row_ops.sum_token_rows(returned_UD, metadata.pair_row_S, self.ep_size)


class StaticAllToAllTransport(AllToAllTransport):
    """``AllToAllTransport`` with nothing read on the host (``ep_receive_rows = "static"``,
    ``align_size`` 1): every rank sends every other rank a fixed ``T`` rows, row ``t`` holding token
    ``t`` when it has a slot there (unset otherwise, and marked so in its metadata row), so the split
    sizes are known without a count exchange; the receiver groups the slots of its experts on the
    device into the most rows it can receive (``T * W * min(top_k, local experts)``, unset past the
    received ones: they belong to no expert, and nothing reads them). No host sync, so a CUDA graph
    can capture it; it moves ``W * T`` rows each way where the exact transport moves the (token,
    rank) pairs that exist. Combine is the exact transport's."""

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """``T`` rows to every rank, the received slots grouped by local expert on the device."""
        ep_size, num_local = self.ep_size, self.num_local_experts
        num_tokens, top_k = topk_expert_ids_TK.shape
        expert_TK = topk_expert_ids_TK.long()
        token_T1 = torch.arange(num_tokens, device=x_TD.device).unsqueeze(1)
        fixed_row_TW = torch.arange(ep_size, device=x_TD.device) * num_tokens + token_T1
        pair_row_S = torch.where(reached_ranks(expert_TK // num_local, ep_size), fixed_row_TW, -1).view(-1)
        # Each sent row's K gating weights, K global expert ids (exact in fp32) and a 1 that marks it
        # sent: the rows of pairs that do not exist are zero, so marked unsent.
        ones_T1 = topk_scores_TK.new_ones(num_tokens, 1, dtype=torch.float32)
        token_meta_TM = torch.cat([topk_scores_TK.float(), expert_TK.float(), ones_T1], dim=1)
        num_sent = ep_size * num_tokens
        sent_rows_PD = self.row_ops.permute_rows(x_TD, pair_row_S, ep_size, num_sent, zero_padding=False)
        sent_meta_PM = self.row_ops.permute_rows(token_meta_TM, pair_row_S, ep_size, num_sent)
        splits = [num_tokens] * ep_size
        group = self.group()
        received_UD, received_meta_UM = exchange_rows((sent_rows_PD, sent_meta_PM), splits, splits, group)
        received_ids_UK = received_meta_UM[:, top_k : 2 * top_k].detach().long()
        sent_U1 = received_meta_UM[:, 2 * top_k :].detach() > 0
        rank = dist.get_rank(group)
        mine_UK = sent_U1 & (received_ids_UK // num_local == rank)
        received_experts_S = torch.where(mine_UK, received_ids_UK - rank * num_local, num_local).view(-1)
        _, slot_row_S, group_end_e = moe_permute.routing_metadata(received_experts_S, num_local)
        group_end_e = group_end_e.long()
        rows_per_local_expert_e = torch.diff(group_end_e, prepend=group_end_e.new_zeros(1))
        received_plan = SlotPlan(
            dest_row_S=torch.where(received_experts_S < num_local, slot_row_S, -1),
            num_rows=num_sent * min(top_k, num_local),
            rows_per_expert_E=rows_per_local_expert_e,
            num_padding_rows=rows_per_local_expert_e.new_zeros(()),
        )
        metadata = AllToAllMetadata(
            pair_row_S=pair_row_S,
            received_plan=received_plan,
            received_scores_S=received_meta_UM[:, :top_k].reshape(-1),
            input_splits=splits,
            output_splits=splits,
        )
        rows_RD = self.row_ops.permute_rows(
            received_UD, received_plan.dest_row_S, top_k, received_plan.num_rows, zero_padding=False
        )
        return rows_RD, rows_per_local_expert_e, metadata


@dataclass(frozen=True, kw_only=True)
class SymmMemMetadata:
    """``SymmMemTransport``: the exchange's route and the gating weights; no padding rows."""

    route: ep_symm_mem.Route
    """where the received rows came from"""
    scores_S: torch.Tensor
    """``(T*K,)`` gating weight of each slot"""
    num_padding_rows: torch.Tensor
    """0-d int64 zero"""


class SymmMemTransport(ExpertParallelTransport[SymmMemMetadata]):
    """EP through ``ep_symm_mem``, ``align_size`` 1: each arriving token comes once per (token, rank)
    pair and is copied here to its rows, grouped by local expert; with ``static_rows`` the received
    buffer has the most rows a rank can receive, unset past the received ones (they belong to no
    expert: the experts, the combine and the exchange's backward read none of them, nor their
    gradients), and no host sync sizes it. Selective activation checkpointing keeps the pairs (the
    exchange's output) and recomputes the copy."""

    supports_row_scores = True

    def __init__(
        self, row_ops: RowOps, align_size: int, num_experts: int, top_k: int, ep_mesh: DeviceMesh, static_rows: bool
    ):
        super().__init__(row_ops, align_size, num_experts, top_k, ep_mesh)
        self.static_rows = static_rows

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        scores_S = topk_scores_TK.reshape(-1)
        pairs_PD, num_rows, rows_per_local_expert_e, route = ep_symm_mem.dispatch(
            x_TD,
            scores_S,
            topk_expert_ids_TK.reshape(-1),
            self.group().group_name,
            self.num_experts,
            self.top_k,
            self.static_rows,
        )
        rows_RD = self.expand_rows(pairs_PD, route, num_rows)
        no_padding = rows_per_local_expert_e.new_zeros((), dtype=torch.int64)
        metadata = SymmMemMetadata(route=route, scores_S=scores_S, num_padding_rows=no_padding)
        return rows_RD, rows_per_local_expert_e, metadata

    def expand_rows(self, pairs_PD: torch.Tensor, route: ep_symm_mem.Route, num_rows: int) -> torch.Tensor:
        """``(num_rows, D)``: each arriving pair's row copied to its expert rows (local), expert-major;
        with ``static_rows`` the rows past the received ones are unset."""
        recv_row_S = route.recv_row_PK.reshape(-1)
        return self.row_ops.permute_rows(pairs_PD, recv_row_S, self.top_k, num_rows, zero_padding=False)

    def combine(self, routed_output_RD, metadata):
        return ep_symm_mem.combine(routed_output_RD, metadata.scores_S, metadata.route)

    def row_scores(self, metadata, num_rows):
        """The scores that travelled with the rows, at their rows; their gradient is pushed back."""
        return ep_symm_mem.row_scores(metadata.scores_S, metadata.route, num_rows)

    def sum_rows(self, weighted_output_RD, metadata):
        return ep_symm_mem.sum_rows(weighted_output_RD, metadata.route)


@dataclass(frozen=True, kw_only=True)
class PaddedSymmMemMetadata:
    """``PaddedSymmMemTransport``: the exchange's route, the gating weights and the padded row of
    each received row."""

    route: ep_symm_mem.Route
    """where the received rows came from"""
    scores_S: torch.Tensor
    """``(T*K,)`` gating weight of each slot"""
    received_dest_row_R: torch.Tensor
    """``(R,)`` the padded row of each received row (received rows in arrival order)"""
    num_padding_rows: torch.Tensor
    """0-d int64: the padding rows of the groups (zeros the experts compute)"""


class PaddedSymmMemTransport(ExpertParallelTransport[PaddedSymmMemMetadata]):
    """EP through ``ep_symm_mem`` with ``align_size`` > 1: each arriving token (one row per pair) is
    copied to its rows in groups padded to ``align_size``; the expert outputs are gathered back into
    received order before combine."""

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        scores_S = topk_scores_TK.reshape(-1)
        pairs_PD, num_received, rows_per_local_expert_e, route = ep_symm_mem.dispatch(
            x_TD, scores_S, topk_expert_ids_TK.reshape(-1), self.group().group_name, self.num_experts, self.top_k
        )
        dest_row_R, padded_counts_e, num_rows = padded_group_rows(
            rows_per_local_expert_e, num_received, self.align_size
        )
        recv_row_S = route.recv_row_PK.reshape(-1).long()
        dest_row_or_none_R1 = torch.cat([dest_row_R, dest_row_R.new_full((1,), -1)])  # last: a slot not here
        padded_row_S = dest_row_or_none_R1[torch.where(recv_row_S >= 0, recv_row_S, num_received)]
        metadata = PaddedSymmMemMetadata(
            route=route,
            scores_S=scores_S,
            received_dest_row_R=dest_row_R,
            num_padding_rows=padded_counts_e.sum() - num_received,
        )
        return self.row_ops.permute_rows(pairs_PD, padded_row_S, self.top_k, num_rows), padded_counts_e, metadata

    def combine(self, routed_output_RD, metadata):
        arrived_RD = self.row_ops.sum_token_rows(routed_output_RD, metadata.received_dest_row_R, 1)  # a gather
        return ep_symm_mem.combine(arrived_RD, metadata.scores_S, metadata.route)
