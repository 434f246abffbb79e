"""Triton kernels that move MoE rows between ranks through memory every rank can address.

Each rank owns a workspace that every other rank can read and write (CUDA symmetric memory
over NVLink, or shared-memory files on one CPU host). The kernels address a rank's region
through a *pointer table*: an int64 tensor of ``world`` addresses, entry ``s`` being rank
``s``'s copy of the region. Slots are the routed (token, k) pairs, ``slot = t * top_k + k``.

Rows cross between ranks once per **pair** ``(source rank s, token t, destination rank r)``,
not once per slot: a token routed to three experts of rank r travels to r once and is copied
to its three expert rows there; on the way back, r sums its expert outputs for the token
(weighted by the router scores) and sends one partial sum. Pairs are indexed ``p = s * T + t``
on the destination rank.

Regions of a rank's workspace read or written here (``J = min(top_k, world)``):

- ``tokens`` ``[T, D]``: the rank's tokens (forward) or output gradient (backward).
- ``slot_expert`` ``[T*K]`` int32 (``E`` = dropped), ``slot_score`` ``[T*K]`` fp32 and
  ``slot_position`` ``[T*K]`` int32: each slot's expert, router score, and position in the
  rank's kept slots sorted by expert (stable).
- ``counts`` ``[E + 1]`` int32: kept slots per expert, then the rank's token count.
- ``landing`` ``[T*J, D]``: partial sums sent back to the token's owner, row ``t*J + j`` from
  the ``j``-th of the token's destination ranks in rank order.
- ``score_grad`` ``[T*K]`` fp32: router-score gradients sent back to the owner (computed here from
  the kept expert outputs, or by the experts for scores they applied to their rows).

Received rows are expert-major: local expert ``i``, then source rank ``s``, then the source's
slot order. Block ``g = i * world + s`` holds the rows of local expert ``i`` from rank ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels.availability import check_runnable
from torchtitan_ext.kernels.launch_configs import ROW_COPY_CONFIGS, row_copy_configs, tuned


@triton.jit
def _publish_routing_kernel(
    order_ptr,
    expert_ptr,
    scores_ptr,
    slot_expert_ptr,
    slot_score_ptr,
    slot_position_ptr,
    counts_ptr,
    num_slots,
    num_experts,
    num_tokens,
    BLOCK: tl.constexpr,
):
    """Each slot's expert, score and expert-sorted position; per-expert kept counts (zeroed)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_slots
    order = tl.load(order_ptr + offs, mask=mask, other=0)
    tl.store(slot_position_ptr + order, offs.to(tl.int32), mask=mask)
    expert = tl.load(expert_ptr + offs, mask=mask, other=num_experts)
    tl.store(slot_expert_ptr + offs, expert.to(tl.int32), mask=mask)
    tl.store(slot_score_ptr + offs, tl.load(scores_ptr + offs, mask=mask).to(tl.float32), mask=mask)
    tl.atomic_add(counts_ptr + expert, 1, mask=mask & (expert < num_experts))
    tl.store(counts_ptr + num_experts, num_tokens, mask=tl.program_id(0) == 0)


