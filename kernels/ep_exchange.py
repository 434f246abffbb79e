"""Triton kernels that move MoE rows between ranks through memory every rank can address.

Each rank owns a workspace that every other rank can read and write (CUDA symmetric memory
over NVLink, or shared-memory files on one CPU host). The kernels address a rank's region
through a *pointer table*: an int64 tensor of ``world`` addresses, entry ``s`` being rank
``s``'s copy of the region. Slots are the routed (token, k) pairs, ``slot = t * top_k + k``.

Regions of a rank's workspace read or written here:

- ``tokens`` ``[T, D]``: the rank's tokens (forward) or output gradient (backward).
- ``sorted_slot`` ``[T*K]`` int32 / ``sorted_score`` ``[T*K]`` fp32: the rank's kept slots
  sorted by expert (stable), and their router scores.
- ``counts`` ``[E + 1]`` int32: kept slots per expert, then the rank's token count.
- ``landing`` ``[T*K, D]``: expert outputs (or row gradients) pushed back to the token's owner,
  one row per slot.
- ``score_grad`` ``[T*K]`` fp32: router-score gradients pushed back to the owner.

Received rows are expert-major: local expert ``l``, then source rank ``s``, then the source's
slot order. Block ``b = l * world + s`` holds the rows of local expert ``l`` from rank ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels._runtime import ROW_COPY_CONFIGS, check_runnable, row_block_d, row_copy_configs



@triton.jit
def _publish_routing_kernel(
    order_ptr, expert_ptr, scores_ptr, sorted_slot_ptr, sorted_score_ptr, counts_ptr, kept_slot_ptr,
    num_slots, num_experts, num_tokens, BLOCK: tl.constexpr,
):
    """Sorted slot ids and their scores; per-expert counts of kept slots (``counts`` zeroed);
    ``kept_slot[s]`` = s for a kept slot, -1 for a dropped one."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_slots
    order = tl.load(order_ptr + offs, mask=mask, other=0)
    tl.store(sorted_slot_ptr + offs, order.to(tl.int32), mask=mask)
    tl.store(sorted_score_ptr + offs, tl.load(scores_ptr + order, mask=mask).to(tl.float32), mask=mask)
    expert = tl.load(expert_ptr + offs, mask=mask, other=num_experts)
    kept = expert < num_experts
    tl.atomic_add(counts_ptr + expert, 1, mask=mask & kept)
    tl.store(kept_slot_ptr + offs, tl.where(kept, offs.to(tl.int64), -1), mask=mask)
    tl.store(counts_ptr + num_experts, num_tokens, mask=tl.program_id(0) == 0)


