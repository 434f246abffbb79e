"""FP8 (e4m3) quantisation of expert weights, one Triton kernel per layout.

Both take expert weights ``w_EPK`` as parts stacked along P (e.g. the gate and up projections
``[w1; w3]``), without stacking them in memory, and apply the rule of ``quantize_rowwise``
(``experiments.moe_backends.fp8_experts``): a power-of-two scale ``2^floor(log2(448 / amax))`` per
row of the operand, ``amax`` its absolute maximum (at least ``SMALLEST_AMAX``).

``quantize_rows(w_parts)``: the forward GEMM's weight operand, each (expert, row) of the stack scaled
along K: ``values_ENK`` e4m3 [E, N, K], ``inverse_EN1`` fp32 [E, N, 1]. Compiled as plain torch,
Inductor's kernel loops over each row twice (absolute maximum, then scale and cast); this one holds
each row whole and reads it once.

``quantize_columns_transposed(w_parts)`` returns the stack's columns quantised and laid out
transposed, the input gradient's weight operand:

- ``values_EKN`` e4m3, row-major [E, K, N] with N the parts' summed rows:
  ``values[e, k, n] = clamp(w[e, n, k] * scale[e, k], -448, 448)`` rounded to e4m3;
- ``inverse_EK1`` fp32 [E, K, 1]: ``1 / scale``, ``scale = 2^floor(log2(448 / amax))`` with ``amax``
  the column's absolute maximum over N (at least ``SMALLEST_AMAX``).

That is ``quantize_rowwise`` (``experiments.moe_backends.fp8_experts``) of the stack's transpose,
made row-major: the operand ``torch._scaled_grouped_mm`` needs for ``d x = d y @ w[e]``. Compiled as
plain torch, Inductor reduces over the strided dimension and writes the transpose in separate
passes; the kernel reads each column block twice (absolute maximum, then scale and cast) and writes
the transposed e4m3 tile once. Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels.availability import check_runnable

E4M3_MAX = 448.0
"""The largest finite e4m3 (``torch.float8_e4m3fn``) value."""
SMALLEST_AMAX = 1e-12
"""The amax a row or column of zeros is scaled as (any positive value: its e4m3 values are zeros)."""
BLOCK_N = 128
BLOCK_K = 64
"""The column kernel's tile: ``BLOCK_N`` rows of ``BLOCK_K`` columns per load. On an H200, at Qwen3-30B-A3B's
gate and up weights, 128 x 64 took 0.54 ms from bf16 and 0.89 from fp32, against 0.66 and 1.01 for 64 x 64,
the fastest or within 2% of it over 24 tile and warp counts (docs/results/fp8_experts.md)."""
MAX_PARTS = 2
ROW_KERNEL_ELEMENTS = 8192
"""Elements one program of the row kernel holds: as many rows (K padded to a power of 2) as fit, at
least one, at most 16."""


@triton.jit
def _part_amax(part_ptr, expert, rows, k, k_ok, amax, K, BLOCK_N: tl.constexpr):
    """``amax`` [BLOCK_K] updated with the absolute maxima of columns ``k`` of one part's expert."""
    base = part_ptr + expert * rows * K
    for start in range(0, rows, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        mask = (n[:, None] < rows) & k_ok[None, :]
        tile = tl.load(base + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(tile), axis=0))
    return amax


