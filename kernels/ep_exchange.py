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

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels._runtime import check_runnable


def _block_d(dim: int) -> int:
    return min(1024, triton.next_power_of_2(dim))


@triton.jit
def _gather_counts_kernel(count_ptrs, out_ptr, num_entries, BLOCK: tl.constexpr):
    """out[s, :] = rank s's ``counts`` region."""
    source = tl.program_id(0)
    base = tl.load(count_ptrs + source).to(tl.pointer_type(out_ptr.dtype.element_ty))
    for start in range(0, num_entries, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_entries
        tl.store(out_ptr + source * num_entries + offs, tl.load(base + offs, mask=mask), mask=mask)


@triton.jit
def _pull_rows_kernel(
    token_ptrs, sorted_slot_ptrs, sorted_score_ptrs, block_start_ptr, source_start_ptr,
    out_ptr, recv_source_ptr, recv_slot_ptr, recv_score_ptr,
    num_blocks, world, top_k, dim,
    SEARCH_TOP: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Received row ``row``: find its block, read the source's slot, copy the token's row."""
    row = tl.program_id(0).to(tl.int64)
    block = row * 0
    for i in tl.static_range(SEARCH_STEPS):  # largest block whose start is <= row
        candidate = block + (SEARCH_TOP >> i)
        in_range = candidate < num_blocks
        start = tl.load(block_start_ptr + candidate, mask=in_range, other=row + 1)
        block = tl.where(in_range & (start <= row), candidate, block)
    source = block % world
    position = tl.load(source_start_ptr + block) + row - tl.load(block_start_ptr + block)
    slot_base = tl.load(sorted_slot_ptrs + source).to(tl.pointer_type(tl.int32))
    score_base = tl.load(sorted_score_ptrs + source).to(tl.pointer_type(tl.float32))
    token_base = tl.load(token_ptrs + source).to(tl.pointer_type(out_ptr.dtype.element_ty))
    slot = tl.load(slot_base + position)
    token = (slot // top_k).to(tl.int64)
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = offs < dim
        tl.store(out_ptr + row * dim + offs, tl.load(token_base + token * dim + offs, mask=mask), mask=mask)
    tl.store(recv_source_ptr + row, source.to(tl.int32))
    tl.store(recv_slot_ptr + row, slot)
    tl.store(recv_score_ptr + row, tl.load(score_base + position))


@triton.jit
def _push_rows_kernel(rows_ptr, recv_source_ptr, recv_slot_ptr, landing_ptrs, dim, BLOCK_D: tl.constexpr):
    """Row ``row`` goes to its source rank's ``landing`` region, at its slot."""
    row = tl.program_id(0).to(tl.int64)
    source = tl.load(recv_source_ptr + row)
    slot = tl.load(recv_slot_ptr + row).to(tl.int64)
    base = tl.load(landing_ptrs + source).to(tl.pointer_type(rows_ptr.dtype.element_ty))
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = offs < dim
        tl.store(base + slot * dim + offs, tl.load(rows_ptr + row * dim + offs, mask=mask), mask=mask)


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


def gather_counts(count_ptrs_W: torch.Tensor, num_entries: int, like: torch.Tensor) -> torch.Tensor:
    """``(W, num_entries)`` int32: every rank's ``counts`` region; ``like`` names the device."""
    check_runnable(count_ptrs_W, like)
    world = count_ptrs_W.shape[0]
    out = torch.empty(world, num_entries, dtype=torch.int32, device=like.device)
    _gather_counts_kernel[(world,)](count_ptrs_W, out, num_entries, BLOCK=triton.next_power_of_2(num_entries))
    return out


def pull_rows(
    token_ptrs_W: torch.Tensor,
    sorted_slot_ptrs_W: torch.Tensor,
    sorted_score_ptrs_W: torch.Tensor,
    block_start_B1: torch.Tensor,
    source_start_B: torch.Tensor,
    out_ND: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill ``out_ND`` (expert-major received rows); return their source rank, slot and score.

    ``block_start_B1`` (int64, ``B + 1`` entries, last = N) is where each block starts in
    ``out_ND``; ``source_start_B`` is where the block's entries start in the source's sorted lists.
    """
    check_runnable(token_ptrs_W, block_start_B1, source_start_B, out_ND)
    num_rows, dim = out_ND.shape
    world, num_blocks = token_ptrs_W.shape[0], source_start_B.shape[0]
    recv_source_N = torch.empty(num_rows, dtype=torch.int32, device=out_ND.device)
    recv_slot_N = torch.empty(num_rows, dtype=torch.int32, device=out_ND.device)
    recv_score_N = torch.empty(num_rows, dtype=torch.float32, device=out_ND.device)
    if num_rows:
        search_top = triton.next_power_of_2(num_blocks) // 2 or 1
        _pull_rows_kernel[(num_rows,)](
            token_ptrs_W, sorted_slot_ptrs_W, sorted_score_ptrs_W, block_start_B1, source_start_B,
            out_ND, recv_source_N, recv_slot_N, recv_score_N, num_blocks, world, top_k, dim,
            SEARCH_TOP=search_top, SEARCH_STEPS=search_top.bit_length(), BLOCK_D=_block_d(dim),
        )
    return recv_source_N, recv_slot_N, recv_score_N


def push_rows(
    rows_ND: torch.Tensor, recv_source_N: torch.Tensor, recv_slot_N: torch.Tensor, landing_ptrs_W: torch.Tensor
) -> None:
    """Write each received row back into its source rank's ``landing`` region at its slot."""
    check_runnable(rows_ND, recv_source_N, recv_slot_N, landing_ptrs_W)
    rows_ND = rows_ND.contiguous()
    if rows_ND.shape[0]:
        _push_rows_kernel[(rows_ND.shape[0],)](
            rows_ND, recv_source_N, recv_slot_N, landing_ptrs_W, rows_ND.shape[1], BLOCK_D=_block_d(rows_ND.shape[1])
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
            score_grad_ptrs_W, rows_ND.shape[1], top_k, BLOCK_D=_block_d(rows_ND.shape[1]),
        )
    return grad_rows_ND