@triton.jit
def _receive_layout_kernel(
    count_ptrs, out_ptr, world, num_experts, rank, local,
    WORLD_P2: tl.constexpr, EXPERTS_P2: tl.constexpr, LOCAL_P2: tl.constexpr,
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


@triton.autotune(configs=row_copy_configs(ROW_COPY_CONFIGS), key=["dim"])
@triton.jit
def _pull_rows_kernel(
    token_ptrs, sorted_slot_ptrs, sorted_score_ptrs, block_start_ptr, source_start_ptr,
    out_ptr, recv_source_ptr, recv_slot_ptr, recv_score_ptr,
    num_rows, num_blocks, world, top_k, dim,
    SEARCH_TOP: tl.constexpr, SEARCH_STEPS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``ROWS`` received rows: find each one's block, read the source's slot, copy the token's row."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    block = tl.zeros([ROWS], dtype=tl.int64)
    for i in tl.static_range(SEARCH_STEPS):  # largest block whose start is <= row
        candidate = block + (SEARCH_TOP >> i)
        in_range = (candidate < num_blocks) & row_ok
        start = tl.load(block_start_ptr + candidate, mask=in_range, other=0)
        block = tl.where(in_range & (start <= rows), candidate, block)
    source = block % world
    position = (
        tl.load(source_start_ptr + block, mask=row_ok, other=0)
        + rows - tl.load(block_start_ptr + block, mask=row_ok, other=0)
    )
    slot_bases = tl.load(sorted_slot_ptrs + source, mask=row_ok, other=0).to(tl.pointer_type(tl.int32))
    score_bases = tl.load(sorted_score_ptrs + source, mask=row_ok, other=0).to(tl.pointer_type(tl.float32))
    token_bases = tl.load(token_ptrs + source, mask=row_ok, other=0).to(tl.pointer_type(out_ptr.dtype.element_ty))
    slot = tl.load(slot_bases + position, mask=row_ok, other=0)
    source_rows = token_bases + (slot // top_k).to(tl.int64) * dim
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (offs[None, :] < dim)
        tile = tl.load(source_rows[:, None] + offs[None, :], mask=mask)
        tl.store(out_ptr + rows[:, None] * dim + offs[None, :], tile, mask=mask)
    tl.store(recv_source_ptr + rows, source.to(tl.int32), mask=row_ok)
    tl.store(recv_slot_ptr + rows, slot, mask=row_ok)
    tl.store(recv_score_ptr + rows, tl.load(score_bases + position, mask=row_ok, other=0.0), mask=row_ok)


@triton.autotune(configs=row_copy_configs(ROW_COPY_CONFIGS), key=["dim"])
@triton.jit
def _push_rows_kernel(
    rows_ptr, recv_source_ptr, recv_slot_ptr, landing_ptrs, num_rows, dim,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``ROWS`` rows, each to its source rank's ``landing`` region at its slot."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    source = tl.load(recv_source_ptr + rows, mask=row_ok, other=0)
    slot = tl.load(recv_slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    bases = tl.load(landing_ptrs + source, mask=row_ok, other=0).to(tl.pointer_type(rows_ptr.dtype.element_ty))
    destination_rows = bases + slot * dim
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (offs[None, :] < dim)
        tile = tl.load(rows_ptr + rows[:, None] * dim + offs[None, :], mask=mask)
        tl.store(destination_rows[:, None] + offs[None, :], tile, mask=mask)


@triton.jit
def _pull_output_grad_kernel(
    token_ptrs, recv_source_ptr, recv_slot_ptr, recv_score_ptr, rows_ptr, grad_rows_ptr,
    score_grad_ptrs, dim, top_k, BLOCK_D: tl.constexpr,
):
    """Backward of the weighted combine for received row ``row`` (slot ``t*K+k`` of rank s).

    ``grad_rows[row] = score * grad_out_s[t]`` and ``score_grad_s[slot] = <grad_out_s[t], rows[row]>``.
    """
    row = tl.program_id(0).to(tl.int64)
    source = tl.load(recv_source_ptr + row)
    slot = tl.load(recv_slot_ptr + row).to(tl.int64)
    score = tl.load(recv_score_ptr + row).to(tl.float32)
    token = slot // top_k
    base = tl.load(token_ptrs + source).to(tl.pointer_type(grad_rows_ptr.dtype.element_ty))
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = offs < dim
        grad_out = tl.load(base + token * dim + offs, mask=mask, other=0.0).to(tl.float32)
        output = tl.load(rows_ptr + row * dim + offs, mask=mask, other=0.0).to(tl.float32)
        dot += grad_out * output
        tl.store(grad_rows_ptr + row * dim + offs, (grad_out * score).to(grad_rows_ptr.dtype.element_ty), mask=mask)
    score_grad_base = tl.load(score_grad_ptrs + source).to(tl.pointer_type(tl.float32))
    tl.store(score_grad_base + slot, tl.sum(dot, axis=0))


def publish_routing(
    order_S: torch.Tensor,
    expert_S: torch.Tensor,
    scores_S: torch.Tensor,
    sorted_slot: torch.Tensor,
    sorted_score: torch.Tensor,
    counts: torch.Tensor,
    num_experts: int,
    num_tokens: int,
) -> torch.Tensor:
    """Fill this rank's routing regions from the slots' expert-sorted order ``order_S``.

    Returns ``kept_slot_S`` (int64): the slot index of each kept slot, -1 for dropped ones.
    """
    check_runnable(order_S, expert_S, scores_S, sorted_slot, sorted_score, counts)
    counts.zero_()
    num_slots = order_S.shape[0]
    kept_slot_S = torch.empty(num_slots, dtype=torch.int64, device=order_S.device)
    block = 1024
    _publish_routing_kernel[(max(1, triton.cdiv(num_slots, block)),)](
        order_S, expert_S, scores_S, sorted_slot, sorted_score, counts, kept_slot_S, num_slots, num_experts,
        num_tokens, BLOCK=block,
    )
    return kept_slot_S


@dataclass(frozen=True, kw_only=True)
class ReceiveLayout:
    """Where a rank's received rows come from: views of one int64 buffer (device or host)."""

    packed: torch.Tensor
    block_start_B1: torch.Tensor
    """``(L*W + 1,)`` first received row of block ``b = l * W + s``; last entry = rows received"""
    source_start_B: torch.Tensor
    """``(L*W,)`` where block ``b``'s entries start in rank ``s``'s sorted slot list"""
    rows_per_local_expert_L: torch.Tensor
    """``(L,)`` rows received for each local expert"""
    tokens_per_rank_W: torch.Tensor
    """``(W,)`` every rank's token count"""

    @classmethod
    def unpack(cls, packed: torch.Tensor, local: int, world: int) -> ReceiveLayout:
        blocks = local * world
        return cls(
            packed=packed,
            block_start_B1=packed[: blocks + 1],
            source_start_B=packed[blocks + 1: 2 * blocks + 1],
            rows_per_local_expert_L=packed[2 * blocks + 1: 2 * blocks + 1 + local],
            tokens_per_rank_W=packed[2 * blocks + 1 + local:],
        )


def receive_layout(count_ptrs_W: torch.Tensor, num_experts: int, rank: int, like: torch.Tensor) -> ReceiveLayout:
    """Expert-major layout of the rows ``rank`` receives, from every rank's ``counts`` region."""
    check_runnable(count_ptrs_W, like)
    world = count_ptrs_W.shape[0]
    local = num_experts // world
    packed = torch.empty(2 * local * world + 1 + local + world, dtype=torch.int64, device=like.device)
    _receive_layout_kernel[(1,)](
        count_ptrs_W, packed, world, num_experts, rank, local,
        WORLD_P2=triton.next_power_of_2(world), EXPERTS_P2=triton.next_power_of_2(num_experts),
        LOCAL_P2=triton.next_power_of_2(local),
    )
    return ReceiveLayout.unpack(packed, local, world)


def pull_rows(
    token_ptrs_W: torch.Tensor,
    sorted_slot_ptrs_W: torch.Tensor,
    sorted_score_ptrs_W: torch.Tensor,
    layout: ReceiveLayout,
    out_ND: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill ``out_ND`` (expert-major received rows); return their source rank, slot and score."""
    check_runnable(token_ptrs_W, layout.packed, out_ND)
    num_rows, dim = out_ND.shape
    world, num_blocks = token_ptrs_W.shape[0], layout.source_start_B.shape[0]
    recv_source_N = torch.empty(num_rows, dtype=torch.int32, device=out_ND.device)
    recv_slot_N = torch.empty(num_rows, dtype=torch.int32, device=out_ND.device)
    recv_score_N = torch.empty(num_rows, dtype=torch.float32, device=out_ND.device)
    if num_rows:
        search_top = triton.next_power_of_2(num_blocks) // 2 or 1
        _pull_rows_kernel[lambda meta: (triton.cdiv(num_rows, meta["ROWS"]),)](
            token_ptrs_W, sorted_slot_ptrs_W, sorted_score_ptrs_W, layout.block_start_B1, layout.source_start_B,
            out_ND, recv_source_N, recv_slot_N, recv_score_N, num_rows, num_blocks, world, top_k, dim,
            SEARCH_TOP=search_top, SEARCH_STEPS=search_top.bit_length(),
        )
    return recv_source_N, recv_slot_N, recv_score_N


def push_rows(
    rows_ND: torch.Tensor, recv_source_N: torch.Tensor, recv_slot_N: torch.Tensor, landing_ptrs_W: torch.Tensor
) -> None:
    """Write each received row back into its source rank's ``landing`` region at its slot."""
    check_runnable(rows_ND, recv_source_N, recv_slot_N, landing_ptrs_W)
    rows_ND = rows_ND.contiguous()
    num_rows, dim = rows_ND.shape
    if num_rows:
        _push_rows_kernel[lambda meta: (triton.cdiv(num_rows, meta["ROWS"]),)](
            rows_ND, recv_source_N, recv_slot_N, landing_ptrs_W, num_rows, dim
        )


def pull_output_grad(
    token_ptrs_W: torch.Tensor,
    recv_source_N: torch.Tensor,
    recv_slot_N: torch.Tensor,
    recv_score_N: torch.Tensor,
    rows_ND: torch.Tensor,
    score_grad_ptrs_W: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Return ``grad_rows_ND``; push each row's router-score gradient to its source rank."""
    check_runnable(token_ptrs_W, recv_source_N, rows_ND, score_grad_ptrs_W)
    rows_ND = rows_ND.contiguous()
    grad_rows_ND = torch.empty_like(rows_ND)
    if rows_ND.shape[0]:
        _pull_output_grad_kernel[(rows_ND.shape[0],)](
            token_ptrs_W, recv_source_N, recv_slot_N, recv_score_N, rows_ND, grad_rows_ND,
            score_grad_ptrs_W, rows_ND.shape[1], top_k, BLOCK_D=row_block_d(rows_ND.shape[1]),
        )
    return grad_rows_ND
