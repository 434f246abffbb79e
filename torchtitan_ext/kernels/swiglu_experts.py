"""SwiGLU expert block over expert-grouped rows: Triton kernels, autograd.Function, entry point.

For the rows of expert e (weights in torchtitan's layouts w1 [E,F,D], w2 [E,D,F], w3 [E,F,D]):

    gate = x @ w1[e].T,  up = x @ w3[e].T,  h = silu(gate) * up,  y = h @ w2[e].T

Two modes share the kernels:

- grouped: the rows of x_RD are already grouped by expert; expert e owns rows
  [group_end[e-1], group_end[e]); rows after group_end[E-1] belong to no expert and
  get zero output (and zero gradient).
- routed: x_TD holds tokens; they are copied into expert order once (grouped row r holds token
  ``row_slot[r] // top_k``, each token read once and written to its K rows), so every GEMM reads
  grouped rows (through TMA descriptors on Hopper). The down projection's epilogue multiplies by
  the router score of slot ``row_slot[r]`` and writes the row to that slot of a [T*K, D] buffer,
  summed over K after; backward copies d out into expert order the same way.

Forward saves the gate and up pre-activations [R, F] and, when a weight gradient is needed, the
grouped x rows; backward recomputes h from gate and up and overwrites them in place with their
gradients (bumping their autograd version, so that a second backward through the graph is an
error), and frees d gate's memory once d w1 is done, before d w3 is allocated. Every reduction
has a fixed order: results are the same from run to run.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels import hopper_weight_gradient
from torchtitan_ext.kernels.availability import check_runnable, persistent_programs
from torchtitan_ext.kernels.launch_configs import (
    GATE_UP_FORWARD_CONFIGS,
    PLAIN_GEMM_CONFIGS,
    WEIGHT_GRADIENT_CONFIGS,
    block_experts,
    descriptor_blocks,
    dot_precision,
    fit_to_shape,
    fitted,
    gemm_configs,
    num_row_tiles_upper_bound,
    tensor_descriptors,
)
from torchtitan_ext.kernels.moe_permute import scatter_token_rows, sum_slots
from torchtitan_ext.kernels.tiles import locate_row_tile, swizzle_tile

GROUP_M = 8
GATE_UP_TWO_PASS_MIN_WEIGHT = 2048 * 4096
"""Elements of one expert's w1 (F x D) from which the gate/up forward takes two passes."""

_logger = logging.getLogger(__name__)
_shapes_seen: set[tuple] = set()


def _announce_first_use(x: torch.Tensor, w1_EFD: torch.Tensor, routed: bool) -> None:
    """One log line the first time a shape and dtype reach the kernels in this process."""
    shape = (x.device, x.dtype, w1_EFD.shape, routed)
    if shape in _shapes_seen:
        return
    _shapes_seen.add(shape)
    num_experts, hidden, dim = w1_EFD.shape
    _logger.info(
        f"Triton MoE kernels: first use of D={dim} F={hidden} E={num_experts} {str(x.dtype).removeprefix('torch.')} "
        "on this device: compiling, or loading from Triton's disk cache "
        "(a cold cache makes this step slow; later launches reuse it)"
    )