@triton.jit
def _part_store_transposed(
    part_ptr,
    values_ptr,
    expert,
    rows,
    first_row,
    total_rows,
    k,
    k_ok,
    scale,
    K,
    E4M3_MAX: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Scale, cast and store one part's rows as columns ``first_row + n`` of ``values[expert, k, :]``."""
    base = part_ptr + expert * rows * K
    out = values_ptr + expert * K * total_rows
    for start in range(0, rows, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        mask = (n[:, None] < rows) & k_ok[None, :]
        tile = tl.load(base + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        quantized = tl.clamp(tile * scale[None, :], -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
        tl.store(
            out + k[:, None] * total_rows + (first_row + n)[None, :],
            tl.trans(quantized),
            mask=tl.trans(mask),
        )


@triton.jit
def _quantize_columns_transposed_kernel(
    first_ptr,
    second_ptr,
    FIRST_ROWS,
    SECOND_ROWS,
    values_ptr,
    inverse_ptr,
    K,
    E4M3_MAX: tl.constexpr,
    SMALLEST_AMAX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per (expert, block of BLOCK_K columns); ``SECOND_ROWS`` 0: one part."""
    expert = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    total_rows = FIRST_ROWS + SECOND_ROWS
    amax = tl.full([BLOCK_K], SMALLEST_AMAX, tl.float32)
    amax = _part_amax(first_ptr, expert, FIRST_ROWS, k, k_ok, amax, K, BLOCK_N)
    amax = _part_amax(second_ptr, expert, SECOND_ROWS, k, k_ok, amax, K, BLOCK_N)
    scale = tl.exp2(tl.floor(tl.log2(tl.math.div_rn(E4M3_MAX, amax))))
    tl.store(inverse_ptr + expert * K + k, 1.0 / scale, mask=k_ok)
    _part_store_transposed(
        first_ptr, values_ptr, expert, FIRST_ROWS, 0, total_rows, k, k_ok, scale, K, E4M3_MAX, BLOCK_N
    )
    _part_store_transposed(
        second_ptr, values_ptr, expert, SECOND_ROWS, FIRST_ROWS, total_rows, k, k_ok, scale, K, E4M3_MAX, BLOCK_N
    )


@triton.jit
def _quantize_rows_kernel(
    first_ptr,
    second_ptr,
    FIRST_ROWS,
    SECOND_ROWS,
    values_ptr,
    inverse_ptr,
    K,
    E4M3_MAX: tl.constexpr,
    SMALLEST_AMAX: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per (expert, ``ROWS`` rows of the stack), each row read once in one ``BLOCK_K`` >= K
    tile; ``SECOND_ROWS`` 0: one part."""
    expert = tl.program_id(0).to(tl.int64)
    total_rows = FIRST_ROWS + SECOND_ROWS
    n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    k_ok = (k < K)[None, :]
    in_first = n < FIRST_ROWS
    in_second = (n >= FIRST_ROWS) & (n < total_rows)
    first_rows = first_ptr + (expert * FIRST_ROWS + n) * K
    second_rows = second_ptr + (expert * SECOND_ROWS + n - FIRST_ROWS) * K
    tile = tl.load(first_rows[:, None] + k[None, :], mask=in_first[:, None] & k_ok, other=0.0).to(tl.float32)
    tile += tl.load(second_rows[:, None] + k[None, :], mask=in_second[:, None] & k_ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(tile), axis=1), SMALLEST_AMAX)
    scale = tl.exp2(tl.floor(tl.log2(tl.math.div_rn(E4M3_MAX, amax))))
    row_ok = n < total_rows
    tl.store(inverse_ptr + expert * total_rows + n, 1.0 / scale, mask=row_ok)
    quantized = tl.clamp(tile * scale[:, None], -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    out_rows = values_ptr + (expert * total_rows + n) * K
    tl.store(out_rows[:, None] + k[None, :], quantized, mask=row_ok[:, None] & k_ok)


def _kernel_parts(w_parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The kernels' first four arguments, ``(first, second, FIRST_ROWS, SECOND_ROWS)``, once ``w_parts``
    are 1 to ``MAX_PARTS`` [E, P, K] tensors of one E, K and dtype that the kernels can run on (one
    part: passed twice, with no second rows)."""
    if not 1 <= len(w_parts) <= MAX_PARTS:
        raise ValueError(f"FP8 weight quantisation takes 1 to {MAX_PARTS} weight parts, got {len(w_parts)}")
    check_runnable(*w_parts)
    parts = [w.contiguous() for w in w_parts]
    experts, _, dim = parts[0].shape
    if any(w.shape[0] != experts or w.shape[2] != dim or w.dtype != parts[0].dtype for w in parts):
        raise ValueError(f"weight parts differ in E, K or dtype: {[(tuple(w.shape), w.dtype) for w in parts]}")
    if len(parts) == 1:
        return parts[0], parts[0], parts[0].shape[1], 0
    return parts[0], parts[1], parts[0].shape[1], parts[1].shape[1]


@torch.library.custom_op("torchtitan_ext::quantize_rows", mutates_args=())
def quantize_rows(w_parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(module docstring) ``w_parts``: one or two [E, P, K] tensors of one dtype and E, K."""
    first, second, first_rows, second_rows = _kernel_parts(w_parts)
    experts, _, dim = first.shape
    rows = first_rows + second_rows
    values_ENK = first.new_empty(experts, rows, dim, dtype=torch.float8_e4m3fn)
    inverse_EN1 = first.new_empty(experts, rows, 1, dtype=torch.float32)
    block_k = triton.next_power_of_2(dim)
    rows_per_program = max(1, min(16, ROW_KERNEL_ELEMENTS // block_k))
    _quantize_rows_kernel[(experts, triton.cdiv(rows, rows_per_program))](
        first,
        second,
        first_rows,
        second_rows,
        values_ENK,
        inverse_EN1,
        dim,
        E4M3_MAX=E4M3_MAX,
        SMALLEST_AMAX=SMALLEST_AMAX,
        ROWS=rows_per_program,
        BLOCK_K=block_k,
        num_warps=8 if block_k >= 4096 else 4,
    )
    return values_ENK, inverse_EN1


@quantize_rows.register_fake
def _(w_parts):
    experts, _, dim = w_parts[0].shape
    rows = sum(w.shape[1] for w in w_parts)
    values = w_parts[0].new_empty(experts, rows, dim, dtype=torch.float8_e4m3fn)
    return values, w_parts[0].new_empty(experts, rows, 1, dtype=torch.float32)


@torch.library.custom_op("torchtitan_ext::quantize_columns_transposed", mutates_args=())
def quantize_columns_transposed(
    w_parts: list[torch.Tensor], ordered_after: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(module docstring) ``w_parts``: one or two [E, P, K] tensors of one dtype and E, K.

    ``ordered_after`` is never read: a compiled graph runs the op only once that tensor exists. The
    backward passes the gradient the weight multiplies, so the partitioner cannot quantise in the
    forward and keep the e4m3 copy until the backward (memory FSDP cannot free, unlike the weight)."""
    first, second, first_rows, second_rows = _kernel_parts(w_parts)
    experts, _, dim = first.shape
    values_EKN = first.new_empty(experts, dim, first_rows + second_rows, dtype=torch.float8_e4m3fn)
    inverse_EK1 = first.new_empty(experts, dim, 1, dtype=torch.float32)
    _quantize_columns_transposed_kernel[(experts, triton.cdiv(dim, BLOCK_K))](
        first,
        second,
        first_rows,
        second_rows,
        values_EKN,
        inverse_EK1,
        dim,
        E4M3_MAX=E4M3_MAX,
        SMALLEST_AMAX=SMALLEST_AMAX,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return values_EKN, inverse_EK1


@quantize_columns_transposed.register_fake
def _(w_parts, ordered_after=None):
    experts, _, dim = w_parts[0].shape
    rows = sum(w.shape[1] for w in w_parts)
    values = w_parts[0].new_empty(experts, dim, rows, dtype=torch.float8_e4m3fn)
    return values, w_parts[0].new_empty(experts, dim, 1, dtype=torch.float32)
