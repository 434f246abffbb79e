"""MoE permutation on the device: the expert-grouped order of routed rows, and the token
permute / weighted unpermute of the dispatcher (Triton kernels and plain-torch references).

Slots are the routed (token, k) pairs in token-major order, ``s = t * top_k + k``.

Routing metadata, for the fused expert kernels (grouped row r holds token
``row_slot_S[r] // top_k``; the down projection writes each routed row back to its slot):

- ``slot_counts(expert_of_slot_S, num_experts)`` -> how many slots chose each expert.
- ``stable_expert_order(expert_of_slot_S, num_experts)`` -> the slots sorted by expert, stably.
- ``routing_metadata(topk_expert_ids_TK, num_experts)`` -> ``(row_slot_S, slot_row_S, group_end_E)``.
- ``grouped_metadata(num_tokens_per_expert_E)`` -> ``group_end_E``.
- ``slot_rows(row_slot_S)`` -> ``slot_row_S``, and ``scatter_token_rows(x_TD, slot_row_S, top_k, rows)``
  fills every grouped row with its token's row (x and d out in expert order, read by every GEMM).

Token permute / unpermute, for the dispatcher: a dispatch plan gives every slot its destination
row in the expert-grouped buffer, ``dest_row_S`` (``-1`` for a dropped slot). Rows of the buffer
that no slot maps to are padding and are zero.

- ``permute_tokens(x_TD, dest_row_S, top_k, num_rows, zero_padding=True)`` -> ``rows_RD``:
  ``rows_RD[dest_row_S[s]] = x_TD[s // top_k]``, every other row zero (unspecified with
  ``zero_padding=False``, for buffers whose padding rows are never read).
- ``unpermute_tokens(rows_RD, dest_row_S, scores_S, top_k)`` -> ``y_TD``:
  ``y_TD[t] = sum_k scores_S[t*K+k] * rows_RD[dest_row_S[t*K+k]]`` (fp32 accumulation,
  dropped slots contribute nothing), in the dtype of ``rows_RD``.
- ``sum_token_rows(rows_RD, dest_row_S, top_k)`` -> ``y_TD``: ``y_TD[t] = sum_k rows_RD[dest_row_S[t*K+k]]``
  (fp32 accumulation, dropped slots skipped): the adjoint of ``permute_tokens``; its gradient
  copies ``grad_y[t]`` to every row of token ``t`` (the expert-parallel sender's sum over ranks).
  With ``top_k = 1`` and an index without repeats it is the gather ``rows_RD[dest_row_S]``, the
  inverse of ``permute_tokens``.

Both are differentiable in every floating input; gradients never touch padding rows
(the gradient of a padding row of ``rows_RD`` is zero). The Triton versions need CUDA, or
CPU tensors under ``TRITON_INTERPRET=1``; they do no host sync.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels.availability import check_runnable, interpreter_enabled
from torchtitan_ext.kernels.launch_configs import permute_block_d, row_block_d
from torchtitan_ext.kernels.library_ops import kernel_op

# ---------------------------------------------------------------- routing metadata


def slot_counts(expert_of_slot_S: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(E,)`` int64: how many of the slots (expert ids in [0, E)) chose each expert. No host sync."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_of_slot_S.device)
    return counts_E.scatter_add_(0, expert_of_slot_S, torch.ones_like(expert_of_slot_S))


def stable_expert_order(expert_of_slot_S: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[S]`` int64: the slots ordered by expert id, slot order kept within an expert.

    Ids may be in [0, num_experts] (num_experts: a dropped slot, ordered last). The sort runs
    on the narrowest integer type that holds them: a radix sort takes one pass per key byte.
    """
    for narrow in (torch.uint8, torch.int16, torch.int32):
        if num_experts <= torch.iinfo(narrow).max:
            return torch.argsort(expert_of_slot_S.to(narrow), stable=True)
    return torch.argsort(expert_of_slot_S, stable=True)


GROUPING_MAX_EXPERTS = 1024
"""Largest expert count the grouping kernels handle (one histogram bin per expert in registers)."""