@triton.jit
def _destination_rows(rows, row_mask, row_slot_ptr, HAS_GATHER: tl.constexpr):
    """Row of the output buffer that each grouped row writes (int64)."""
    if HAS_GATHER:
        return tl.load(row_slot_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    return rows.to(tl.int64)


@triton.jit
def _program_row_tile(
    group_end_ptr,
    num_rows,
    num_experts,
    num_cols,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """This program's output tile of a row-tile kernel: (expert, first row, end row, column tile).

    Row tiles follow the expert segments (``locate_row_tile``, expert == num_experts past them),
    swizzled in groups of GROUP_M over the num_cols / BLOCK_N column tiles.
    """
    num_m_tiles = tl.cdiv(num_rows, BLOCK_M) + tl.minimum(num_experts, num_rows) + 1
    m_tile, n_tile = swizzle_tile(tl.program_id(0), num_m_tiles, tl.cdiv(num_cols, BLOCK_N), GROUP_M)
    expert, row_start, row_end = locate_row_tile(m_tile, group_end_ptr, num_experts, num_rows, BLOCK_M, BLOCK_E)
    return expert, row_start, row_end, n_tile


@triton.jit
def _row_tile(
    a_ptr,
    row_start,
    row_end,
    n_tile,
    dim,
    num_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A tile's rows and output columns (with masks against row_end and num_cols), the K offsets
    and the pointers to its first [BLOCK_M, BLOCK_K] block of a [R, dim] grouped-rows operand."""
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < num_cols
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tl.minimum(rows, row_end - 1).to(tl.int64)[:, None] * dim + ks[None, :]
    return rows, row_mask, cols, col_mask, ks, a_ptrs


@triton.jit
def _load_rows(desc, ptrs, k_mask, row_start, k_start, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] block of grouped rows: through the descriptor (rows past the segment
    included) or the pointers (masked along K unless EVEN_K)."""
    if USE_TMA:
        return desc.load([row_start, k_start])
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k_mask[None, :], other=0.0)


@triton.jit
def _load_weight_transposed(
    desc,
    ptrs,
    k_mask,
    expert,
    n_start,
    k_start,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_K, BLOCK_N] block of w[e].T for w [E, N, K]: through the descriptor (block
    (1, BLOCK_N, BLOCK_K)) or the pointers (masked along K unless EVEN_K)."""
    if USE_TMA:
        return desc.load([expert, n_start, k_start]).reshape(BLOCK_N, BLOCK_K).T
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k_mask[:, None], other=0.0)


@triton.jit
def _transposed_weight_operands(
    a_ptr,
    expert,
    row_start,
    row_end,
    n_tile,
    size_k,
    size_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``_row_tile`` of grouped rows a [R, size_k], and the offsets of the first [BLOCK_K, BLOCK_N]
    block of w[e].T inside a [E, size_n, size_k] weight."""
    rows, row_mask, cols, col_mask, ks, a_ptrs = _row_tile(
        a_ptr, row_start, row_end, n_tile, size_k, size_n, BLOCK_M, BLOCK_N, BLOCK_K
    )
    load_cols = tl.minimum(cols, size_n - 1).to(tl.int64)
    w_offsets = expert.to(tl.int64) * size_n * size_k + load_cols[None, :] * size_k + ks[:, None]
    return rows, row_mask, cols, col_mask, ks, a_ptrs, w_offsets


@triton.jit
def _accumulate_rows_times_weight_transposed(
    acc,
    a_desc,
    w_desc,
    a_ptr,
    w_ptr,
    expert,
    row_start,
    row_end,
    n_tile,
    size_n,
    size_k,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc += a[rows] @ w[e].T for grouped rows a [R, size_k] and w [E, size_n, size_k], output
    column tile n_tile.

    With USE_TMA both load through tensor descriptors (a row tile may read rows past its
    expert's segment, whose outputs the caller masks); otherwise through masked pointers.
    """
    _, _, _, _, ks, a_ptrs, w_offsets = _transposed_weight_operands(
        a_ptr, expert, row_start, row_end, n_tile, size_k, size_n, BLOCK_M, BLOCK_N, BLOCK_K
    )
    w_ptrs = w_ptr + w_offsets
    for k_tile in range(0, tl.cdiv(size_k, BLOCK_K)):
        k_start = k_tile * BLOCK_K
        k_mask = ks < size_k - k_start
        a = _load_rows(a_desc, a_ptrs, k_mask, row_start, k_start, USE_TMA, EVEN_K)
        b = _load_weight_transposed(
            w_desc, w_ptrs, k_mask, expert, n_tile * BLOCK_N, k_start, USE_TMA, EVEN_K, BLOCK_N, BLOCK_K
        )
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


_WEIGHT_BLOCK = (1, "BLOCK_N", "BLOCK_K")
"""Descriptor block of a [E, N, K] weight read as w[e].T tiles."""


@fitted(
    gemm_configs(
        GATE_UP_FORWARD_CONFIGS,
        pre_hook=descriptor_blocks(x_desc=("BLOCK_M", "BLOCK_K"), w1_desc=_WEIGHT_BLOCK, w3_desc=_WEIGHT_BLOCK),
    ),
    key=["dim", "hidden", "SAVE_PREACT", "USE_TMA"],
    fit=fit_to_shape(m=None, n="hidden", k="dim", b_tiles=2),
    divides={"EVEN_K": ("dim", "BLOCK_K")},
)
@triton.jit
def _gate_up_forward_kernel(
    x_desc,
    w1_desc,
    w3_desc,
    x_ptr,
    w1_ptr,
    w3_ptr,
    gate_ptr,
    up_ptr,
    h_ptr,
    group_end_ptr,
    num_rows,
    num_experts,
    dim,
    hidden,
    SAVE_PREACT: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """gate/up [R, F] = x @ w1[e].T / w3[e].T over grouped rows; h = silu(gate) * up. With
    USE_TMA, x [R, D], w1 and w3 [E, F, D] load through tensor descriptors."""
    expert, row_start, row_end, n_tile = _program_row_tile(
        group_end_ptr, num_rows, num_experts, hidden, BLOCK_E, GROUP_M, BLOCK_M, BLOCK_N
    )
    if expert >= num_experts:
        return
    rows, row_mask, cols, col_mask, ks, x_ptrs, w_offsets = _transposed_weight_operands(
        x_ptr, expert, row_start, row_end, n_tile, dim, hidden, BLOCK_M, BLOCK_N, BLOCK_K
    )
    w1_ptrs = w1_ptr + w_offsets
    w3_ptrs = w3_ptr + w_offsets
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(0, tl.cdiv(dim, BLOCK_K)):
        k_start = k_tile * BLOCK_K
        k_mask = ks < dim - k_start
        a = _load_rows(x_desc, x_ptrs, k_mask, row_start, k_start, USE_TMA, EVEN_K)
        n_start = n_tile * BLOCK_N
        b1 = _load_weight_transposed(
            w1_desc, w1_ptrs, k_mask, expert, n_start, k_start, USE_TMA, EVEN_K, BLOCK_N, BLOCK_K
        )
        b3 = _load_weight_transposed(
            w3_desc, w3_ptrs, k_mask, expert, n_start, k_start, USE_TMA, EVEN_K, BLOCK_N, BLOCK_K
        )
        gate = tl.dot(a, b1, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, b3, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
        w3_ptrs += BLOCK_K
    out_offsets = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SAVE_PREACT:
        tl.store(gate_ptr + out_offsets, gate.to(gate_ptr.dtype.element_ty), mask=out_mask)
        tl.store(up_ptr + out_offsets, up.to(up_ptr.dtype.element_ty), mask=out_mask)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + out_offsets, h.to(h_ptr.dtype.element_ty), mask=out_mask)


@fitted(
    gemm_configs(PLAIN_GEMM_CONFIGS, pre_hook=descriptor_blocks(x_desc=("BLOCK_M", "BLOCK_K"), w_desc=_WEIGHT_BLOCK)),
    key=["dim", "hidden", "UP_PASS", "SAVE_UP", "USE_TMA"],
    fit=fit_to_shape(m=None, n="hidden", k="dim"),
    divides={"EVEN_K": ("dim", "BLOCK_K")},
)
@triton.jit
def _gate_up_pass_kernel(
    x_desc,
    w_desc,
    x_ptr,
    w_ptr,
    gate_ptr,
    up_ptr,
    h_ptr,
    group_end_ptr,
    num_rows,
    num_experts,
    dim,
    hidden,
    UP_PASS: tl.constexpr,
    SAVE_UP: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One GEMM of the gate/up forward, for large F x D per expert, with one accumulator.

    Gate pass: gate [R, F] = x @ w1[e].T over grouped rows. Up pass: up = x @ w3[e].T, then
    h = silu(gate) * up with gate read back (and up stored when SAVE_UP). x [R, D] and
    w [E, F, D] load through tensor descriptors when USE_TMA.
    """
    expert, row_start, row_end, n_tile = _program_row_tile(
        group_end_ptr, num_rows, num_experts, hidden, BLOCK_E, GROUP_M, BLOCK_M, BLOCK_N
    )
    if expert >= num_experts:
        return
    acc = _accumulate_rows_times_weight_transposed(
        tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
        x_desc,
        w_desc,
        x_ptr,
        w_ptr,
        expert,
        row_start,
        row_end,
        n_tile,
        hidden,
        dim,
        USE_TMA,
        DOT_PRECISION,
        EVEN_K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < row_end
    col_mask = cols < hidden
    out_offsets = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if UP_PASS:
        if SAVE_UP:
            tl.store(up_ptr + out_offsets, acc.to(up_ptr.dtype.element_ty), mask=out_mask)
        gate = tl.load(gate_ptr + out_offsets, mask=out_mask, other=0.0).to(tl.float32)
        h = gate * tl.sigmoid(gate) * acc
        tl.store(h_ptr + out_offsets, h.to(h_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(gate_ptr + out_offsets, acc.to(gate_ptr.dtype.element_ty), mask=out_mask)


@fitted(
    gemm_configs(PLAIN_GEMM_CONFIGS, pre_hook=descriptor_blocks(h_desc=("BLOCK_M", "BLOCK_K"), w2_desc=_WEIGHT_BLOCK)),
    key=["dim", "hidden", "HAS_GATHER", "USE_TMA"],
    fit=fit_to_shape(m=None, n="dim", k="hidden"),
    divides={"EVEN_K": ("hidden", "BLOCK_K")},
)
@triton.jit
def _down_forward_kernel(
    h_desc,
    w2_desc,
    h_ptr,
    w2_ptr,
    out_ptr,
    row_slot_ptr,
    scores_ptr,
    group_end_ptr,
    num_rows,
    num_experts,
    dim,
    hidden,
    HAS_GATHER: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[dest rows] = (score *) h @ w2[e].T; unassigned trailing rows get zeros.

    With USE_TMA, h [R, F] and w2 [E, D, F] load through tensor descriptors: a row tile may
    read rows past its expert's segment, whose outputs are masked at the store.
    """
    expert, row_start, row_end, n_tile = _program_row_tile(
        group_end_ptr, num_rows, num_experts, dim, BLOCK_E, GROUP_M, BLOCK_M, BLOCK_N
    )
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert < num_experts:
        acc = _accumulate_rows_times_weight_transposed(
            acc,
            h_desc,
            w2_desc,
            h_ptr,
            w2_ptr,
            expert,
            row_start,
            row_end,
            n_tile,
            dim,
            hidden,
            USE_TMA,
            DOT_PRECISION,
            EVEN_K,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    dest = _destination_rows(rows, row_mask, row_slot_ptr, HAS_GATHER)
    if HAS_GATHER:
        acc = acc * tl.load(scores_ptr + dest, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + dest[:, None] * dim + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@fitted(
    gemm_configs(
        PLAIN_GEMM_CONFIGS,
        pre_hook=descriptor_blocks(dy_desc=("BLOCK_M", "BLOCK_K"), w2_desc=(1, "BLOCK_K", "BLOCK_N")),
    ),
    key=["dim", "hidden", "USE_TMA"],
    fit=fit_to_shape(m=None, n="hidden", k="dim"),
    divides={"EVEN_K": ("dim", "BLOCK_K"), "EVEN_N": ("hidden", "BLOCK_N")},
)
@triton.jit
def _down_backward_kernel(
    dy_desc,
    w2_desc,
    dy_ptr,
    w2_ptr,
    dh_ptr,
    group_end_ptr,
    num_rows,
    num_experts,
    dim,
    hidden,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dh [R, F] = dy @ w2[e] over grouped rows (rows of no expert are not written); dy [R, D] and
    w2 [E, D, F] load through tensor descriptors when USE_TMA."""
    expert, row_start, row_end, n_tile = _program_row_tile(
        group_end_ptr, num_rows, num_experts, hidden, BLOCK_E, GROUP_M, BLOCK_M, BLOCK_N
    )
    if expert >= num_experts:
        return
    dh = _accumulate_rows_times_weight(
        tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
        dy_desc,
        w2_desc,
        dy_ptr,
        w2_ptr,
        expert,
        row_start,
        row_end,
        n_tile,
        hidden,
        dim,
        USE_TMA,
        DOT_PRECISION,
        EVEN_K,
        EVEN_N,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(
        dh_ptr + offsets, dh.to(dh_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < hidden)[None, :]
    )


@triton.jit
def _swiglu_backward_kernel(
    dh_ptr,
    gate_ptr,
    up_ptr,
    row_slot_ptr,
    scores_ptr,
    dscores_ptr,
    group_end_ptr,
    num_experts,
    hidden,
    HAS_GATHER: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """In place over the rows of every expert: gate <- d gate, up <- d up, dh <- (score *) h.

    Routed mode also writes each slot's router-score gradient sum_f dh * h to dscores[slot],
    summed over F in a fixed order inside one program.
    """
    num_assigned = tl.load(group_end_ptr + num_experts - 1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_assigned
    if HAS_GATHER:
        slots = tl.load(row_slot_ptr + rows, mask=row_mask, other=0)
        score = tl.load(scores_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
        dscore = tl.zeros((ROWS,), dtype=tl.float32)
    row_offsets = rows.to(tl.int64)[:, None] * hidden
    for col_start in range(0, hidden, BLOCK_F):
        cols = col_start + tl.arange(0, BLOCK_F)
        mask = row_mask[:, None] & (cols < hidden)[None, :]
        offsets = row_offsets + cols[None, :]
        dh = tl.load(dh_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        h = silu * up
        if HAS_GATHER:
            dscore += tl.sum(dh * h, axis=1)
            dh = dh * score[:, None]
            h = h * score[:, None]
        tl.store(
            gate_ptr + offsets, (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(gate_ptr.dtype.element_ty), mask=mask
        )
        tl.store(up_ptr + offsets, (dh * silu).to(up_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + offsets, h.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_GATHER:
        tl.store(dscores_ptr + slots, dscore, mask=row_mask)


@triton.jit
def _accumulate_rows_times_weight(
    acc,
    a_desc,
    w_desc,
    a_ptr,
    w_ptr,
    expert,
    row_start,
    row_end,
    n_tile,
    size_n,
    size_k,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc += a[rows] @ w[e] for grouped rows a [R, size_k] and w [E, size_k, size_n], output
    column tile n_tile.

    With USE_TMA both load through tensor descriptors (a row tile may read rows past its
    expert's segment, whose outputs the caller masks); otherwise through masked pointers.
    """
    _, _, cols, col_mask, ks, a_ptrs = _row_tile(
        a_ptr, row_start, row_end, n_tile, size_k, size_n, BLOCK_M, BLOCK_N, BLOCK_K
    )
    w_ptrs = w_ptr + expert.to(tl.int64) * size_k * size_n + ks[:, None].to(tl.int64) * size_n + cols[None, :]
    for k_tile in range(0, tl.cdiv(size_k, BLOCK_K)):
        k_start = k_tile * BLOCK_K
        k_mask = ks < size_k - k_start
        a = _load_rows(a_desc, a_ptrs, k_mask, row_start, k_start, USE_TMA, EVEN_K)
        if USE_TMA:
            b = w_desc.load([expert, k_start, n_tile * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
        elif EVEN_K and EVEN_N:
            b = tl.load(w_ptrs)
        else:
            b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * size_n
    return acc


@fitted(
    gemm_configs(
        PLAIN_GEMM_CONFIGS,
        pre_hook=descriptor_blocks(
            dgate_desc=("BLOCK_M", "BLOCK_K"),
            dup_desc=("BLOCK_M", "BLOCK_K"),
            w1_desc=(1, "BLOCK_K", "BLOCK_N"),
            w3_desc=(1, "BLOCK_K", "BLOCK_N"),
        ),
    ),
    key=["dim", "hidden", "HAS_GATHER", "USE_TMA"],
    fit=fit_to_shape(m=None, n="dim", k="hidden"),
    divides={"EVEN_K": ("hidden", "BLOCK_K"), "EVEN_N": ("dim", "BLOCK_N")},
)
@triton.jit
def _gate_up_backward_input_kernel(
    dgate_desc,
    dup_desc,
    w1_desc,
    w3_desc,
    dgate_ptr,
    dup_ptr,
    w1_ptr,
    w3_ptr,
    dx_ptr,
    row_slot_ptr,
    group_end_ptr,
    num_rows,
    num_experts,
    dim,
    hidden,
    HAS_GATHER: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dx[dest rows] = dgate @ w1[e] + dup @ w3[e]; unassigned trailing rows get zeros."""
    expert, row_start, row_end, n_tile = _program_row_tile(
        group_end_ptr, num_rows, num_experts, dim, BLOCK_E, GROUP_M, BLOCK_M, BLOCK_N
    )
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert < num_experts:
        acc = _accumulate_rows_times_weight(
            acc,
            dgate_desc,
            w1_desc,
            dgate_ptr,
            w1_ptr,
            expert,
            row_start,
            row_end,
            n_tile,
            dim,
            hidden,
            USE_TMA,
            DOT_PRECISION,
            EVEN_K,
            EVEN_N,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        acc = _accumulate_rows_times_weight(
            acc,
            dup_desc,
            w3_desc,
            dup_ptr,
            w3_ptr,
            expert,
            row_start,
            row_end,
            n_tile,
            dim,
            hidden,
            USE_TMA,
            DOT_PRECISION,
            EVEN_K,
            EVEN_N,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    dest = _destination_rows(rows, row_mask, row_slot_ptr, HAS_GATHER)
    tl.store(
        dx_ptr + dest[:, None] * dim + cols[None, :],
        acc.to(dx_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _expert_rows(group_end_ptr, expert):
    row_end = tl.load(group_end_ptr + expert)
    row_start = tl.load(group_end_ptr + expert - 1, mask=expert > 0, other=0)
    return row_start, row_end


@fitted(
    gemm_configs(
        WEIGHT_GRADIENT_CONFIGS,
        pre_hook=descriptor_blocks(
            a_desc=("BLOCK_K", "BLOCK_M"), b_desc=("BLOCK_K", "BLOCK_N"), c_desc=(1, "BLOCK_M", "BLOCK_N")
        ),
    ),
    key=["size_m", "size_n", "USE_TMA", "STORE_TMA"],
    fit=fit_to_shape(m="size_m", n="size_n", k=None),
    divides={"EVEN_M": ("size_m", "BLOCK_M"), "EVEN_N": ("size_n", "BLOCK_N")},
)
@triton.jit
def _weight_gradient_kernel(
    a_desc,
    b_desc,
    c_desc,
    a_ptr,
    b_ptr,
    c_ptr,
    group_end_ptr,
    num_experts,
    size_m,
    size_n,
    num_programs,
    USE_TMA: tl.constexpr,
    STORE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[e] [M, N] = a[rows of e].T @ b[rows of e] for every expert e; a [R, M], b [R, N] grouped rows.

    Persistent: each program walks output tiles (expert, m, n) with stride num_programs. The
    expert's full BLOCK_K-row steps load through tensor descriptors (TMA) when USE_TMA; its last
    partial step, and every step without TMA, uses masked pointer loads. With STORE_TMA the tile
    is stored through c [E, M, N]'s descriptor, asynchronously, while the next tile loads.
    """
    num_m_tiles = tl.cdiv(size_m, BLOCK_M)
    num_n_tiles = tl.cdiv(size_n, BLOCK_N)
    tiles_per_expert = num_m_tiles * num_n_tiles
    ks = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_experts * tiles_per_expert, num_programs):
        expert = tile // tiles_per_expert
        m_tile, n_tile = swizzle_tile(tile % tiles_per_expert, num_m_tiles, num_n_tiles, GROUP_M)
        row_start, row_end = _expert_rows(group_end_ptr, expert)
        m_cols = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        n_cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = m_cols < size_m
        n_mask = n_cols < size_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        full_end = row_start + (row_end - row_start) // BLOCK_K * BLOCK_K
        for row0 in range(row_start, full_end, BLOCK_K):
            if USE_TMA:
                a = a_desc.load([row0, m_tile * BLOCK_M]).T
                b = b_desc.load([row0, n_tile * BLOCK_N])
            else:
                rows = (row0 + ks).to(tl.int64)
                a_ptrs = a_ptr + rows[None, :] * size_m + m_cols[:, None]
                b_ptrs = b_ptr + rows[:, None] * size_n + n_cols[None, :]
                if EVEN_M:
                    a = tl.load(a_ptrs)
                else:
                    a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
                if EVEN_N:
                    b = tl.load(b_ptrs)
                else:
                    b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if full_end < row_end:
            rows = full_end + ks
            rows_mask = rows < row_end
            rows = rows.to(tl.int64)
            a = tl.load(
                a_ptr + rows[None, :] * size_m + m_cols[:, None], mask=rows_mask[None, :] & m_mask[:, None], other=0.0
            )
            b = tl.load(
                b_ptr + rows[:, None] * size_n + n_cols[None, :], mask=rows_mask[:, None] & n_mask[None, :], other=0.0
            )
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if STORE_TMA:
            tile = acc.to(c_ptr.dtype.element_ty).reshape(1, BLOCK_M, BLOCK_N)
            c_desc.store([expert, m_tile * BLOCK_M, n_tile * BLOCK_N], tile)
        else:
            out_offsets = (
                expert.to(tl.int64) * size_m * size_n + m_cols.to(tl.int64)[:, None] * size_n + n_cols[None, :]
            )
            tl.store(c_ptr + out_offsets, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _row_tile_grid(num_rows: int, num_experts: int, num_cols: int):
    def grid(meta):
        m_tiles = num_row_tiles_upper_bound(num_rows, num_experts, meta["BLOCK_M"])
        return (m_tiles * triton.cdiv(num_cols, meta["BLOCK_N"]),)

    return grid


def _weight_gradient(a_RM: torch.Tensor, b_RN: torch.Tensor, group_end_E: torch.Tensor, out_EMN: torch.Tensor) -> None:
    """out[e] = a[rows of e].T @ b[rows of e] for every expert (rows past group_end[E-1] are unused):
    the Hopper Gluon kernel where it is usable, the Triton kernel otherwise."""
    if hopper_weight_gradient.usable(a_RM, b_RN, out_EMN):
        hopper_weight_gradient.weight_gradient(a_RM, b_RN, group_end_E, out_EMN)
        return
    num_experts, size_m, size_n = out_EMN.shape
    use_tma, (a_desc, b_desc) = tensor_descriptors(a_RM, b_RN)
    # A 16-bit output tile's staging buffer fits beside the load pipeline; an fp32 one would not.
    store_tma, (c_desc,) = tensor_descriptors(out_EMN) if use_tma and out_EMN.element_size() == 2 else (False, [None])
    num_programs = persistent_programs(a_RM.device)

    def grid(meta):
        tiles = num_experts * triton.cdiv(size_m, meta["BLOCK_M"]) * triton.cdiv(size_n, meta["BLOCK_N"])
        return (min(tiles, num_programs),)

    _weight_gradient_kernel[grid](
        a_desc,
        b_desc,
        c_desc,
        a_RM,
        b_RN,
        out_EMN,
        group_end_E,
        num_experts,
        size_m,
        size_n,
        num_programs,
        USE_TMA=use_tma,
        STORE_TMA=store_tma,
        DOT_PRECISION=dot_precision(a_RM.dtype),
        GROUP_M=GROUP_M,
    )


def _grouped_rows(tokens_TD: torch.Tensor, slot_row_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """[R = T*K, D]: token rows copied into expert order (grouped row slot_row[s] <- token s // K)."""
    rows_RD = tokens_TD.new_empty(slot_row_S.shape[0], tokens_TD.shape[1])
    return scatter_token_rows(tokens_TD, slot_row_S, top_k, rows_RD)


def _row_tile_meta(dtype: torch.dtype, num_experts: int) -> dict:
    """Meta-parameters every row-tile kernel takes besides its tile sizes."""
    return dict(DOT_PRECISION=dot_precision(dtype), BLOCK_E=block_experts(num_experts), GROUP_M=GROUP_M)


def gate_up_in_two_passes(dim: int, hidden: int) -> bool:
    """Whether the gate/up forward runs as two one-accumulator GEMMs (gate, then up with the SwiGLU)
    instead of one kernel with two accumulators: for large experts, where the one-accumulator
    kernel's wider tiles outweigh reading x twice and gate back once."""
    return dim * hidden >= GATE_UP_TWO_PASS_MIN_WEIGHT


def _elementwise_tile(hidden: int) -> tuple[int, int]:
    """(rows, columns) of the [R, F] tile each program of the SwiGLU backward handles per step:
    about 1024 elements (one row up to F = 1024), which ran at the memory's speed on an H100 where
    4096-element tiles took 10-15% longer."""
    block_f = min(1024, max(16, triton.next_power_of_2(hidden)))
    return max(1, 1024 // block_f), block_f


def _release_saved_buffer(buffer: torch.Tensor) -> None:
    """Free the memory of a saved buffer that backward has overwritten and no longer needs, before
    backward returns (autograd would free it only then). Its version was bumped when it was
    overwritten, so a second backward through the graph fails before reading it."""
    buffer.untyped_storage().resize_(0)


class SwiGLUExpertsFunction(torch.autograd.Function):
    """Differentiable SwiGLU experts over expert-grouped rows (see module docstring)."""

    @staticmethod
    def forward(ctx, x_XD, w1_EFD, w2_EDF, w3_EFD, scores_S, group_end_E, row_slot_S, top_k, slot_row_S):
        routed = row_slot_S is not None
        num_experts, hidden, dim = w1_EFD.shape
        num_rows = row_slot_S.shape[0] if routed else x_XD.shape[0]
        x_XD = x_XD.contiguous()
        w1, w2, w3 = (w.to(x_XD.dtype).contiguous() for w in (w1_EFD, w2_EDF, w3_EFD))
        x_RD = _grouped_rows(x_XD, slot_row_S, top_k) if routed else x_XD
        save_preact = any(ctx.needs_input_grad[:5])
        split = gate_up_in_two_passes(dim, hidden)
        gate_RF = x_XD.new_empty(num_rows, hidden) if save_preact or split else None
        up_RF = x_XD.new_empty(num_rows, hidden) if save_preact else None
        h_RF = x_XD.new_empty(num_rows, hidden)
        scores = scores_S.contiguous() if routed else None
        common = _row_tile_meta(x_XD.dtype, num_experts)
        grid = _row_tile_grid(num_rows, num_experts, hidden)
        use_tma, (x_desc, w1_desc, w3_desc) = tensor_descriptors(x_RD, w1, w3)
        if split:
            for up_pass, w, w_desc in ((False, w1, w1_desc), (True, w3, w3_desc)):
                _gate_up_pass_kernel[grid](
                    x_desc,
                    w_desc,
                    x_RD,
                    w,
                    gate_RF,
                    up_RF,
                    h_RF,
                    group_end_E,
                    num_rows,
                    num_experts,
                    dim,
                    hidden,
                    UP_PASS=up_pass,
                    SAVE_UP=save_preact,
                    USE_TMA=use_tma,
                    **common,
                )
        else:
            _gate_up_forward_kernel[grid](
                x_desc,
                w1_desc,
                w3_desc,
                x_RD,
                w1,
                w3,
                gate_RF,
                up_RF,
                h_RF,
                group_end_E,
                num_rows,
                num_experts,
                dim,
                hidden,
                SAVE_PREACT=save_preact,
                USE_TMA=use_tma,
                **common,
            )
        rows_out = x_XD.new_empty(num_rows, dim)
        use_tma, (h_desc, w2_desc) = tensor_descriptors(h_RF, w2)
        _down_forward_kernel[_row_tile_grid(num_rows, num_experts, dim)](
            h_desc,
            w2_desc,
            h_RF,
            w2,
            rows_out,
            row_slot_S,
            scores,
            group_end_E,
            num_rows,
            num_experts,
            dim,
            hidden,
            HAS_GATHER=routed,
            USE_TMA=use_tma,
            **common,
        )
        out = sum_slots(rows_out, None, top_k, num_rows // top_k) if routed and top_k > 1 else rows_out
        x_for_weight_grads = x_RD if any(ctx.needs_input_grad[1:4]) else None
        ctx.save_for_backward(
            x_for_weight_grads, w1_EFD, w2_EDF, w3_EFD, scores, group_end_E, row_slot_S, slot_row_S, gate_RF, up_RF
        )
        ctx.top_k = top_k
        ctx.routed = routed
        return out

    @staticmethod
    def backward(ctx, dout):
        x_RD, w1_EFD, w2_EDF, w3_EFD, scores, group_end_E, row_slot_S, slot_row_S, gate_RF, up_RF = ctx.saved_tensors
        routed, top_k = ctx.routed, ctx.top_k
        num_experts, hidden, dim = w1_EFD.shape
        num_rows = gate_RF.shape[0]
        dout = dout.to(gate_RF.dtype).contiguous()
        w1, w2, w3 = (w.to(gate_RF.dtype).contiguous() for w in (w1_EFD, w2_EDF, w3_EFD))
        row_common = _row_tile_meta(gate_RF.dtype, num_experts)

        dout_RD = _grouped_rows(dout, slot_row_S, top_k) if routed else dout
        dh_RF = gate_RF.new_empty(num_rows, hidden)
        use_tma, (dy_desc, w2_desc) = tensor_descriptors(dout_RD, w2)
        _down_backward_kernel[_row_tile_grid(num_rows, num_experts, hidden)](
            dy_desc,
            w2_desc,
            dout_RD,
            w2,
            dh_RF,
            group_end_E,
            num_rows,
            num_experts,
            dim,
            hidden,
            USE_TMA=use_tma,
            **row_common,
        )
        dscores_S = torch.zeros(num_rows, device=dout.device, dtype=torch.float32) if routed else None
        rows_per_program, block_f = _elementwise_tile(hidden)
        _swiglu_backward_kernel[(max(1, triton.cdiv(num_rows, rows_per_program)),)](
            dh_RF,
            gate_RF,
            up_RF,
            row_slot_S,
            scores,
            dscores_S,
            group_end_E,
            num_experts,
            hidden,
            HAS_GATHER=routed,
            ROWS=rows_per_program,
            BLOCK_F=block_f,
        )
        for overwritten in (gate_RF, up_RF):
            torch.autograd.graph.increment_version(overwritten)
        hs_RF = dh_RF
        dgate_RF, dup_RF = gate_RF, up_RF

        dw2 = None
        if ctx.needs_input_grad[2]:
            dw2 = torch.empty_like(w2_EDF)
            _weight_gradient(dout_RD, hs_RF, group_end_E, dw2)
        del dout_RD, hs_RF, dh_RF

        dx = None
        if ctx.needs_input_grad[0]:
            dx_rows = gate_RF.new_empty(num_rows, dim)
            operands = (dgate_RF, dup_RF, w1, w3)
            use_tma, descriptors = tensor_descriptors(*operands)
            _gate_up_backward_input_kernel[_row_tile_grid(num_rows, num_experts, dim)](
                *descriptors,
                *operands,
                dx_rows,
                row_slot_S,
                group_end_E,
                num_rows,
                num_experts,
                dim,
                hidden,
                HAS_GATHER=routed,
                USE_TMA=use_tma,
                **row_common,
            )
            dx = sum_slots(dx_rows, None, top_k, num_rows // top_k) if routed and top_k > 1 else dx_rows
            del dx_rows

        dw1 = dw3 = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
            dw1 = torch.empty_like(w1_EFD)
            _weight_gradient(dgate_RF, x_RD, group_end_E, dw1)
            _release_saved_buffer(dgate_RF)
            dw3 = torch.empty_like(w3_EFD)
            _weight_gradient(dup_RF, x_RD, group_end_E, dw3)
        dscores = None
        if routed and ctx.needs_input_grad[4]:
            dscores = dscores_S.to(scores.dtype)
        return dx, dw1, dw2, dw3, dscores, None, None, None, None


def swiglu_experts(
    x_XD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    group_end_E: torch.Tensor,
    row_slot_S: torch.Tensor | None = None,
    scores_S: torch.Tensor | None = None,
    top_k: int = 1,
    slot_row_S: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU experts; grouped mode when row_slot_S is None, routed mode otherwise.

    Args:
        x_XD: grouped mode: [R, D] rows grouped by expert; routed mode: [T, D] tokens.
        group_end_E: [E] int32 exclusive end row of each expert's segment.
        row_slot_S: routed mode: [S = T*K] int32 token-major slot of each grouped row.
        scores_S: routed mode: [S] router weight of each slot (token-major).
        top_k: routed mode: K.
        slot_row_S: routed mode: [S] int32 grouped row of each slot, the inverse of row_slot_S
            (``routing_metadata`` returns both).

    Returns:
        grouped: [R, D]; routed: [T, D] = sum_k scores * expert output. Dtype of x.
    """
    tensors = [x_XD, w1_EFD, w2_EDF, w3_EFD, group_end_E]
    if row_slot_S is not None:
        if scores_S is None or slot_row_S is None:
            raise ValueError("routed mode needs scores_S and slot_row_S alongside row_slot_S")
        tensors += [row_slot_S, scores_S, slot_row_S]
    check_runnable(*tensors)
    _announce_first_use(x_XD, w1_EFD, routed=row_slot_S is not None)
    return SwiGLUExpertsFunction.apply(
        x_XD, w1_EFD, w2_EDF, w3_EFD, scores_S, group_end_E, row_slot_S, top_k, slot_row_S
    )
