"""Expert-parallel exchange through a workspace every rank maps: the ``symm_mem`` EP transport.

Instead of NCCL all-to-alls with a send buffer, a count exchange and a rank-major ->
expert-major regroup, every rank publishes its tokens and its routing (kept slots sorted by
expert, their scores, per-expert counts) in a workspace that the other ranks of the EP group
can address, and the rows move with one kernel each way:

- dispatch: every rank *pulls* the rows its local experts need straight into expert-major
  order (local expert, then source rank, then the source's slot order);
- combine: every rank *pushes* each expert output back into its owner's ``landing`` region at
  the row's slot; the owner sums over top_k with the router scores (fp32 accumulation).

Backward runs the same two moves the other way round (push row gradients and sum; pull output
gradients, which also yields the router-score gradients). Every move is fenced by a device-side
barrier; a barrier before overwriting a region is added only when a peer may still read it.
One host sync per dispatch learns how many rows arrive.

One dispatch is: publish (token copy, a stable sort of the slots by expert, one kernel writing
the sorted slots, scores and counts), barrier, one single-program kernel computing this rank's
receive layout from every rank's counts, its copy to the host (the one host sync), and the pull.

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

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from torchtitan_ext.kernels import ep_exchange as kernels
from torchtitan_ext.kernels.moe_token_permute import sum_slots, weighted_sum_slots

_ALIGN_BYTES = 256


@dataclass(frozen=True)
class WorkspaceShape:
    """What one rank's workspace holds room for."""

    num_tokens: int
    dim: int
    top_k: int
    num_experts: int
    dtype: torch.dtype

    def regions(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        slots = self.num_tokens * self.top_k
        return {
            "tokens": ((self.num_tokens, self.dim), self.dtype),
            "landing": ((slots, self.dim), self.dtype),
            "counts": ((self.num_experts + 1,), torch.int32),
            "sorted_slot": ((slots,), torch.int32),
            "sorted_score": ((slots,), torch.float32),
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
        return (self.dim, self.top_k, self.num_experts, self.dtype) == (
            other.dim, other.top_k, other.num_experts, other.dtype
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
            self._views[name] = local_bytes[start:start + size].view(dtype).view(region_shape)
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
        self._handle = symm_mem.rendezvous(local_bytes, group)
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
        local_bytes = torch.empty(0, dtype=torch.uint8).set_(mine)
        return local_bytes, [storage.data_ptr() for storage in self._storages]

    def barrier(self) -> None:
        dist.barrier(group=_resolve_process_group(self.group_name))


@dataclass(frozen=True, kw_only=True)
class Route:
    """What a dispatch leaves for its combine and both backwards (device tensors)."""

    exchange: EPExchange
    workspace: Workspace
    num_tokens: int
    top_k: int
    recv_source_N: torch.Tensor
    """``(N,)`` int32 rank each received row came from"""
    recv_slot_N: torch.Tensor
    """``(N,)`` int32 the row's slot on that rank"""
    recv_score_N: torch.Tensor
    """``(N,)`` fp32 the slot's router score"""
    kept_slot_S: torch.Tensor
    """``(T*K,)`` int64 slot index of each of this rank's kept slots, -1 for dropped ones"""


class EPExchange:
    """Dispatch and combine for one EP process group; one workspace shared by all MoE layers."""

    _by_group: dict[tuple[str, str], EPExchange] = {}

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group_name = group.group_name
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.workspace: Workspace | None = None
        self._peers_may_read_published = False
        self._landing_in_local_use = False

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, device: torch.device) -> EPExchange:
        key = (group.group_name, str(device))
        if key not in cls._by_group:
            cls._by_group[key] = cls(group, device)
        return cls._by_group[key]

    # ------------------------------------------------------------------ fences

    def _barrier(self) -> None:
        assert self.workspace is not None
        self.workspace.barrier()
        self._peers_may_read_published = False
        self._landing_in_local_use = False

    def _before_publish(self) -> None:
        """About to overwrite this rank's tokens / routing: peers must be done reading them."""
        if self._peers_may_read_published:
            self._barrier()

    def _before_push(self) -> None:
        """About to write peers' landing regions: they must be done reading them."""
        if self._landing_in_local_use:
            self._barrier()

    def _workspace_for(self, shape: WorkspaceShape) -> Workspace:
        if self.workspace is None or not self.workspace.shape.holds(shape):
            if self.workspace is not None:
                self._before_publish()
                self._before_push()
            workspace_type = CudaSymmetricWorkspace if self.device.type == "cuda" else SharedMemoryWorkspace
            self.workspace = workspace_type(shape, _resolve_process_group(self.group_name), self.device)
        return self.workspace

    # ------------------------------------------------------------------ moves

    def dispatch_rows(
        self, x_TD: torch.Tensor, scores_S: torch.Tensor, expert_S: torch.Tensor, num_experts: int, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, Route]:
        """Return ``(rows_ND, rows_per_local_expert_L, route)``; expert ``num_experts`` = dropped."""
        num_tokens, dim = x_TD.shape
        workspace = self._workspace_for(WorkspaceShape(num_tokens, dim, top_k, num_experts, x_TD.dtype))
        self._before_publish()
        expert_S = expert_S.reshape(-1)
        narrow_keys = expert_S.to(torch.int16) if num_experts < torch.iinfo(torch.int16).max else expert_S
        order_S = torch.argsort(narrow_keys, stable=True)  # 16-bit keys: fewer radix passes
        workspace.local("tokens")[:num_tokens].copy_(x_TD)
        kept_slot_S = kernels.publish_routing(
            order_S, expert_S, scores_S.reshape(-1), workspace.local("sorted_slot"),
            workspace.local("sorted_score"), workspace.local("counts"), num_experts, num_tokens,
        )
        self._barrier()

        layout = kernels.receive_layout(workspace.table("counts"), num_experts, self.rank, x_TD)
        on_host = kernels.ReceiveLayout.unpack(layout.packed.cpu(), num_experts // self.world, self.world)
        tokens_per_rank = on_host.tokens_per_rank_W.tolist()
        if tokens_per_rank.count(num_tokens) != self.world:
            raise RuntimeError(
                f"ep_transport 'symm_mem' needs the same token count on every EP rank, got {tokens_per_rank}"
            )
        rows_ND = x_TD.new_empty(int(on_host.block_start_B1[-1]), dim)
        recv_source_N, recv_slot_N, recv_score_N = kernels.pull_rows(
            workspace.table("tokens"), workspace.table("sorted_slot"), workspace.table("sorted_score"),
            layout, rows_ND, top_k,
        )
        self._peers_may_read_published = True
        route = Route(
            exchange=self,
            workspace=workspace,
            num_tokens=num_tokens,
            top_k=top_k,
            recv_source_N=recv_source_N,
            recv_slot_N=recv_slot_N,
            recv_score_N=recv_score_N,
            kept_slot_S=kept_slot_S,
        )
        return rows_ND, layout.rows_per_local_expert_L, route

    def _push_and_collect(self, rows_ND: torch.Tensor, route: Route) -> torch.Tensor:
        """Push every row to its owner's landing region; return this rank's ``(T*K, D)`` landing."""
        self._before_push()
        kernels.push_rows(rows_ND, route.recv_source_N, route.recv_slot_N, route.workspace.table("landing"))
        self._barrier()
        self._landing_in_local_use = True
        return route.workspace.local("landing")[: route.kept_slot_S.shape[0]]

    def combine_rows(self, rows_ND: torch.Tensor, scores_S: torch.Tensor, route: Route) -> torch.Tensor:
        """``(T, D)``: each token's expert outputs weighted by its scores, summed over top_k."""
        landing_SD = self._push_and_collect(rows_ND, route)
        return weighted_sum_slots(landing_SD, route.kept_slot_S, scores_S.reshape(-1), route.top_k)

    def dispatch_backward(self, grad_rows_ND: torch.Tensor, route: Route) -> torch.Tensor:
        """``(T, D)`` gradient of the dispatched tokens: each token's row gradients summed."""
        landing_SD = self._push_and_collect(grad_rows_ND, route)
        return sum_slots(landing_SD, route.kept_slot_S, route.top_k, route.num_tokens)

    def combine_backward(
        self, grad_out_TD: torch.Tensor, rows_ND: torch.Tensor, route: Route
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(grad_rows_ND, grad_scores_S)`` for ``combine_rows``'s output gradient."""
        workspace = route.workspace
        num_slots = route.kept_slot_S.shape[0]
        self._before_publish()
        workspace.local("tokens")[: route.num_tokens].copy_(grad_out_TD)
        self._barrier()
        grad_rows_ND = kernels.pull_output_grad(
            workspace.table("tokens"), route.recv_source_N, route.recv_slot_N, route.recv_score_N,
            rows_ND, workspace.table("score_grad"), route.top_k,
        )
        self._barrier()
        grad_scores_S = torch.where(route.kept_slot_S >= 0, workspace.local("score_grad")[:num_slots], 0.0)
        self._landing_in_local_use = True
        return grad_rows_ND, grad_scores_S


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_S, expert_S, exchange, num_experts, top_k, routes):
        rows_ND, rows_per_local_expert_L, route = exchange.dispatch_rows(
            x_TD, scores_S, expert_S, num_experts, top_k
        )
        routes.append(route)
        ctx.route = route
        ctx.mark_non_differentiable(rows_per_local_expert_L)
        return rows_ND, rows_per_local_expert_L

    @staticmethod
    def backward(ctx, grad_rows_ND, _):
        grad_x_TD = ctx.route.exchange.dispatch_backward(grad_rows_ND.contiguous(), ctx.route)
        return grad_x_TD, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_ND, scores_S, route):
        ctx.save_for_backward(rows_ND)
        ctx.route, ctx.scores_dtype = route, scores_S.dtype
        return route.exchange.combine_rows(rows_ND, scores_S, route)

    @staticmethod
    def backward(ctx, grad_out_TD):
        (rows_ND,) = ctx.saved_tensors
        grad_rows_ND, grad_scores_S = ctx.route.exchange.combine_backward(
            grad_out_TD.to(rows_ND.dtype).contiguous(), rows_ND, ctx.route
        )
        return grad_rows_ND, grad_scores_S.to(ctx.scores_dtype), None


def dispatch(
    x_TD: torch.Tensor,
    scores_S: torch.Tensor,
    expert_S: torch.Tensor,
    group: dist.ProcessGroup,
    num_experts: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Differentiable in ``x_TD``: ``(rows_ND, rows_per_local_expert_L, route)``, rows expert-major.

    ``expert_S`` (``T*K``, token-major slots) holds global expert ids, ``num_experts`` for a
    slot the router dropped; ``scores_S`` travels with the rows for the combine's backward.
    """
    exchange = EPExchange.for_group(group, x_TD.device)
    routes: list[Route] = []
    rows_ND, rows_per_local_expert_L = _Dispatch.apply(
        x_TD.contiguous(), scores_S.detach(), expert_S, exchange, num_experts, top_k, routes
    )
    return rows_ND, rows_per_local_expert_L, routes[0]


def combine(rows_ND: torch.Tensor, scores_S: torch.Tensor, route: Route) -> torch.Tensor:
    """Differentiable in ``rows_ND`` and ``scores_S``: ``(T, D)`` weighted sum over top_k."""
    return _Combine.apply(rows_ND.contiguous(), scores_S.reshape(-1), route)