def routing_metadata(
    topk_expert_ids_TK: torch.Tensor, num_experts: int, slots_per_program: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group routed rows by expert without a host sync.

    Args:
        topk_expert_ids_TK: [T, K] integer expert ids in [0, num_experts].
        slots_per_program: slots each program of the grouping kernels ranks (None: at least 256,
            and few enough programs, at most 256, that each reads every block's histogram
            cheaply; a power of 2 otherwise).

    Returns:
        row_slot_S: [S = T*K] int32; grouped row r holds the routed row of slot row_slot_S[r].
            Rows are ordered by expert, and by slot within an expert (stable); slots of expert
            ``num_experts`` (dropped) come last.
        slot_row_S: [S] int32, the inverse: the grouped row of every slot.
        group_end_E: [E] int32; exclusive end row of each expert's segment (inclusive
            cumsum of the per-expert counts).

    Two Triton kernels (a histogram per block of slots, then each slot's rank: the rows of the
    experts before its own, of the blocks before its own, and of the slots before it in its
    block) where they can run and ``num_experts <= GROUPING_MAX_EXPERTS``; a stable sort otherwise.
    The ``torchtitan_ext::routing_metadata`` op (not differentiable).
    """
    return _routing_metadata_op(topk_expert_ids_TK.reshape(-1), num_experts, slots_per_program)


@kernel_op("routing_metadata")
def _routing_metadata_op(
    expert_of_slot_S: torch.Tensor, num_experts: int, slots_per_program: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if num_experts <= GROUPING_MAX_EXPERTS and (expert_of_slot_S.is_cuda or interpreter_enabled()):
        return _group_slots_with_kernels(expert_of_slot_S, num_experts, slots_per_program)
    row_slot_S = stable_expert_order(expert_of_slot_S, num_experts)
    sorted_experts_S = expert_of_slot_S[row_slot_S]
    expert_ids_E = torch.arange(num_experts, device=sorted_experts_S.device, dtype=sorted_experts_S.dtype)
    group_end_E = torch.searchsorted(sorted_experts_S, expert_ids_E, right=True)
    row_slot_S = row_slot_S.to(torch.int32)
    return row_slot_S, slot_rows(row_slot_S), group_end_E.to(torch.int32)


@torch.library.register_fake(_routing_metadata_op)
def _(expert_of_slot_S, num_experts, slots_per_program):
    as_index = {"dtype": torch.int32, "device": expert_of_slot_S.device}
    num_slots = expert_of_slot_S.shape[0]
    return torch.empty(num_slots, **as_index), torch.empty(num_slots, **as_index), torch.empty(num_experts, **as_index)


@triton.jit
def _slot_histogram_kernel(ids_ptr, block_counts_ptr, num_slots, BLOCK_S: tl.constexpr, NUM_BINS: tl.constexpr):
    """block_counts[b, e] = slots of block b with expert id e (the last bin counts padding only)."""
    block = tl.program_id(0)
    slots = block * BLOCK_S + tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=NUM_BINS - 1).to(tl.int32)
    tl.store(block_counts_ptr + block * NUM_BINS + tl.arange(0, NUM_BINS), tl.histogram(ids, NUM_BINS))


@triton.jit
def _group_slots_kernel(
    ids_ptr,
    block_counts_ptr,
    row_slot_ptr,
    slot_row_ptr,
    group_end_ptr,
    num_slots,
    num_experts,
    num_blocks,
    BLOCK_S: tl.constexpr,
    NUM_BINS: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Rows of block b's slots: start of its expert's segment + that expert's slots in blocks
    before b + its slots earlier in block b. Program 0 also writes the segment ends."""
    block = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    totals = tl.zeros([NUM_BINS], dtype=tl.int32)
    before = tl.zeros([NUM_BINS], dtype=tl.int32)
    for first in range(0, num_blocks, SCAN_BLOCKS):
        blocks = first + tl.arange(0, SCAN_BLOCKS)
        counts = tl.load(
            block_counts_ptr + blocks[:, None] * NUM_BINS + bins[None, :], mask=(blocks < num_blocks)[:, None], other=0
        )
        totals += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((blocks < block)[:, None], counts, 0), axis=0)
    starts = tl.cumsum(totals, axis=0) - totals
    if block == 0:
        tl.store(group_end_ptr + bins, starts + totals, mask=bins < num_experts)
    next_row = starts + before
    lanes = tl.arange(0, CHUNK)
    for offset in range(0, BLOCK_S, CHUNK):
        slots = block * BLOCK_S + offset + lanes
        valid = slots < num_slots
        ids = tl.load(ids_ptr + slots, mask=valid, other=NUM_BINS - 1).to(tl.int32)
        one_hot = ids[:, None] == bins[None, :]
        earlier_same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        row = tl.sum(tl.where(one_hot, next_row[None, :], 0), axis=1) + tl.sum(earlier_same.to(tl.int32), axis=1)
        tl.store(slot_row_ptr + slots, row, mask=valid)
        tl.store(row_slot_ptr + row, slots, mask=valid)
        next_row += tl.sum(one_hot.to(tl.int32), axis=0)


