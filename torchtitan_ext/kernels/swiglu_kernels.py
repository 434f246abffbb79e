"""Triton kernels of the SwiGLU expert block over expert-grouped rows (``@triton.jit``), each with
the configs it is launched with.

For the rows of expert e (weights in torchtitan's layouts w1 [E,F,D], w2 [E,D,F], w3 [E,F,D]):

    gate = x @ w1[e].T,  up = x @ w3[e].T,  h = silu(gate) * up,  y = h @ w2[e].T

Row-tile kernels walk tiles of the expert segments (``tiles.locate_row_tile``); rows after the last
segment belong to no expert. In grouped mode nothing is written for them (their pre-activations,
output and input-gradient rows stay unset, as ``torch._grouped_mm`` leaves them); in routed mode
(``HAS_GATHER``) they are dropped slots, whose output and input-gradient rows get zeros for the sum
over a token's slots (the pre-activations stay unset there too). With ``HAS_GATHER`` the down
projection writes each row to slot ``row_slot[r]``; with ``HAS_SCORES`` its epilogue multiplies the
row by a router score, the slot's (routed mode) or the row's own (grouped mode with row scores), and
the SwiGLU backward writes that score's gradient. ``swiglu_passes`` launches them; ``swiglu_experts``
is the differentiable op.
"""

import triton
import triton.language as tl

from torchtitan_ext.kernels.launch_configs import (
    GATE_UP_FORWARD_CONFIGS,
    PLAIN_GEMM_CONFIGS,
    WEIGHT_GRADIENT_CONFIGS,
    descriptor_blocks,
    fit_to_shape,
    fitted,
    gemm_configs,
)
from torchtitan_ext.kernels.tiles import locate_row_tile, swizzle_tile


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


@triton.jit
def program_tile_of_rows_times_weight_transposed(
    a_desc,
    w_desc,
    a_ptr,
    w_ptr,
    group_end_ptr,
    num_rows,
    num_experts,
    size_n,
    size_k,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """This program's tile of ``a[rows] @ w[e].T`` over grouped rows a [R, size_k] and w [E, size_n,
    size_k] (``_program_row_tile``): ``(acc, expert, rows, row_mask, cols, col_mask)``, ``acc`` fp32
    and zero for rows of no expert (expert == num_experts); the masks are the caller's store masks."""
    expert, row_start, row_end, n_tile = _program_row_tile(
        group_end_ptr, num_rows, num_experts, size_n, BLOCK_E, GROUP_M, BLOCK_M, BLOCK_N
    )
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert < num_experts:
        acc = _accumulate_rows_times_weight_transposed(
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
            USE_TMA,
            DOT_PRECISION,
            EVEN_K,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    return acc, expert, rows, rows < row_end, cols, cols < size_n


WEIGHT_BLOCK = (1, "BLOCK_N", "BLOCK_K")
"""Descriptor block of a [E, N, K] weight read as w[e].T tiles."""


@fitted(
    gemm_configs(
        GATE_UP_FORWARD_CONFIGS,
        pre_hook=descriptor_blocks(x_desc=("BLOCK_M", "BLOCK_K"), w1_desc=WEIGHT_BLOCK, w3_desc=WEIGHT_BLOCK),
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
    gemm_configs(PLAIN_GEMM_CONFIGS, pre_hook=descriptor_blocks(x_desc=("BLOCK_M", "BLOCK_K"), w_desc=WEIGHT_BLOCK)),
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
    gemm_configs(PLAIN_GEMM_CONFIGS, pre_hook=descriptor_blocks(h_desc=("BLOCK_M", "BLOCK_K"), w2_desc=WEIGHT_BLOCK)),
    key=["dim", "hidden", "HAS_GATHER", "HAS_SCORES", "USE_TMA"],
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
    HAS_SCORES: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[dest rows] = (scores[dest] *) h @ w2[e].T; rows of no expert get zeros in routed mode
    (dropped slots) and are not written in grouped mode.

    With USE_TMA, h [R, F] and w2 [E, D, F] load through tensor descriptors: a row tile may
    read rows past its expert's segment, whose outputs are masked at the store.
    """
    acc, expert, rows, row_mask, cols, col_mask = program_tile_of_rows_times_weight_transposed(
        h_desc,
        w2_desc,
        h_ptr,
        w2_ptr,
        group_end_ptr,
        num_rows,
        num_experts,
        dim,
        hidden,
        USE_TMA,
        DOT_PRECISION,
        BLOCK_E,
        GROUP_M,
        EVEN_K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    if not HAS_GATHER:  # noqa: SIM102  # Triton: a compile-time branch around a runtime one
        if expert >= num_experts:
            return
    dest = _destination_rows(rows, row_mask, row_slot_ptr, HAS_GATHER)
    if HAS_SCORES:
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
    dgate_ptr,
    dup_ptr,
    row_slot_ptr,
    scores_ptr,
    dscores_ptr,
    group_end_ptr,
    num_experts,
    hidden,
    HAS_GATHER: tl.constexpr,
    HAS_SCORES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Over the rows of every expert: d gate and d up from dh, gate and up; dh <- (score *) h in place.

    With ``HAS_SCORES`` each row's score is that of its slot ``row_slot[r]`` (``HAS_GATHER``) or its
    own, and its gradient sum_f dh * h goes to the same index of dscores, summed over F in a fixed
    order inside one program.
    """
    num_assigned = tl.load(group_end_ptr + num_experts - 1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_assigned
    if HAS_SCORES:
        score_index = _destination_rows(rows, row_mask, row_slot_ptr, HAS_GATHER)
        score = tl.load(scores_ptr + score_index, mask=row_mask, other=0.0).to(tl.float32)
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
        if HAS_SCORES:
            # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr HAS_SCORES
            dscore += tl.sum(dh * h, axis=1)
            # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr HAS_SCORES
            dh = dh * score[:, None]
            h = h * score[:, None]
        tl.store(
            dgate_ptr + offsets, (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(dgate_ptr.dtype.element_ty), mask=mask
        )
        tl.store(dup_ptr + offsets, (dh * silu).to(dup_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + offsets, h.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_SCORES:
        # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr HAS_SCORES
        tl.store(dscores_ptr + score_index, dscore, mask=row_mask)


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
    """dx[dest rows] = dgate @ w1[e] + dup @ w3[e]; rows of no expert get zeros in routed mode
    (dropped slots) and are not written in grouped mode."""
    expert, row_start, row_end, n_tile = _program_row_tile(
        group_end_ptr, num_rows, num_experts, dim, BLOCK_E, GROUP_M, BLOCK_M, BLOCK_N
    )
    if not HAS_GATHER:  # noqa: SIM102  # Triton: a compile-time branch around a runtime one
        if expert >= num_experts:
            return
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