@triton.jit
def _receive_layout_kernel(
    count_ptrs,
    out_ptr,
    world,
    num_experts,
    rank,
    local,
    WORLD_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    LOCAL_P2: tl.constexpr,
):
    """One program: read every rank's counts and write this rank's receive layout (see below)."""
    source = tl.arange(0, WORLD_P2)
    expert = tl.arange(0, EXPERTS_P2)
    local_expert = tl.arange(0, LOCAL_P2)
    source_ok = source < world
    bases = tl.load(count_ptrs + source, mask=source_ok, other=0).to(tl.pointer_type(tl.int32))
    counts_all = tl.load(
        bases[:, None] + expert[None, :], mask=source_ok[:, None] & (expert[None, :] < num_experts), other=0
    ).to(tl.int64)
    before_mine = tl.sum(tl.where(expert[None, :] < rank * local, counts_all, 0), axis=1)
    mine_ok = source_ok[:, None] & (local_expert[None, :] < local)
    counts_mine = tl.load(bases[:, None] + rank * local + local_expert[None, :], mask=mine_ok, other=0).to(tl.int64)
    rows_per_local_expert = tl.sum(counts_mine, axis=0)
    expert_start = tl.cumsum(rows_per_local_expert, axis=0) - rows_per_local_expert
    block_start = expert_start[None, :] + tl.cumsum(counts_mine, axis=0) - counts_mine
    source_start = before_mine[:, None] + tl.cumsum(counts_mine, axis=1) - counts_mine
    num_blocks = local * world
    block = local_expert[None, :] * world + source[:, None]
    tl.store(out_ptr + block, block_start, mask=mine_ok)
    tl.store(out_ptr + num_blocks, tl.sum(rows_per_local_expert, axis=0))
    tl.store(out_ptr + num_blocks + 1 + block, source_start, mask=mine_ok)
    tl.store(out_ptr + 2 * num_blocks + 1 + local_expert, rows_per_local_expert, mask=local_expert < local)
    tokens = tl.load(bases + num_experts, mask=source_ok, other=0).to(tl.int64)
    tl.store(out_ptr + 2 * num_blocks + 1 + local + source, tokens, mask=source_ok)