def _group_slots_with_kernels(
    expert_of_slot_S: torch.Tensor, num_experts: int, slots_per_program: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_slots = expert_of_slot_S.shape[0]
    device = expert_of_slot_S.device
    num_bins = triton.next_power_of_2(num_experts + 2)  # experts, dropped, and a padding bin
    block_s = slots_per_program or max(256, triton.next_power_of_2(triton.cdiv(num_slots, 256)))
    num_blocks = max(1, triton.cdiv(num_slots, block_s))
    row_slot_S = torch.empty(num_slots, dtype=torch.int32, device=device)
    slot_row_S = torch.empty_like(row_slot_S)
    group_end_E = torch.empty(num_experts, dtype=torch.int32, device=device)
    block_counts = torch.empty(num_blocks, num_bins, dtype=torch.int32, device=device)
    ids_S = expert_of_slot_S.contiguous()
    _slot_histogram_kernel[(num_blocks,)](ids_S, block_counts, num_slots, BLOCK_S=block_s, NUM_BINS=num_bins)
    _group_slots_kernel[(num_blocks,)](
        ids_S,
        block_counts,
        row_slot_S,
        slot_row_S,
        group_end_E,
        num_slots,
        num_experts,
        num_blocks,
        BLOCK_S=block_s,
        NUM_BINS=num_bins,
        SCAN_BLOCKS=max(1, min(64, 8192 // num_bins)),
        CHUNK=min(block_s, max(16, min(128, 16384 // num_bins))),
        num_warps=4,
    )
    return row_slot_S, slot_row_S, group_end_E


def grouped_metadata(num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """[E] int32 exclusive end row of each expert's contiguous segment."""
    return torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)


def reference_routing_metadata(
    topk_expert_ids_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert loop version of :func:`routing_metadata`, for tests."""
    expert_of_slot_S = topk_expert_ids_TK.reshape(-1).tolist()
    row_slot, group_end = [], []
    for expert in range(num_experts + 1):
        row_slot += [slot for slot, e in enumerate(expert_of_slot_S) if e == expert]
        group_end.append(len(row_slot))
    slot_row = [0] * len(row_slot)
    for row, slot in enumerate(row_slot):
        slot_row[slot] = row
    as_int32 = functools.partial(torch.tensor, dtype=torch.int32)
    return as_int32(row_slot), as_int32(slot_row), as_int32(group_end[:num_experts])


# ---------------------------------------------------------------- token permute: plain torch reference


def permute_tokens_reference(
    x_TD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int, num_rows: int, zero_padding: bool = True
) -> torch.Tensor:
    """One gather: each buffer row reads its slot's token row; padding rows read a zero row (also
    with ``zero_padding=False``, which allows any padding content)."""
    num_tokens, num_slots = x_TD.shape[0], dest_row_S.shape[0]
    source_R = torch.full((num_rows + 1,), num_tokens * top_k, dtype=torch.long, device=x_TD.device)
    source_R.scatter_(
        0, torch.where(dest_row_S < 0, num_rows, dest_row_S).long(), torch.arange(num_slots, device=x_TD.device)
    )
    x_with_zero_row = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])
    return x_with_zero_row[source_R[:num_rows] // top_k]


def unpermute_tokens_reference(
    rows_RD: torch.Tensor, dest_row_S: torch.Tensor, scores_S: torch.Tensor, top_k: int, zero_padding: bool = True
) -> torch.Tensor:
    """Gather each slot's row, weight by its score in fp32 (0 for dropped slots), sum over top_k. The rows
    no slot maps to get a zero gradient (also with ``zero_padding=False``, which allows any)."""
    dim = rows_RD.shape[1]
    kept_S = dest_row_S >= 0
    weights_S = torch.where(kept_S, scores_S.float(), 0.0)
    weighted_SD = rows_RD[dest_row_S.clamp(min=0)].float() * weights_S.unsqueeze(1)
    return weighted_SD.view(-1, top_k, dim).sum(dim=1).to(rows_RD.dtype)


def sum_token_rows_reference(rows_RD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """Gather each slot's row and sum over top_k in fp32 (dropped slots contribute nothing)."""
    return unpermute_tokens_reference(rows_RD, dest_row_S, torch.ones_like(dest_row_S, dtype=torch.float32), top_k)


# ---------------------------------------------------------------- Triton kernels


@triton.jit
def _permute_kernel(x_ptr, rows_ptr, dest_ptr, dim, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """rows[dest[t*K+k]] = x[t] for the K slots of token t (one program per token, x read once)."""
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        row = tl.load(x_ptr + token * dim + offs, mask=offs < dim)
        for k in tl.static_range(TOP_K):
            dest = tl.load(dest_ptr + token * TOP_K + k).to(tl.int64)
            mask = offs < tl.where(dest >= 0, dim, 0)  # dropped slot: nothing
            tl.store(rows_ptr + dest * dim + offs, row, mask=mask)


@triton.jit
def _sum_slots_kernel(
    rows_ptr,
    dest_ptr,
    scores_ptr,
    y_ptr,
    dim,
    top_k,
    WEIGHTED: tl.constexpr,
    HAS_DEST: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """y[t] = sum_k rows[dest[t*K+k]], times scores[t*K+k] if ``WEIGHTED`` (fp32; dropped slots skipped).
    Without ``HAS_DEST`` slot s is row s.

    Unweighted, it is the backward of the permute; weighted, the unpermute of combine.
    """
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in range(0, top_k):
            if HAS_DEST:
                dest = tl.load(dest_ptr + token * top_k + k).to(tl.int64)
            else:
                dest = token * top_k + k
            mask = offs < tl.where(dest >= 0, dim, 0)  # dropped slot: nothing
            row = tl.load(rows_ptr + dest * dim + offs, mask=mask, other=0.0).to(tl.float32)
            if WEIGHTED:
                row = row * tl.load(scores_ptr + token * top_k + k).to(tl.float32)
            acc += row
        tl.store(y_ptr + token * dim + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < dim)


@triton.jit
def _unpermute_backward_kernel(
    rows_ptr,
    dest_ptr,
    scores_ptr,
    grad_y_ptr,
    grad_rows_ptr,
    grad_scores_ptr,
    dim,
    top_k,
    BLOCK_D: tl.constexpr,
):
    """Per slot: grad_rows[dest] = score * grad_y[t]; grad_score = <rows[dest], grad_y[t]>."""
    slot = tl.program_id(0).to(tl.int64)
    token = slot // top_k
    dest = tl.load(dest_ptr + slot).to(tl.int64)
    score = tl.load(scores_ptr + slot).to(tl.float32)
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, dim, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = offs < tl.where(dest >= 0, dim, 0)  # dropped slot: nothing
        grad_y = tl.load(grad_y_ptr + token * dim + offs, mask=mask, other=0.0).to(tl.float32)
        row = tl.load(rows_ptr + dest * dim + offs, mask=mask, other=0.0).to(tl.float32)
        dot += row * grad_y
        tl.store(
            grad_rows_ptr + dest * dim + offs,
            (grad_y * score).to(grad_rows_ptr.dtype.element_ty),
            mask=mask,
        )
    tl.store(grad_scores_ptr + slot, tl.sum(dot, axis=0).to(grad_scores_ptr.dtype.element_ty))


def sum_slots(rows_RD: torch.Tensor, dest_row_S: torch.Tensor | None, top_k: int, num_tokens: int) -> torch.Tensor:
    """``(T, D)``: ``y[t] = sum_k rows_RD[dest_row_S[t*K+k]]`` in fp32 (dropped slots skipped), in the
    dtype of ``rows_RD``; ``dest_row_S = None``: the rows are the slots, ``y[t] = sum_k rows_RD[t*K+k]``.
    No autograd."""
    rows_RD = rows_RD.contiguous()
    dim = rows_RD.shape[1]
    y_TD = rows_RD.new_empty(num_tokens, dim)
    if num_tokens:
        _sum_slots_kernel[(num_tokens,)](
            rows_RD,
            dest_row_S,
            rows_RD,
            y_TD,
            dim,
            top_k,  # no scores read
            WEIGHTED=False,
            HAS_DEST=dest_row_S is not None,
            BLOCK_D=row_block_d(dim),
        )
    return y_TD


def scatter_token_rows(x_TD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int, rows_RD: torch.Tensor) -> torch.Tensor:
    """``rows_RD[dest_row_S[s]] = x_TD[s // top_k]`` for every slot with ``dest_row_S[s] >= 0``; other
    rows are left as they are. Each token row is read once. No autograd. Returns ``rows_RD``."""
    if dest_row_S.shape[0] != x_TD.shape[0] * top_k:
        raise ValueError(f"dest_row_S has {dest_row_S.shape[0]} slots, expected {x_TD.shape[0]} tokens x top_k {top_k}")
    x_TD = x_TD.contiguous()
    if dest_row_S.numel():
        _permute_kernel[(x_TD.shape[0],)](
            x_TD, rows_RD, dest_row_S, x_TD.shape[1], TOP_K=top_k, BLOCK_D=permute_block_d(x_TD.shape[1])
        )
    return rows_RD


def slot_rows(row_slot_S: torch.Tensor) -> torch.Tensor:
    """``[S]`` int32: the grouped row of every slot, the inverse of ``routing_metadata``'s ``row_slot_S``."""
    slot_row_S = torch.empty_like(row_slot_S)
    slot_row_S[row_slot_S.long()] = torch.arange(row_slot_S.shape[0], device=row_slot_S.device, dtype=row_slot_S.dtype)
    return slot_row_S


def weighted_sum_slots(
    rows_RD: torch.Tensor, dest_row_S: torch.Tensor, scores_S: torch.Tensor, top_k: int
) -> torch.Tensor:
    """``(T, D)``: ``y[t] = sum_k scores_S[t*K+k] * rows_RD[dest_row_S[t*K+k]]``; no autograd."""
    rows_RD = rows_RD.contiguous()
    dim = rows_RD.shape[1]
    num_tokens = dest_row_S.shape[0] // top_k
    y_TD = rows_RD.new_empty(num_tokens, dim)
    if num_tokens:
        _sum_slots_kernel[(num_tokens,)](
            rows_RD,
            dest_row_S,
            scores_S.contiguous(),
            y_TD,
            dim,
            top_k,
            WEIGHTED=True,
            HAS_DEST=True,
            BLOCK_D=row_block_d(dim),
        )
    return y_TD


@kernel_op("permute_rows")
def _permute_rows_op(
    x_TD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int, num_rows: int, zero_padding: bool
) -> torch.Tensor:
    check_runnable(x_TD, dest_row_S)
    x_TD = x_TD.contiguous()
    dim = x_TD.shape[1]
    rows_RD = x_TD.new_zeros(num_rows, dim) if zero_padding else x_TD.new_empty(num_rows, dim)
    return scatter_token_rows(x_TD, dest_row_S, top_k, rows_RD)


@torch.library.register_fake(_permute_rows_op)
def _(x_TD, dest_row_S, top_k, num_rows, zero_padding):
    return x_TD.new_empty(num_rows, x_TD.shape[1])


@kernel_op("sum_rows")
def _sum_rows_op(rows_RD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int) -> torch.Tensor:
    check_runnable(rows_RD, dest_row_S)
    return sum_slots(rows_RD, dest_row_S, top_k, dest_row_S.shape[0] // top_k)


@torch.library.register_fake(_sum_rows_op)
def _(rows_RD, dest_row_S, top_k):
    return rows_RD.new_empty(dest_row_S.shape[0] // top_k, rows_RD.shape[1])


def _save_index(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.top_k = inputs[2]
    ctx.num_source_rows = inputs[0].shape[0]


def _permute_rows_backward(ctx, grad_rows_RD):
    (dest_row_S,) = ctx.saved_tensors
    return _sum_rows_op(grad_rows_RD, dest_row_S, ctx.top_k), None, None, None, None


def _sum_rows_backward(ctx, grad_y_TD):
    (dest_row_S,) = ctx.saved_tensors
    return _permute_rows_op(grad_y_TD, dest_row_S, ctx.top_k, ctx.num_source_rows, True), None, None


torch.library.register_autograd(_permute_rows_op, _permute_rows_backward, setup_context=_save_index)
torch.library.register_autograd(_sum_rows_op, _sum_rows_backward, setup_context=_save_index)


@kernel_op("weighted_sum_rows")
def _weighted_sum_rows_op(
    rows_RD: torch.Tensor, dest_row_S: torch.Tensor, scores_S: torch.Tensor, top_k: int, zero_padding: bool
) -> torch.Tensor:
    check_runnable(rows_RD, dest_row_S, scores_S)
    return weighted_sum_slots(rows_RD, dest_row_S, scores_S, top_k)


@torch.library.register_fake(_weighted_sum_rows_op)
def _(rows_RD, dest_row_S, scores_S, top_k, zero_padding):
    return rows_RD.new_empty(dest_row_S.shape[0] // top_k, rows_RD.shape[1])


@kernel_op("weighted_sum_rows_backward")
def _weighted_sum_rows_backward_op(
    rows_RD: torch.Tensor,
    dest_row_S: torch.Tensor,
    scores_S: torch.Tensor,
    grad_y_TD: torch.Tensor,
    top_k: int,
    zero_padding: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_rows_RD, grad_scores_S)``: each slot's row gets score * grad_y of its token, each score the
    dot product of its row with that gradient. The rows no slot maps to get zeros with ``zero_padding``,
    else are left unwritten."""
    rows_RD, scores_S, grad_y_TD = rows_RD.contiguous(), scores_S.contiguous(), grad_y_TD.contiguous()
    dim = rows_RD.shape[1]
    grad_rows_RD = torch.zeros_like(rows_RD) if zero_padding else torch.empty_like(rows_RD)
    grad_scores_S = torch.empty_like(scores_S)
    if dest_row_S.numel():
        _unpermute_backward_kernel[(dest_row_S.shape[0],)](
            rows_RD,
            dest_row_S,
            scores_S,
            grad_y_TD,
            grad_rows_RD,
            grad_scores_S,
            dim,
            top_k,
            BLOCK_D=row_block_d(dim),
        )
    return grad_rows_RD, grad_scores_S


@torch.library.register_fake(_weighted_sum_rows_backward_op)
def _(rows_RD, dest_row_S, scores_S, grad_y_TD, top_k, zero_padding):
    return torch.empty_like(rows_RD), torch.empty_like(scores_S)


def _weighted_sum_rows_setup(ctx, inputs, output) -> None:
    rows_RD, dest_row_S, scores_S, top_k, zero_padding = inputs
    ctx.save_for_backward(rows_RD, dest_row_S, scores_S)
    ctx.top_k, ctx.zero_padding = top_k, zero_padding


def _weighted_sum_rows_backward(ctx, grad_y_TD):
    rows_RD, dest_row_S, scores_S = ctx.saved_tensors
    grad_rows_RD, grad_scores_S = _weighted_sum_rows_backward_op(
        rows_RD, dest_row_S, scores_S, grad_y_TD, ctx.top_k, ctx.zero_padding
    )
    return grad_rows_RD, None, grad_scores_S, None, None


torch.library.register_autograd(
    _weighted_sum_rows_op, _weighted_sum_rows_backward, setup_context=_weighted_sum_rows_setup
)


def permute_tokens(
    x_TD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int, num_rows: int, zero_padding: bool = True
) -> torch.Tensor:
    """Triton version of :func:`permute_tokens_reference` (the ``torchtitan_ext::permute_rows`` op); with
    ``zero_padding=False`` the rows no slot maps to are left unwritten (for buffers whose padding is
    never read)."""
    return _permute_rows_op(x_TD, dest_row_S, top_k, num_rows, zero_padding)


def unpermute_tokens(
    rows_RD: torch.Tensor, dest_row_S: torch.Tensor, scores_S: torch.Tensor, top_k: int, zero_padding: bool = True
) -> torch.Tensor:
    """Triton version of :func:`unpermute_tokens_reference` (the ``torchtitan_ext::weighted_sum_rows`` op); with
    ``zero_padding=False`` the gradient rows no slot maps to are left unwritten (for rows whose gradient
    is never read)."""
    return _weighted_sum_rows_op(rows_RD, dest_row_S, scores_S, top_k, zero_padding)


def sum_token_rows(rows_RD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """Triton version of :func:`sum_token_rows_reference` (the ``torchtitan_ext::sum_rows`` op): one row
    kernel each way."""
    return _sum_rows_op(rows_RD, dest_row_S, top_k)
