"""Expert-parallel exchange through a workspace every rank maps: the ``symm_mem`` EP transport.

Instead of NCCL all-to-alls with a send buffer, a count exchange and a rank-major ->
expert-major regroup, every rank publishes its tokens and its routing (each slot's expert,
score and expert-sorted position; per-expert counts) in a workspace that the other ranks of the
EP group can address, and the rows move with one kernel each way. A token crosses to a rank
once, however many of that rank's experts it is routed to:

- dispatch: every rank *pulls* each token that comes to it once, into a buffer of one row per
  (source rank, token) pair; the transport copies each to its expert rows, in expert-major
  order (local expert, then source rank, then the source's slot order), with its permute
  backend. Selective activation checkpointing keeps the pairs (``MoESelectiveAC`` saves this
  op's outputs) and recomputes the local copy;
- combine: every rank sums its expert outputs of each such token, weighted by the router
  scores (fp32), and *pushes* that one partial sum into the owner's ``landing`` region; the
  owner adds the partial sums of the token's destination ranks (fp32 accumulation).

Backward runs the same two moves the other way round (push each pair's summed row gradient;
pull each token's output gradient once, which also yields the router-score gradients). Every
move is fenced by a device-side barrier; a barrier before overwriting a region is added only
when a peer may still read it. One host sync per dispatch learns how many rows arrive.

Experts that weight their own rows (``row_scores`` gives each received row its score, the score's
gradient pushed back to the owner in backward) leave combine an unweighted sum (``sum_rows``), whose
backward pulls the output gradient to every row of the token: no expert output is kept for the
router-score gradient.

One dispatch is: publish (token copy, a stable sort of the slots by expert, one kernel writing
the routing regions and counts), barrier, one single-program kernel computing this rank's
receive layout from every rank's counts, one kernel reading every rank's routing into this
rank's pair table, the layout's copy to the host (the one host sync), and the pull.

Workspaces: CUDA symmetric memory (``torch.distributed._symmetric_memory``: peer GPUs over
NVLink / PCIe P2P) or, for ranks on one CPU host, shared-memory files (the kernels then run
under ``TRITON_INTERPRET=1``). Every rank of the group must route the same number of tokens
per call (torchtitan's fixed-length batches do); a mismatch is an error.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

from torchtitan_ext.experiments.moe_backends.grouping import row_scores_of_slots
from torchtitan_ext.kernels import symm_mem_rows as kernels
from torchtitan_ext.kernels.library_ops import kernel_op
from torchtitan_ext.kernels.moe_permute import stable_expert_order

_ALIGN_BYTES = 256


@dataclass(frozen=True)
class WorkspaceShape:
    """What one rank's workspace holds room for."""

    num_tokens: int
    dim: int
    top_k: int
    num_experts: int
    world: int
    dtype: torch.dtype

    def regions(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        slots = self.num_tokens * self.top_k
        landing_rows = self.num_tokens * kernels.slots_per_token(self.top_k, self.world)
        return {
            "tokens": ((self.num_tokens, self.dim), self.dtype),
            "landing": ((landing_rows, self.dim), self.dtype),
            "counts": ((self.num_experts + 1,), torch.int32),
            "slot_expert": ((slots,), torch.int32),
            "slot_position": ((slots,), torch.int32),
            "slot_score": ((slots,), torch.float32),
            "score_grad": ((slots,), torch.float32),
        }

    def byte_offsets(self) -> tuple[dict[str, int], int]:
        """Byte offset of every region and the workspace size, regions 256-byte aligned."""
        offsets, total = {}, 0
        for name, (shape, dtype) in self.regions().items():
            offsets[name] = total
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            total += -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        return offsets, total

    def holds(self, other: WorkspaceShape) -> bool:
        return (self.dim, self.top_k, self.num_experts, self.world, self.dtype) == (
            other.dim,
            other.top_k,
            other.num_experts,
            other.world,
            other.dtype,
        ) and self.num_tokens >= other.num_tokens


class Workspace(ABC):
    """One rank's regions, addressable by every rank of ``group``.

    ``local(name)`` is this rank's copy of a region; ``table(name)`` is an int64 tensor of
    every rank's address of it (the kernels' pointer tables); ``barrier()`` returns once every
    rank has reached it, with all earlier writes visible.
    """

    def __init__(self, shape: WorkspaceShape, group: dist.ProcessGroup, device: torch.device):
        self.shape = shape
        self.group_name = group.group_name  # not the group: a destroyed group must be freeable
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        offsets, nbytes = shape.byte_offsets()
        local_bytes, addresses = self._map(group, nbytes, device)
        self._views, self._tables = {}, {}
        for name, (region_shape, dtype) in shape.regions().items():
            start = offsets[name]
            size = torch.Size(region_shape).numel() * dtype.itemsize
            self._views[name] = local_bytes[start : start + size].view(dtype).view(region_shape)
            self._tables[name] = torch.tensor(
                [address + start for address in addresses], dtype=torch.int64, device=device
            )

    @abstractmethod
    def _map(self, group: dist.ProcessGroup, nbytes: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Allocate this rank's bytes; return them and every rank's base address."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank of the group has called it, earlier writes visible to all."""

    def local(self, name: str) -> torch.Tensor:
        return self._views[name]

    def table(self, name: str) -> torch.Tensor:
        return self._tables[name]


class CudaSymmetricWorkspace(Workspace):
    """CUDA symmetric memory: peers' buffers mapped into this GPU's address space."""

    def _map(self, group, nbytes, device):
        from torch.distributed import _symmetric_memory as symm_mem

        local_bytes = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        try:
            self._handle = symm_mem.rendezvous(local_bytes, group)
        except RuntimeError as error:
            raise RuntimeError(
                f"moe.ep_transport = 'symm_mem' could not map the EP peers' GPU memory ({error}); "
                "--moe.ep_transport all_to_all moves the rows through NCCL instead"
            ) from error
        return local_bytes, list(self._handle.buffer_ptrs)

    def barrier(self) -> None:
        self._handle.barrier(channel=0)


class SharedMemoryWorkspace(Workspace):
    """Ranks on one host: one shared-memory file per rank, mapped by every rank."""

    def _map(self, group, nbytes, device):
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        paths = [os.path.join(folder, f"moe-ep-exchange-{token[0]}-{rank}") for rank in range(self.world)]
        mine = torch.UntypedStorage.from_file(paths[self.rank], shared=True, nbytes=nbytes)
        dist.barrier(group=group)
        self._storages = [
            mine if rank == self.rank else torch.UntypedStorage.from_file(paths[rank], shared=True, nbytes=nbytes)
            for rank in range(self.world)
        ]
        dist.barrier(group=group)
        os.unlink(paths[self.rank])  # every rank holds its mapping; the name is no longer needed
        # pyrefly: ignore[bad-argument-type]  # torch's stub types from_file's result as TypedStorage | _StorageBase
        local_bytes = torch.empty(0, dtype=torch.uint8).set_(mine)
        return local_bytes, [storage.data_ptr() for storage in self._storages]

    def barrier(self) -> None:
        dist.barrier(group=_resolve_process_group(self.group_name))


def static_receive_rows(num_tokens: int, world: int, top_k: int, num_experts: int) -> int:
    """The most rows a rank can receive: each of the ``world`` ranks' tokens on at most
    ``min(top_k, local experts)`` of its experts."""
    return world * num_tokens * min(top_k, num_experts // world)


@dataclass(frozen=True, kw_only=True)
class Route:
    """What a dispatch leaves for its combine and both backwards: device tensors and the names
    that find the exchange again (no Python object, so a compiled graph can carry it)."""

    group_name: str
    num_experts: int
    top_k: int
    expert_S: torch.Tensor
    """``(T*K,)`` this rank's slots' expert ids, ``num_experts`` for dropped ones"""
    recv_row_PK: torch.Tensor
    recv_score_PK: torch.Tensor
    ordinal_P: torch.Tensor
    """the pair table's tensors (``symm_mem_rows.PairTable``)"""

    @property
    def exchange(self) -> EPExchange:
        return EPExchange.for_group_name(self.group_name, self.expert_S.device)

    @property
    def pairs(self) -> kernels.PairTable:
        return kernels.PairTable(
            rank=self.exchange.rank,
            num_tokens=self.expert_S.shape[0] // self.top_k,
            top_k=self.top_k,
            recv_row_PK=self.recv_row_PK,
            recv_score_PK=self.recv_score_PK,
            ordinal_P=self.ordinal_P,
        )

    @property
    def workspace(self) -> Workspace:
        workspace = self.exchange.workspace
        assert workspace is not None
        return workspace


class EPExchange:
    """Dispatch and combine for one EP process group; one workspace shared by all MoE layers."""

    _by_group: ClassVar[dict[tuple[str, str], EPExchange]] = {}

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group_name = group.group_name
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.workspace: Workspace | None = None
        self._peers_may_read_published = False
        self._landing_in_local_use = False
        self._score_grads_in_local_use = False
        self.replayable = False
        """Set by a dispatch with static received rows, which a CUDA graph may capture and replay: a replay
        runs no Python, so every fence is then issued whatever the host's flags say."""

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, device: torch.device) -> EPExchange:
        return cls.for_group_name(group.group_name, device)

    @classmethod
    def for_group_name(cls, group_name: str, device: torch.device) -> EPExchange:
        key = (group_name, str(device))
        if key not in cls._by_group:
            cls._by_group[key] = cls(_resolve_process_group(GroupName(group_name)), device)
        return cls._by_group[key]

    # ------------------------------------------------------------------ fences

    def barrier(self) -> None:
        """Return once every rank of the group has reached it, earlier writes visible to all."""
        assert self.workspace is not None
        self.workspace.barrier()
        self._peers_may_read_published = False
        self._landing_in_local_use = False
        self._score_grads_in_local_use = False

    def _before_publish(self) -> None:
        """About to overwrite this rank's tokens / routing: peers must be done reading them."""
        if self._peers_may_read_published or self.replayable:
            self.barrier()

    def _before_push(self) -> None:
        """About to write peers' landing regions: they must be done reading them."""
        if self._landing_in_local_use or self.replayable:
            self.barrier()

    def _before_score_grad_push(self) -> None:
        """About to write peers' score-gradient regions: they must be done reading them."""
        if self._score_grads_in_local_use or self.replayable:
            self.barrier()

    def _workspace_for(self, shape: WorkspaceShape) -> Workspace:
        if self.workspace is None or not self.workspace.shape.holds(shape):
            if self.workspace is not None:
                self._before_publish()
                self._before_push()
            workspace_type = CudaSymmetricWorkspace if self.device.type == "cuda" else SharedMemoryWorkspace
            self.workspace = workspace_type(shape, _resolve_process_group(self.group_name), self.device)
        return self.workspace

    # ------------------------------------------------------------------ moves

    def dispatch_pairs(
        self,
        x_TD: torch.Tensor,
        scores_S: torch.Tensor,
        expert_S: torch.Tensor,
        num_experts: int,
        top_k: int,
        static_rows: bool = False,
    ) -> tuple[torch.Tensor, int, torch.Tensor, Route]:
        """Return ``(pairs_PD, num_rows, rows_per_local_expert_e, route)``; expert ``num_experts`` = dropped.

        ``pairs_PD`` ``(W*T, D)`` holds one row per pair ``p = s * T + t`` arriving here: token ``t``
        of rank ``s``, pulled once however many of this rank's experts it is routed to (the rows of
        pairs that do not arrive are left unset). Copied to the rows ``route.recv_row_PK`` names,
        they are the ``num_rows`` expert-major received rows. ``num_rows`` is read on the host (one
        sync, which also checks that every rank routes the same number of tokens), or with
        ``static_rows`` it is ``static_receive_rows`` (no host sync; the rows after the received
        ones belong to no expert).
        """
        num_tokens, dim = x_TD.shape
        self._workspace_for(WorkspaceShape(num_tokens, dim, top_k, num_experts, self.world, x_TD.dtype))
        expert_S = expert_S.reshape(-1)
        self.publish(x_TD, scores_S.reshape(-1), expert_S, num_experts)
        self.barrier()
        layout, pairs = self.read_routing(num_experts, num_tokens, top_k)
        if static_rows:
            self.replayable = True
            num_rows = static_receive_rows(num_tokens, self.world, top_k, num_experts)
        else:
            on_host = kernels.ReceiveLayout.unpack(layout.packed.cpu(), num_experts // self.world, self.world)
            tokens_per_rank = on_host.tokens_per_rank_W.tolist()
            if tokens_per_rank.count(num_tokens) != self.world:
                raise RuntimeError(
                    f"ep_transport 'symm_mem' needs the same token count on every EP rank, got {tokens_per_rank}"
                )
            num_rows = int(on_host.block_start_G1[-1])
        route = Route(
            group_name=self.group_name,
            num_experts=num_experts,
            top_k=top_k,
            expert_S=expert_S,
            recv_row_PK=pairs.recv_row_PK,
            recv_score_PK=pairs.recv_score_PK,
            ordinal_P=pairs.ordinal_P,
        )
        pairs_PD = x_TD.new_empty(self.world * num_tokens, dim)
        self.pull_rows(route, pairs_PD)
        self._peers_may_read_published = True
        return pairs_PD, num_rows, layout.rows_per_local_expert_e, route

    def publish(self, x_TD: torch.Tensor, scores_S: torch.Tensor, expert_S: torch.Tensor, num_experts: int) -> None:
        """Write this rank's tokens and routing into its workspace (once peers are done reading)."""
        assert self.workspace is not None
        self._before_publish()
        order_S = stable_expert_order(expert_S, num_experts)
        self.workspace.local("tokens")[: x_TD.shape[0]].copy_(x_TD)
        kernels.publish_routing(
            order_S,
            expert_S,
            scores_S,
            self.workspace.local("slot_expert"),
            self.workspace.local("slot_score"),
            self.workspace.local("slot_position"),
            self.workspace.local("counts"),
            num_experts,
            x_TD.shape[0],
        )

    def read_routing(
        self, num_experts: int, num_tokens: int, top_k: int
    ) -> tuple[kernels.ReceiveLayout, kernels.PairTable]:
        """Every rank's published routing (after the barrier) -> this rank's layout and pair table."""
        assert self.workspace is not None
        table = self.workspace.table
        layout = kernels.receive_layout(table("counts"), num_experts, self.rank, table("counts"))
        pairs = kernels.route_pairs(
            table("slot_expert"),
            table("slot_position"),
            table("slot_score"),
            layout,
            self.rank,
            num_tokens,
            top_k,
            num_experts,
        )
        return layout, pairs

    def pull_rows(self, route: Route, pairs_PD: torch.Tensor) -> None:
        """The pull kernel alone: every arriving pair's token read from its owner's published tokens
        into row ``p`` of ``pairs_PD``."""
        kernels.pull_pairs(route.workspace.table("tokens"), route.pairs.one_row_per_pair(), pairs_PD)

    def push_rows(self, rows_RD: torch.Tensor, route: Route, weighted: bool) -> None:
        """The push kernel alone: each pair's row sum (``weighted``: by the router scores) written to
        its owner's landing region."""
        kernels.push_pairs(rows_RD, route.pairs, route.workspace.table("landing"), weighted)

    def sum_landing(self, route: Route) -> torch.Tensor:
        """``(T, D)``: the owner's sum of the partial sums pushed to its landing region."""
        return kernels.sum_landing(
            route.workspace.local("landing"), route.expert_S, route.num_experts, self.world, route.pairs.top_k
        )

    def push_and_sum(self, rows_RD: torch.Tensor, route: Route, weighted: bool) -> torch.Tensor:
        """Push each pair's row sum (``weighted``: by the router scores) to its owner's landing region;
        return this rank's ``(T, D)`` totals: the combine, and unweighted the dispatch's backward."""
        self._before_push()
        self.push_rows(rows_RD, route, weighted)
        self.barrier()
        self._landing_in_local_use = True
        return self.sum_landing(route)

    def combine_backward(
        self, grad_out_TD: torch.Tensor, rows_RD: torch.Tensor, route: Route
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(grad_rows_RD, grad_scores_S)`` for the weighted ``push_and_sum``'s output gradient."""
        workspace = route.workspace
        self._before_publish()
        workspace.local("tokens")[: route.pairs.num_tokens].copy_(grad_out_TD)
        self.barrier()
        grad_rows_RD = kernels.pull_output_grad(
            workspace.table("tokens"), route.pairs, rows_RD, workspace.table("score_grad")
        )
        self.barrier()
        self._landing_in_local_use = True
        return grad_rows_RD, self._received_score_grads(route)

    def _received_score_grads(self, route: Route) -> torch.Tensor:
        """``(T*K,)`` fp32: the score gradients peers wrote to this rank's ``score_grad`` (after the
        barrier that follows their writes), 0 for dropped slots; a copy."""
        assert self.workspace is not None
        kept_S = route.expert_S < route.num_experts
        grad_scores_S = torch.where(kept_S, self.workspace.local("score_grad")[: route.expert_S.shape[0]], 0.0)
        self._score_grads_in_local_use = True
        return grad_scores_S

    def sum_rows_backward(self, grad_out_TD: torch.Tensor, route: Route, num_rows: int) -> torch.Tensor:
        """``(num_rows, D)``: the unweighted ``push_and_sum``'s input gradient, each token's output
        gradient pulled from its owner to every one of its rows here (the rows no pair received, past
        the received ones, unset)."""
        workspace = route.workspace
        self._before_publish()
        workspace.local("tokens")[: route.pairs.num_tokens].copy_(grad_out_TD)
        self.barrier()
        grad_rows_RD = grad_out_TD.new_empty(num_rows, grad_out_TD.shape[1])
        kernels.pull_pairs(workspace.table("tokens"), route.pairs, grad_rows_RD)
        self._peers_may_read_published = True
        return grad_rows_RD

    def push_score_grads(self, grad_scores_R: torch.Tensor, route: Route) -> torch.Tensor:
        """Send each received row's score gradient to its slot's owner; return this rank's
        ``(T*K,)`` fp32 score gradients (0 for dropped slots)."""
        self._before_score_grad_push()
        kernels.push_score_grads(grad_scores_R, route.pairs, route.workspace.table("score_grad"))
        self.barrier()
        return self._received_score_grads(route)


@kernel_op("symm_mem_dispatch")
def _dispatch_op(
    x_TD: torch.Tensor,
    scores_S: torch.Tensor,
    expert_S: torch.Tensor,
    group_name: str,
    num_experts: int,
    top_k: int,
    static_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pairs_PD, row_count_R0, rows_per_local_expert_e, recv_row_PK, recv_score_PK, ordinal_P)``
    (``dispatch``); ``row_count_R0`` is an empty ``(num_rows, 0)`` tensor: its row count is how
    many expert rows the pairs expand to (a size the host read; under compile an unbacked size).

    Selective activation checkpointing keeps this op's outputs: one row per pair, not one per
    expert row (about ``top_k / world`` times fewer at uniform routing). Every output starts on a
    16-byte boundary, as Inductor assumes of a custom op's outputs: the counts, a view into the
    packed receive layout, are copied out of it."""
    exchange = EPExchange.for_group_name(group_name, x_TD.device)
    pairs_PD, num_rows, rows_per_local_expert_e, route = exchange.dispatch_pairs(
        x_TD, scores_S, expert_S, num_experts, top_k, static_rows
    )
    return (
        pairs_PD,
        x_TD.new_empty(num_rows, 0),
        rows_per_local_expert_e.clone(),
        route.recv_row_PK,
        route.recv_score_PK,
        route.ordinal_P,
    )


@torch.library.register_fake(_dispatch_op)
def _(x_TD, scores_S, expert_S, group_name, num_experts, top_k, static_rows):
    world = dist.get_world_size(_resolve_process_group(group_name))
    num_pairs = world * x_TD.shape[0]
    if static_rows:
        num_rows = static_receive_rows(x_TD.shape[0], world, top_k, num_experts)
    else:
        num_rows = torch.library.get_ctx().new_dynamic_size()
    return (
        x_TD.new_empty(num_pairs, x_TD.shape[1]),
        x_TD.new_empty(num_rows, 0),
        expert_S.new_empty(num_experts // world, dtype=torch.int64),
        expert_S.new_empty(num_pairs, top_k, dtype=torch.int32),
        expert_S.new_empty(num_pairs, top_k, dtype=torch.float32),
        expert_S.new_empty(num_pairs, dtype=torch.int32),
    )


def _route_of(expert_S: torch.Tensor, tables: tuple, group_name: str, num_experts: int, top_k: int) -> Route:
    recv_row_PK, recv_score_PK, ordinal_P = tables
    return Route(
        group_name=group_name,
        num_experts=num_experts,
        top_k=top_k,
        expert_S=expert_S,
        recv_row_PK=recv_row_PK,
        recv_score_PK=recv_score_PK,
        ordinal_P=ordinal_P,
    )


@kernel_op("symm_mem_combine")
def _combine_op(
    rows_RD: torch.Tensor,
    scores_S: torch.Tensor,
    expert_S: torch.Tensor,
    recv_row_PK: torch.Tensor,
    recv_score_PK: torch.Tensor,
    ordinal_P: torch.Tensor,
    group_name: str,
    num_experts: int,
    top_k: int,
    weighted: bool,
) -> torch.Tensor:
    """``(T, D)``: each token's rows (``weighted``: times the router scores that travelled with them) summed
    over its destination ranks; ``scores_S`` is the dispatch's, an input for its gradient only."""
    route = _route_of(expert_S, (recv_row_PK, recv_score_PK, ordinal_P), group_name, num_experts, top_k)
    return route.exchange.push_and_sum(rows_RD.contiguous(), route, weighted)


@torch.library.register_fake(_combine_op)
def _(rows_RD, scores_S, expert_S, recv_row_PK, recv_score_PK, ordinal_P, group_name, num_experts, top_k, weighted):
    return rows_RD.new_empty(expert_S.shape[0] // top_k, rows_RD.shape[1])


@kernel_op("symm_mem_combine_backward")
def _combine_backward_op(
    grad_out_TD: torch.Tensor,
    rows_RD: torch.Tensor,
    expert_S: torch.Tensor,
    recv_row_PK: torch.Tensor,
    recv_score_PK: torch.Tensor,
    ordinal_P: torch.Tensor,
    group_name: str,
    num_experts: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_rows_RD, grad_scores_S)`` of the weighted combine."""
    route = _route_of(expert_S, (recv_row_PK, recv_score_PK, ordinal_P), group_name, num_experts, top_k)
    return route.exchange.combine_backward(grad_out_TD.to(rows_RD.dtype).contiguous(), rows_RD, route)


@torch.library.register_fake(_combine_backward_op)
def _(grad_out_TD, rows_RD, expert_S, recv_row_PK, recv_score_PK, ordinal_P, group_name, num_experts, top_k):
    return torch.empty_like(rows_RD), expert_S.new_empty(expert_S.shape[0], dtype=torch.float32)


def _dispatch_setup(ctx, inputs, output) -> None:
    _, _, expert_S, group_name, num_experts, top_k, _ = inputs
    _, row_count_R0, rows_per_local_expert_e, *tables = output
    ctx.mark_non_differentiable(row_count_R0, rows_per_local_expert_e, *tables)
    _, recv_score_PK, ordinal_P = tables
    ctx.save_for_backward(expert_S, recv_score_PK, ordinal_P)
    ctx.names = (group_name, num_experts, top_k)


def _dispatch_backward(ctx, grad_pairs_PD, *_):
    """Each arriving pair's gradient row pushed back to the token's owner (the unweighted combine of
    a table whose rows are the pairs), which sums them over the token's destination ranks."""
    expert_S, recv_score_PK, ordinal_P = ctx.saved_tensors
    tables = (kernels.pair_rows(ordinal_P), recv_score_PK, ordinal_P)
    grad_x_TD = _combine_op(grad_pairs_PD, expert_S.new_empty(0), expert_S, *tables, *ctx.names, False)
    return grad_x_TD, None, None, None, None, None, None


@kernel_op("symm_mem_sum_rows_backward")
def _sum_rows_backward_op(
    grad_out_TD: torch.Tensor,
    row_count_R0: torch.Tensor,
    expert_S: torch.Tensor,
    recv_row_PK: torch.Tensor,
    recv_score_PK: torch.Tensor,
    ordinal_P: torch.Tensor,
    group_name: str,
    num_experts: int,
    top_k: int,
) -> torch.Tensor:
    """``grad_rows_RD`` of the unweighted combine; ``row_count_R0`` is ``(R, 0)``: its rows count the rows."""
    route = _route_of(expert_S, (recv_row_PK, recv_score_PK, ordinal_P), group_name, num_experts, top_k)
    return route.exchange.sum_rows_backward(grad_out_TD.contiguous(), route, row_count_R0.shape[0])


@torch.library.register_fake(_sum_rows_backward_op)
def _(grad_out_TD, row_count_R0, expert_S, recv_row_PK, recv_score_PK, ordinal_P, group_name, num_experts, top_k):
    return grad_out_TD.new_empty(row_count_R0.shape[0], grad_out_TD.shape[1])


def _combine_setup(ctx, inputs, output) -> None:
    """The weighted combine keeps its rows (the score gradient reads them); the unweighted one only
    their count."""
    rows_RD, scores_S, expert_S, *tables_and_names = inputs
    *tables, group_name, num_experts, top_k, weighted = tables_and_names
    kept_rows = rows_RD if weighted else rows_RD.new_empty(rows_RD.shape[0], 0)
    ctx.save_for_backward(kept_rows, expert_S, *tables)
    ctx.names = (group_name, num_experts, top_k)
    ctx.weighted = weighted
    ctx.scores_dtype = scores_S.dtype
    ctx.rows_dtype = rows_RD.dtype


def _combine_backward(ctx, grad_out_TD):
    kept_rows, expert_S, *tables = ctx.saved_tensors
    unused = (None,) * 8
    if not ctx.weighted:
        grad_out_TD = grad_out_TD.to(ctx.rows_dtype)
        return _sum_rows_backward_op(grad_out_TD, kept_rows, expert_S, *tables, *ctx.names), None, *unused
    grad_rows_RD, grad_scores_S = _combine_backward_op(grad_out_TD, kept_rows, expert_S, *tables, *ctx.names)
    return grad_rows_RD, grad_scores_S.to(ctx.scores_dtype), *unused


@kernel_op("symm_mem_row_scores")
def _row_scores_op(
    row_count_R0: torch.Tensor,
    scores_S: torch.Tensor,
    expert_S: torch.Tensor,
    recv_row_PK: torch.Tensor,
    recv_score_PK: torch.Tensor,
    ordinal_P: torch.Tensor,
    group_name: str,
    num_experts: int,
    top_k: int,
) -> torch.Tensor:
    """``(R,)`` fp32: each received row's router score (0 for rows no pair received);
    ``row_count_R0`` is ``(R, 0)``; ``scores_S`` is the dispatch's, an input for its gradient only."""
    return row_scores_of_slots(recv_row_PK.reshape(-1), recv_score_PK, row_count_R0.shape[0])


@torch.library.register_fake(_row_scores_op)
def _(row_count_R0, scores_S, expert_S, recv_row_PK, recv_score_PK, ordinal_P, group_name, num_experts, top_k):
    return recv_score_PK.new_empty(row_count_R0.shape[0])


@kernel_op("symm_mem_row_scores_backward")
def _row_scores_backward_op(
    grad_scores_R: torch.Tensor,
    expert_S: torch.Tensor,
    recv_row_PK: torch.Tensor,
    recv_score_PK: torch.Tensor,
    ordinal_P: torch.Tensor,
    group_name: str,
    num_experts: int,
    top_k: int,
) -> torch.Tensor:
    """``(T*K,)`` fp32 gradient of the owner's scores: each row's score gradient pushed back."""
    route = _route_of(expert_S, (recv_row_PK, recv_score_PK, ordinal_P), group_name, num_experts, top_k)
    return route.exchange.push_score_grads(grad_scores_R, route)


@torch.library.register_fake(_row_scores_backward_op)
def _(grad_scores_R, expert_S, recv_row_PK, recv_score_PK, ordinal_P, group_name, num_experts, top_k):
    return expert_S.new_empty(expert_S.shape[0], dtype=torch.float32)


def _row_scores_setup(ctx, inputs, output) -> None:
    _, scores_S, expert_S, *tables_and_names = inputs
    *tables, group_name, num_experts, top_k = tables_and_names
    ctx.save_for_backward(expert_S, *tables)
    ctx.names = (group_name, num_experts, top_k)
    ctx.scores_dtype = scores_S.dtype


def _row_scores_backward(ctx, grad_scores_R):
    expert_S, *tables = ctx.saved_tensors
    grad_scores_S = _row_scores_backward_op(grad_scores_R.float().contiguous(), expert_S, *tables, *ctx.names)
    return None, grad_scores_S.to(ctx.scores_dtype), None, None, None, None, None, None, None


torch.library.register_autograd(_dispatch_op, _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd(_combine_op, _combine_backward, setup_context=_combine_setup)
torch.library.register_autograd(_row_scores_op, _row_scores_backward, setup_context=_row_scores_setup)


def dispatch(
    x_TD: torch.Tensor,
    scores_S: torch.Tensor,
    expert_S: torch.Tensor,
    group_name: str,
    num_experts: int,
    top_k: int,
    static_rows: bool = False,
) -> tuple[torch.Tensor, int, torch.Tensor, Route]:
    """Differentiable in ``x_TD``: ``(pairs_PD, num_rows, rows_per_local_expert_e, route)``.

    ``pairs_PD`` ``(W*T, D)`` holds each arriving (source rank, token) pair's token once; copying
    row ``p`` to the rows ``route.recv_row_PK[p]`` names gives the ``num_rows`` received rows,
    expert-major (the transport does, with its permute backend). ``expert_S`` (``T*K``,
    token-major slots) holds global expert ids, ``num_experts`` for a slot the router dropped;
    ``scores_S`` travels with the rows: the combine weights by it. The
    ``torchtitan_ext::symm_mem_dispatch`` op: ``num_rows`` is read on the host (one sync; an
    unbacked size under compile), or with ``static_rows`` it is the most a rank can receive
    (``static_receive_rows``; no host sync, so a CUDA graph can capture it).
    """
    expert_S = expert_S.reshape(-1)
    pairs_PD, row_count_R0, rows_per_local_expert_e, *tables = _dispatch_op(
        x_TD.contiguous(), scores_S.detach(), expert_S, group_name, num_experts, top_k, static_rows
    )
    route = _route_of(expert_S, tuple(tables), group_name, num_experts, top_k)
    return pairs_PD, row_count_R0.shape[0], rows_per_local_expert_e, route


def combine(rows_RD: torch.Tensor, scores_S: torch.Tensor, route: Route) -> torch.Tensor:
    """Differentiable in ``rows_RD`` and ``scores_S``: ``(T, D)`` weighted sum over top_k.

    ``scores_S`` must be the scores given to ``dispatch`` (the weights travelled with the rows).
    """
    tables = (route.recv_row_PK, route.recv_score_PK, route.ordinal_P)
    return _combine_op(
        rows_RD, scores_S.reshape(-1), route.expert_S, *tables, route.group_name, route.num_experts, route.top_k, True
    )


def row_scores(scores_S: torch.Tensor, route: Route, num_rows: int) -> torch.Tensor:
    """Differentiable in ``scores_S``: ``(num_rows,)`` fp32, the router score of each received row
    (``dispatch``'s ``num_rows`` expert-major rows; 0 for rows no pair received). ``scores_S`` must be
    the scores given to ``dispatch``; their gradient is pushed back to their owners in backward."""
    tables = (route.recv_row_PK, route.recv_score_PK, route.ordinal_P)
    row_count_R0 = route.recv_score_PK.new_empty(num_rows, 0)
    return _row_scores_op(
        row_count_R0, scores_S.reshape(-1), route.expert_S, *tables, route.group_name, route.num_experts, route.top_k
    )


def sum_rows(rows_RD: torch.Tensor, route: Route) -> torch.Tensor:
    """Differentiable in ``rows_RD``: ``(T, D)``, each token's rows summed over its destination ranks,
    unweighted (rows the experts weighted by ``row_scores``)."""
    tables = (route.recv_row_PK, route.recv_score_PK, route.ordinal_P)
    no_scores = route.recv_score_PK.new_empty(0)
    return _combine_op(
        rows_RD, no_scores, route.expert_S, *tables, route.group_name, route.num_experts, route.top_k, False
    )