@triton.jit
def _destination_ranks(expert, num_experts, local, WORLD_P2: tl.constexpr):
    """``[R, WORLD_P2]`` int32: 1 where rank w holds one of the row's kept experts ``expert [R, K_P2]``."""
    ranks = tl.arange(0, WORLD_P2)
    holds = (expert[:, :, None] // local == ranks[None, None, :]) & (expert[:, :, None] < num_experts)
    return tl.max(holds.to(tl.int32), axis=1)


@triton.jit
def _route_pairs_kernel(
    slot_expert_ptrs,
    slot_position_ptrs,
    slot_score_ptrs,
    block_start_ptr,
    source_start_ptr,
    recv_row_ptr,
    recv_score_ptr,
    pair_ordinal_ptr,
    num_tokens,
    num_experts,
    local,
    world,
    rank,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    WORLD_P2: tl.constexpr,
    ROWS: tl.constexpr,
):
    """For ``ROWS`` pairs: each slot's received row on this rank (-1: not here), its score,
    and the pair's ordinal among the token's destination ranks (-1: the token does not come)."""
    source, token, pairs, pair_ok = _pair_block(num_tokens, world, rank, ROWS)
    k = tl.arange(0, K_P2)
    slot_ok = pair_ok[:, None] & (k[None, :] < TOP_K)
    slots = token[:, None] * TOP_K + k[None, :]
    expert_base = tl.load(slot_expert_ptrs + source).to(tl.pointer_type(tl.int32))
    expert = tl.load(expert_base + slots, mask=slot_ok, other=num_experts)
    mine = (expert < num_experts) & (expert // local == rank)
    position_base = tl.load(slot_position_ptrs + source).to(tl.pointer_type(tl.int32))
    score_base = tl.load(slot_score_ptrs + source).to(tl.pointer_type(tl.float32))
    position = tl.load(position_base + slots, mask=mine, other=0).to(tl.int64)
    block = (expert - rank * local) * world + source
    row = (
        tl.load(block_start_ptr + block, mask=mine, other=0)
        + position
        - tl.load(source_start_ptr + block, mask=mine, other=0)
    )
    table = pairs[:, None] * TOP_K + k[None, :]
    tl.store(recv_row_ptr + table, tl.where(mine, row, -1).to(tl.int32), mask=slot_ok)
    tl.store(recv_score_ptr + table, tl.load(score_base + slots, mask=mine, other=0.0), mask=slot_ok)
    ranks = tl.arange(0, WORLD_P2)
    ordinal = tl.sum(
        tl.where(ranks[None, :] < rank, _destination_ranks(expert, num_experts, local, WORLD_P2), 0), axis=1
    )
    arrives = tl.max(mine.to(tl.int32), axis=1) > 0
    tl.store(pair_ordinal_ptr + pairs, tl.where(arrives, ordinal, -1), mask=pair_ok)


@triton.jit
def _pair_block(num_tokens, world, rank, ROWS: tl.constexpr):
    """This program's ``ROWS`` pairs: one source rank, consecutive tokens.

    Consecutive programs take consecutive source ranks, starting from ``rank + 1``, so that at
    any moment the ranks read from (or write to) every peer at once rather than all one peer.
    Returns ``(source, token [ROWS], pair [ROWS], pair_ok [ROWS])``.
    """
    program = tl.program_id(0)
    source = (program % world + rank + 1) % world
    token = (program // world).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    return source, token, source * num_tokens + token, token < num_tokens


@tuned(row_copy_configs(ROW_COPY_CONFIGS), key=["dim", "TOP_K"])
@triton.jit
def _pull_pairs_kernel(
    token_ptrs,
    recv_row_ptr,
    pair_ordinal_ptr,
    out_ptr,
    num_tokens,
    world,
    rank,
    dim,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``ROWS`` pairs: read the token's row from its owner once, write it to each of its rows here."""
    source, token, pairs, pair_ok = _pair_block(num_tokens, world, rank, ROWS)
    arrives = tl.load(pair_ordinal_ptr + pairs, mask=pair_ok, other=-1) >= 0
    token_base = tl.load(token_ptrs + source).to(tl.pointer_type(out_ptr.dtype.element_ty))
    source_rows = token_base + token * dim
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        col_ok = offs[None, :] < dim
        tile = tl.load(source_rows[:, None] + offs[None, :], mask=arrives[:, None] & col_ok)
        for k in tl.static_range(TOP_K):
            row = tl.load(recv_row_ptr + pairs * TOP_K + k, mask=arrives, other=-1).to(tl.int64)
            tl.store(out_ptr + row[:, None] * dim + offs[None, :], tile, mask=(row >= 0)[:, None] & col_ok)


@tuned(row_copy_configs(ROW_COPY_CONFIGS), key=["dim", "TOP_K", "WEIGHTED"])
@triton.jit
def _push_pairs_kernel(
    rows_ptr,
    recv_row_ptr,
    recv_score_ptr,
    pair_ordinal_ptr,
    landing_ptrs,
    num_tokens,
    world,
    rank,
    dim,
    TOP_K: tl.constexpr,
    SLOTS_PER_TOKEN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``ROWS`` pairs: sum the pair's rows here (times their scores if ``WEIGHTED``, fp32) and
    write the sum to the owner's ``landing`` row ``t * SLOTS_PER_TOKEN + ordinal``."""
    source, token, pairs, pair_ok = _pair_block(num_tokens, world, rank, ROWS)
    ordinal = tl.load(pair_ordinal_ptr + pairs, mask=pair_ok, other=-1).to(tl.int64)
    arrives = ordinal >= 0
    landing_base = tl.load(landing_ptrs + source).to(tl.pointer_type(rows_ptr.dtype.element_ty))
    destination_rows = landing_base + (token * SLOTS_PER_TOKEN + ordinal) * dim
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        col_ok = offs[None, :] < dim
        total = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            row = tl.load(recv_row_ptr + pairs * TOP_K + k, mask=arrives, other=-1).to(tl.int64)
            hit = row >= 0
            tile = tl.load(rows_ptr + row[:, None] * dim + offs[None, :], mask=hit[:, None] & col_ok, other=0.0)
            if WEIGHTED:
                total += tile.to(tl.float32) * tl.load(recv_score_ptr + pairs * TOP_K + k, mask=hit, other=0.0)[:, None]
            else:
                total += tile.to(tl.float32)
        tl.store(
            destination_rows[:, None] + offs[None, :],
            total.to(rows_ptr.dtype.element_ty),
            mask=arrives[:, None] & col_ok,
        )


@tuned(row_copy_configs(ROW_COPY_CONFIGS), key=["dim", "TOP_K"])
@triton.jit
def _sum_landing_kernel(
    landing_ptr,
    expert_ptr,
    out_ptr,
    num_tokens,
    num_experts,
    local,
    dim,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    WORLD_P2: tl.constexpr,
    SLOTS_PER_TOKEN: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``ROWS`` tokens of the owner: ``out[t] = sum_j landing[t * J + j]`` over the token's
    destination ranks (fp32); a token with every slot dropped gets zeros."""
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    token_ok = tokens < num_tokens
    k = tl.arange(0, K_P2)
    expert = tl.load(
        expert_ptr + tokens[:, None] * TOP_K + k[None, :],
        mask=token_ok[:, None] & (k[None, :] < TOP_K),
        other=num_experts,
    )
    arrivals = tl.sum(_destination_ranks(expert, num_experts, local, WORLD_P2), axis=1)
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        col_ok = offs[None, :] < dim
        total = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(SLOTS_PER_TOKEN):
            landing_rows = landing_ptr + (tokens * SLOTS_PER_TOKEN + j) * dim
            ok = token_ok & (j < arrivals)
            total += tl.load(landing_rows[:, None] + offs[None, :], mask=ok[:, None] & col_ok, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + tokens[:, None] * dim + offs[None, :],
            total.to(out_ptr.dtype.element_ty),
            mask=token_ok[:, None] & col_ok,
        )


@tuned(row_copy_configs(ROW_COPY_CONFIGS), key=["dim", "TOP_K"])
@triton.jit
def _pull_output_grad_kernel(
    token_ptrs,
    recv_row_ptr,
    recv_score_ptr,
    pair_ordinal_ptr,
    rows_ptr,
    grad_rows_ptr,
    score_grad_ptrs,
    num_tokens,
    world,
    rank,
    dim,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Backward of the weighted combine for ``ROWS`` pairs: read ``g = grad_out_s[t]`` once; for
    each of the pair's rows, ``grad_rows[row] = score * g`` and ``score_grad_s[slot] = <g, rows[row]>``."""
    source, token, pairs, pair_ok = _pair_block(num_tokens, world, rank, ROWS)
    arrives = tl.load(pair_ordinal_ptr + pairs, mask=pair_ok, other=-1) >= 0
    grad_base = tl.load(token_ptrs + source).to(tl.pointer_type(grad_rows_ptr.dtype.element_ty))
    k_index = tl.arange(0, K_P2)
    dots = tl.zeros([ROWS, K_P2], dtype=tl.float32)
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        col_ok = offs[None, :] < dim
        grad = tl.load(grad_base + token[:, None] * dim + offs[None, :], mask=arrives[:, None] & col_ok, other=0.0)
        grad = grad.to(tl.float32)
        for k in tl.static_range(TOP_K):
            row = tl.load(recv_row_ptr + pairs * TOP_K + k, mask=arrives, other=-1).to(tl.int64)
            hit = row >= 0
            score = tl.load(recv_score_ptr + pairs * TOP_K + k, mask=hit, other=0.0)
            mask = hit[:, None] & col_ok
            output = tl.load(rows_ptr + row[:, None] * dim + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            dots += tl.where(k_index[None, :] == k, tl.sum(grad * output, axis=1)[:, None], 0.0)
            tl.store(
                grad_rows_ptr + row[:, None] * dim + offs[None, :],
                (grad * score[:, None]).to(grad_rows_ptr.dtype.element_ty),
                mask=mask,
            )
    table = pairs[:, None] * TOP_K + k_index[None, :]
    rows_here = tl.load(recv_row_ptr + table, mask=arrives[:, None] & (k_index[None, :] < TOP_K), other=-1)
    score_grad_base = tl.load(score_grad_ptrs + source).to(tl.pointer_type(tl.float32))
    tl.store(score_grad_base + token[:, None] * TOP_K + k_index[None, :], dots, mask=rows_here >= 0)


@triton.jit
def _push_score_grads_kernel(
    grad_ptr,
    recv_row_ptr,
    pair_ordinal_ptr,
    score_grad_ptrs,
    num_tokens,
    world,
    rank,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    ROWS: tl.constexpr,
):
    """``ROWS`` pairs: each slot's score gradient, found at its received row, written to the owner's
    ``score_grad`` at the slot."""
    source, token, pairs, pair_ok = _pair_block(num_tokens, world, rank, ROWS)
    arrives = tl.load(pair_ordinal_ptr + pairs, mask=pair_ok, other=-1) >= 0
    k_index = tl.arange(0, K_P2)
    table = pairs[:, None] * TOP_K + k_index[None, :]
    rows_here = tl.load(recv_row_ptr + table, mask=arrives[:, None] & (k_index[None, :] < TOP_K), other=-1)
    here = rows_here >= 0
    grads = tl.load(grad_ptr + rows_here.to(tl.int64), mask=here, other=0.0)
    score_grad_base = tl.load(score_grad_ptrs + source).to(tl.pointer_type(tl.float32))
    tl.store(score_grad_base + token[:, None] * TOP_K + k_index[None, :], grads, mask=here)


def publish_routing(
    order_S: torch.Tensor,
    expert_S: torch.Tensor,
    scores_S: torch.Tensor,
    slot_expert: torch.Tensor,
    slot_score: torch.Tensor,
    slot_position: torch.Tensor,
    counts: torch.Tensor,
    num_experts: int,
    num_tokens: int,
) -> None:
    """Fill this rank's routing regions; ``order_S`` is the slots' stable expert-sorted order."""
    check_runnable(order_S, expert_S, scores_S, slot_expert, slot_score, slot_position, counts)
    counts.zero_()
    num_slots = order_S.shape[0]
    block = 1024
    _publish_routing_kernel[(max(1, triton.cdiv(num_slots, block)),)](
        order_S,
        expert_S,
        scores_S,
        slot_expert,
        slot_score,
        slot_position,
        counts,
        num_slots,
        num_experts,
        num_tokens,
        BLOCK=block,
    )


@dataclass(frozen=True, kw_only=True)
class ReceiveLayout:
    """Where a rank's received rows come from: views of one int64 buffer (device or host)."""

    packed: torch.Tensor
    block_start_G1: torch.Tensor
    """``(L*W + 1,)`` first received row of block ``b = l * W + s``; last entry = rows received"""
    source_start_G: torch.Tensor
    """``(L*W,)`` where block ``b``'s entries start in rank ``s``'s sorted slot list"""
    rows_per_local_expert_e: torch.Tensor
    """``(L,)`` rows received for each local expert"""
    tokens_per_rank_W: torch.Tensor
    """``(W,)`` every rank's token count"""

    @classmethod
    def unpack(cls, packed: torch.Tensor, local: int, world: int) -> ReceiveLayout:
        blocks = local * world
        return cls(
            packed=packed,
            block_start_G1=packed[: blocks + 1],
            source_start_G=packed[blocks + 1 : 2 * blocks + 1],
            rows_per_local_expert_e=packed[2 * blocks + 1 : 2 * blocks + 1 + local],
            tokens_per_rank_W=packed[2 * blocks + 1 + local :],
        )


def receive_layout(count_ptrs_W: torch.Tensor, num_experts: int, rank: int, like: torch.Tensor) -> ReceiveLayout:
    """Expert-major layout of the rows ``rank`` receives, from every rank's ``counts`` region."""
    check_runnable(count_ptrs_W, like)
    world = count_ptrs_W.shape[0]
    local = num_experts // world
    packed = torch.empty(2 * local * world + 1 + local + world, dtype=torch.int64, device=like.device)
    _receive_layout_kernel[(1,)](
        count_ptrs_W,
        packed,
        world,
        num_experts,
        rank,
        local,
        WORLD_P2=triton.next_power_of_2(world),
        EXPERTS_P2=triton.next_power_of_2(num_experts),
        LOCAL_P2=triton.next_power_of_2(local),
    )
    return ReceiveLayout.unpack(packed, local, world)


def _row_blocks_grid(num_tokens: int, world: int):
    """``world`` programs per block of ``ROWS`` tokens (one per source rank)."""
    return lambda meta: (world * triton.cdiv(num_tokens, meta["ROWS"]),)


@dataclass(frozen=True, kw_only=True)
class PairTable:
    """This rank's view of every pair ``p = s * T + t`` (device tensors)."""

    rank: int
    num_tokens: int
    top_k: int
    recv_row_PK: torch.Tensor
    """``(W*T, K)`` int32 received row of slot ``t*K+k`` of rank ``s``; -1 where it is not here
    (``(W*T, 1)`` for ``one_row_per_pair``)"""
    recv_score_PK: torch.Tensor
    """``(W*T, K)`` fp32 that slot's router score (0 where it is not here)"""
    ordinal_P: torch.Tensor
    """``(W*T,)`` int32 this rank's index among the token's destination ranks; -1: none here"""

    def one_row_per_pair(self) -> PairTable:
        """The table whose rows are the pairs themselves (``pair_rows``), as a buffer of one row per
        pair is laid out."""
        return PairTable(
            rank=self.rank,
            num_tokens=self.num_tokens,
            top_k=self.top_k,
            recv_row_PK=pair_rows(self.ordinal_P),
            recv_score_PK=self.recv_score_PK,
            ordinal_P=self.ordinal_P,
        )


def pair_rows(ordinal_P: torch.Tensor) -> torch.Tensor:
    """``(W*T, 1)`` int32: row ``p`` for each pair ``p`` arriving here, -1 for the others."""
    pair_P = torch.arange(ordinal_P.shape[0], dtype=torch.int32, device=ordinal_P.device)
    return torch.where(ordinal_P >= 0, pair_P, -1).unsqueeze(1)


def route_pairs(
    slot_expert_ptrs_W: torch.Tensor,
    slot_position_ptrs_W: torch.Tensor,
    slot_score_ptrs_W: torch.Tensor,
    layout: ReceiveLayout,
    rank: int,
    num_tokens: int,
    top_k: int,
    num_experts: int,
) -> PairTable:
    """Read every rank's routing and build this rank's ``PairTable``."""
    check_runnable(slot_expert_ptrs_W, layout.packed)
    world = slot_expert_ptrs_W.shape[0]
    device = layout.packed.device
    num_pairs = world * num_tokens
    table = PairTable(
        rank=rank,
        num_tokens=num_tokens,
        top_k=top_k,
        recv_row_PK=torch.empty(num_pairs, top_k, dtype=torch.int32, device=device),
        recv_score_PK=torch.empty(num_pairs, top_k, dtype=torch.float32, device=device),
        ordinal_P=torch.empty(num_pairs, dtype=torch.int32, device=device),
    )
    if num_pairs:
        _route_pairs_kernel[_row_blocks_grid(num_tokens, world)](
            slot_expert_ptrs_W,
            slot_position_ptrs_W,
            slot_score_ptrs_W,
            layout.block_start_G1,
            layout.source_start_G,
            table.recv_row_PK,
            table.recv_score_PK,
            table.ordinal_P,
            num_tokens,
            num_experts,
            num_experts // world,
            world,
            rank,
            TOP_K=top_k,
            K_P2=triton.next_power_of_2(top_k),
            WORLD_P2=triton.next_power_of_2(world),
            ROWS=64,
        )
    return table


def pull_pairs(token_ptrs_W: torch.Tensor, pairs: PairTable, out_RD: torch.Tensor) -> None:
    """Fill ``out_RD`` (expert-major received rows) from the owners' ``tokens`` regions."""
    check_runnable(token_ptrs_W, pairs.recv_row_PK, out_RD)
    if out_RD.shape[0]:
        world = token_ptrs_W.shape[0]
        _pull_pairs_kernel[_row_blocks_grid(pairs.num_tokens, world)](
            token_ptrs_W,
            pairs.recv_row_PK,
            pairs.ordinal_P,
            out_RD,
            pairs.num_tokens,
            world,
            pairs.rank,
            out_RD.shape[1],
            TOP_K=pairs.recv_row_PK.shape[1],
        )


def slots_per_token(top_k: int, world: int) -> int:
    """Landing rows per token: a token reaches at most ``min(top_k, world)`` ranks."""
    return min(top_k, world)


def push_pairs(rows_RD: torch.Tensor, pairs: PairTable, landing_ptrs_W: torch.Tensor, weighted: bool) -> None:
    """Send each pair's (score-weighted if ``weighted``) row sum to its owner's ``landing``."""
    check_runnable(rows_RD, pairs.recv_row_PK, landing_ptrs_W)
    if weighted and pairs.recv_row_PK.shape[1] != pairs.top_k:
        raise ValueError("push_pairs: weighting by the router scores needs the slot table (one column per slot)")
    rows_RD = rows_RD.contiguous()
    if rows_RD.shape[0]:
        world = landing_ptrs_W.shape[0]
        _push_pairs_kernel[_row_blocks_grid(pairs.num_tokens, world)](
            rows_RD,
            pairs.recv_row_PK,
            pairs.recv_score_PK,
            pairs.ordinal_P,
            landing_ptrs_W,
            pairs.num_tokens,
            world,
            pairs.rank,
            rows_RD.shape[1],
            TOP_K=pairs.recv_row_PK.shape[1],
            SLOTS_PER_TOKEN=slots_per_token(pairs.top_k, world),
            WEIGHTED=weighted,
        )


def sum_landing(
    landing_JD: torch.Tensor, expert_S: torch.Tensor, num_experts: int, world: int, top_k: int
) -> torch.Tensor:
    """``(T, D)``: each token's partial sums from its destination ranks, added (fp32)."""
    check_runnable(landing_JD, expert_S)
    num_tokens = expert_S.shape[0] // top_k
    dim = landing_JD.shape[1]
    out_TD = landing_JD.new_empty(num_tokens, dim)
    if num_tokens:
        _sum_landing_kernel[_row_blocks_grid(num_tokens, 1)](
            landing_JD,
            expert_S.contiguous(),
            out_TD,
            num_tokens,
            num_experts,
            num_experts // world,
            dim,
            TOP_K=top_k,
            K_P2=triton.next_power_of_2(top_k),
            WORLD_P2=triton.next_power_of_2(world),
            SLOTS_PER_TOKEN=slots_per_token(top_k, world),
        )
    return out_TD


def pull_output_grad(
    token_ptrs_W: torch.Tensor,
    pairs: PairTable,
    rows_RD: torch.Tensor,
    score_grad_ptrs_W: torch.Tensor,
) -> torch.Tensor:
    """Return ``grad_rows_RD`` (the rows no pair received unset); write each row's router-score
    gradient to its owner's ``score_grad``."""
    check_runnable(token_ptrs_W, pairs.recv_row_PK, rows_RD, score_grad_ptrs_W)
    rows_RD = rows_RD.contiguous()
    grad_rows_RD = torch.empty_like(rows_RD)
    if rows_RD.shape[0]:
        world = token_ptrs_W.shape[0]
        _pull_output_grad_kernel[_row_blocks_grid(pairs.num_tokens, world)](
            token_ptrs_W,
            pairs.recv_row_PK,
            pairs.recv_score_PK,
            pairs.ordinal_P,
            rows_RD,
            grad_rows_RD,
            score_grad_ptrs_W,
            pairs.num_tokens,
            world,
            pairs.rank,
            rows_RD.shape[1],
            TOP_K=pairs.top_k,
            K_P2=triton.next_power_of_2(pairs.top_k),
        )
    return grad_rows_RD


def push_score_grads(grad_scores_R: torch.Tensor, pairs: PairTable, score_grad_ptrs_W: torch.Tensor) -> None:
    """Send the gradient of each received row's score (``grad_scores_R``, fp32, one per expert row)
    to the slot's owner's ``score_grad``."""
    check_runnable(grad_scores_R, pairs.recv_row_PK, score_grad_ptrs_W)
    if pairs.recv_row_PK.shape[1] != pairs.top_k:
        raise ValueError("push_score_grads: needs the slot table (one column per slot)")
    world = score_grad_ptrs_W.shape[0]
    if pairs.num_tokens and grad_scores_R.shape[0]:
        _push_score_grads_kernel[_row_blocks_grid(pairs.num_tokens, world)](
            grad_scores_R.float().contiguous(),
            pairs.recv_row_PK,
            pairs.ordinal_P,
            score_grad_ptrs_W,
            pairs.num_tokens,
            world,
            pairs.rank,
            TOP_K=pairs.top_k,
            K_P2=triton.next_power_of_2(pairs.top_k),
            ROWS=64,
        )
