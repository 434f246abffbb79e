"""FP8 (e4m3) quantisation of the expert GEMMs' operands: the weights, one Triton kernel per layout,
and the activations' rows.

The weight kernels take expert weights ``w_EPK`` as parts stacked along P (e.g. the gate and up projections
``[w1; w3]``), without stacking them in memory, and apply the rule of ``quantize_rowwise``
(``experiments.moe_backends.fp8_experts``): a power-of-two scale ``2^floor(log2(448 / amax))`` per
row of the operand, ``amax`` its absolute maximum (at least ``SMALLEST_AMAX``).

``quantize_rows(w_parts)``: the forward GEMM's weight operand, each (expert, row) of the stack scaled
along K: ``values_ENK`` e4m3 [E, N, K], ``inverse_EN1`` fp32 [E, N, 1]. Compiled as plain torch,
Inductor's kernel loops over each row twice (absolute maximum, then scale and cast); this one holds
each row whole and reads it once.

``quantize_rows_transposed(w_parts, inverse_E11)`` is the input gradient's weight operand (e4m3
operands must be K-major on Hopper, and ``d x = d y @ w[e]`` contracts over N): ``values_EKN``
row-major [E, K, N], ``values[e, k, n] = e4m3(w[e, n, k] / inverse[e])``, one power-of-two scale per
expert (the forward's row scales run along this GEMM's contraction; the largest of an expert's inverse
row scales, which ``quantize_rows`` returned, is the rule's scale of the whole expert), so no maximum
is taken again. Each tile is read once and stored transposed.

``quantize_activation_rows(parts, group_end)`` quantises the rows of activations, the left operand of
the FP8 GEMMs (the tokens, the SwiGLU output, the output gradients): the rows of the parts joined
along their last dimension (e.g. ``[d gate, d up]``, never joined in memory), ``values_RK`` e4m3 and
``inverse_R1`` fp32, with the rule of ``quantize_rowwise``, for the rows of the experts only (rows
from ``group_end[E-1]`` on, which no GEMM reads, stay unset). One program reads its rows once (rows
longer than ``ACTIVATION_BLOCK`` twice, in blocks). Compiled as
plain torch, Inductor's kernel took 2-5x longer on an H200 (0.21 against 0.10 ms for 65536 x 2048
bf16 rows, 0.39 against 0.08 for 65536 x 1536) and quantised every row of a static receive buffer.

``permute_quantize_rows(x_TD, dest_row_S, top_k, num_rows)`` is the token permute of the FP8 experts'
routed path (``kernels.moe_permute``'s contract: slot ``s`` of token ``s // top_k`` goes to row
``dest_row_S[s]``, -1 for none) that also quantises: each token row read once, its copy and its e4m3
row (one scale per token: every copy has the same values) written to each of its slots' rows. The same
op permutes the output gradient in the backward.

Each scaled value is cast to e4m3 rounding to nearest, ties to even, as torch's cast does. Under
Triton's interpreter, whose cast rounds wrongly where the rounding carries into the exponent or
reaches subnormals, the kernels round in fp32 arithmetic first and the cast is exact, so the CPU
tests see torch's values. Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels.availability import check_runnable, interpreter_enabled
from torchtitan_ext.kernels.library_ops import kernel_op

E4M3_MAX = 448.0
"""The largest finite e4m3 (``torch.float8_e4m3fn``) value."""
SMALLEST_AMAX = 1e-12
"""The amax a row or column of zeros is scaled as (any positive value: its e4m3 values are zeros)."""
BLOCK_N = 64
BLOCK_K = 128
"""The transposing kernel's tile: ``BLOCK_N`` rows of ``BLOCK_K`` columns (``BLOCK_N`` e4m3 bytes per stored row)."""
MAX_PARTS = 2
ROW_KERNEL_ELEMENTS = 8192
"""Elements one program of the row kernel holds: as many rows (K padded to a power of 2) as fit, at
least one, at most 16."""
ACTIVATION_BLOCK = 8192
"""Columns the activation kernel holds per row at once: longer rows take two passes in blocks."""
ACTIVATION_PROGRAM_ELEMENTS = 4096
"""Elements per program of the activation kernel (rows of up to ``ACTIVATION_BLOCK`` columns, at least one
row): on an H200, 1-4 rows of 2048 columns and 2-8 of 768 ran within 5% of each other."""


def rule_constexprs() -> dict:
    """The rule's constexpr arguments of the kernels that take a row's maximum: ``E4M3_MAX``,
    ``SMALLEST_AMAX`` and ``ROUND_IN_FP32`` (under Triton's interpreter)."""
    return {"E4M3_MAX": E4M3_MAX, "SMALLEST_AMAX": SMALLEST_AMAX, "ROUND_IN_FP32": interpreter_enabled()}


@triton.jit
def power_of_two_scale(amax, E4M3_MAX: tl.constexpr, SMALLEST_AMAX: tl.constexpr):
    """The rule's scale of rows whose absolute maxima are ``amax`` (fp32): ``2^floor(log2(448 / amax))``,
    ``amax`` at least ``SMALLEST_AMAX``."""
    return tl.exp2(tl.floor(tl.log2(tl.math.div_rn(E4M3_MAX, tl.maximum(amax, SMALLEST_AMAX)))))


@triton.jit
def cast_to_e4m3(scaled, E4M3_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """``scaled`` (fp32) clamped to +-E4M3_MAX and cast to e4m3 (round to nearest, ties to even).
    ``ROUND_IN_FP32`` (Triton's interpreter) rounds in fp32 arithmetic first, so that the cast is exact:
    adding and taking away ``1.5 * 2^23`` times the value's e4m3 step (2^(e-3) at exponent e, 2^-9
    below the normals) leaves it on that step's grid."""
    clamped = tl.clamp(scaled, -E4M3_MAX, E4M3_MAX)
    if not ROUND_IN_FP32:
        return clamped.to(tl.float8e4nv)
    bits = clamped.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((exponent + 20 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    rounded = (tl.abs(clamped) + magic) - magic
    sign = bits & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _stack_tile(first_ptr, second_ptr, FIRST_ROWS, SECOND_ROWS, expert, n, k_ok, k, K):
    """[len(n), len(k)] fp32 tile of one expert's stack ``[first; second]`` (zeros outside it): rows
    ``n`` of the stack, columns ``k`` (``k_ok`` [1, len(k)]: inside K)."""
    total_rows = FIRST_ROWS + SECOND_ROWS
    in_first = n < FIRST_ROWS
    in_second = (n >= FIRST_ROWS) & (n < total_rows)
    first_rows = first_ptr + (expert * FIRST_ROWS + n) * K
    second_rows = second_ptr + (expert * SECOND_ROWS + n - FIRST_ROWS) * K
    tile = tl.load(first_rows[:, None] + k[None, :], mask=in_first[:, None] & k_ok, other=0.0).to(tl.float32)
    return tile + tl.load(second_rows[:, None] + k[None, :], mask=in_second[:, None] & k_ok, other=0.0).to(tl.float32)


@triton.jit
def _quantize_rows_transposed_kernel(
    first_ptr,
    second_ptr,
    FIRST_ROWS,
    SECOND_ROWS,
    inverse_ptr,
    values_ptr,
    K,
    E4M3_MAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per (expert, ``BLOCK_N`` rows of the stack, ``BLOCK_K`` columns): each tile read
    once, scaled by its expert's given scale, cast and stored transposed; ``SECOND_ROWS`` 0: one part."""
    expert = tl.program_id(0).to(tl.int64)
    total_rows = FIRST_ROWS + SECOND_ROWS
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = (k < K)[None, :]
    tile = _stack_tile(first_ptr, second_ptr, FIRST_ROWS, SECOND_ROWS, expert, n, k_ok, k, K)
    row_ok = n < total_rows
    quantized = cast_to_e4m3(tile * (1.0 / tl.load(inverse_ptr + expert)), E4M3_MAX, ROUND_IN_FP32)
    out = values_ptr + expert * K * total_rows + k[:, None] * total_rows + n[None, :]
    tl.store(out, tl.trans(quantized), mask=tl.trans(row_ok[:, None] & k_ok))


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
    ROUND_IN_FP32: tl.constexpr,
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
    tile = _stack_tile(first_ptr, second_ptr, FIRST_ROWS, SECOND_ROWS, expert, n, k_ok, k, K)
    scale = power_of_two_scale(tl.max(tl.abs(tile), axis=1), E4M3_MAX, SMALLEST_AMAX)
    row_ok = n < total_rows
    tl.store(inverse_ptr + expert * total_rows + n, 1.0 / scale, mask=row_ok)
    quantized = cast_to_e4m3(tile * scale[:, None], E4M3_MAX, ROUND_IN_FP32)
    out_rows = values_ptr + (expert * total_rows + n) * K
    tl.store(out_rows[:, None] + k[None, :], quantized, mask=row_ok[:, None] & k_ok)


@triton.jit
def _activation_block(first_ptr, second_ptr, rows, first_stride, second_stride, cols, row_ok, FIRST_COLS, SECOND_COLS):
    """[ROWS, BLOCK] fp32 block of the joined rows at columns ``cols`` (zeros outside the rows and parts)."""
    in_first = cols < FIRST_COLS
    in_second = (cols >= FIRST_COLS) & (cols < FIRST_COLS + SECOND_COLS)
    first = first_ptr + rows.to(tl.int64)[:, None] * first_stride + cols[None, :]
    second = second_ptr + rows.to(tl.int64)[:, None] * second_stride + (cols - FIRST_COLS)[None, :]
    block = tl.load(first, mask=row_ok[:, None] & in_first[None, :], other=0.0).to(tl.float32)
    return block + tl.load(second, mask=row_ok[:, None] & in_second[None, :], other=0.0).to(tl.float32)


@triton.jit
def _quantize_activation_rows_kernel(
    first_ptr,
    second_ptr,
    first_stride,
    second_stride,
    FIRST_COLS,
    SECOND_COLS,
    values_ptr,
    inverse_ptr,
    group_end_ptr,
    num_experts,
    E4M3_MAX: tl.constexpr,
    SMALLEST_AMAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    """One program per ``ROWS`` rows; rows from ``group_end[E-1]`` on are skipped. ``ONE_BLOCK``: a row
    fits in ``BLOCK`` columns and is read once; otherwise twice (absolute maximum, then scale and cast)."""
    num_assigned = tl.load(group_end_ptr + num_experts - 1)
    first_row = tl.program_id(0) * ROWS
    if first_row >= num_assigned:
        return
    rows = first_row + tl.arange(0, ROWS)
    row_ok = rows < num_assigned
    total_cols = FIRST_COLS + SECOND_COLS
    out_rows = values_ptr + rows.to(tl.int64)[:, None] * total_cols
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        block = _activation_block(
            first_ptr, second_ptr, rows, first_stride, second_stride, cols, row_ok, FIRST_COLS, SECOND_COLS
        )
        amax = tl.max(tl.abs(block), axis=1)
    else:
        amax = tl.zeros([ROWS], tl.float32)
        for start in range(0, total_cols, BLOCK):
            block = _activation_block(
                first_ptr, second_ptr, rows, first_stride, second_stride, start + cols, row_ok, FIRST_COLS,
                SECOND_COLS,
            )  # fmt: skip
            amax = tl.maximum(amax, tl.max(tl.abs(block), axis=1))
    scale = power_of_two_scale(amax, E4M3_MAX, SMALLEST_AMAX)
    tl.store(inverse_ptr + rows, 1.0 / scale, mask=row_ok)
    if ONE_BLOCK:
        # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr ONE_BLOCK
        quantized = cast_to_e4m3(block * scale[:, None], E4M3_MAX, ROUND_IN_FP32)
        tl.store(out_rows + cols[None, :], quantized, mask=row_ok[:, None] & (cols < total_cols)[None, :])
    else:
        for start in range(0, total_cols, BLOCK):
            block = _activation_block(
                first_ptr, second_ptr, rows, first_stride, second_stride, start + cols, row_ok, FIRST_COLS,
                SECOND_COLS,
            )  # fmt: skip
            quantized = cast_to_e4m3(block * scale[:, None], E4M3_MAX, ROUND_IN_FP32)
            mask = row_ok[:, None] & (start + cols < total_cols)[None, :]
            tl.store(out_rows + (start + cols)[None, :], quantized, mask=mask)


@triton.jit
def _permute_quantize_kernel(
    x_ptr,
    rows_ptr,
    values_ptr,
    inverse_ptr,
    dest_ptr,
    dim,
    E4M3_MAX: tl.constexpr,
    SMALLEST_AMAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    """One program per token: its row copied to the rows of its K slots (``dest`` -1: none) and quantised
    there with one scale; read once (``ONE_BLOCK``: the row fits in ``BLOCK_D``), else twice in blocks."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    x_row = x_ptr + token * dim
    if ONE_BLOCK:
        row = tl.load(x_row + cols, mask=cols < dim, other=0.0)
        amax = tl.max(tl.abs(row.to(tl.float32)), axis=0)
    else:
        amax = tl.max(tl.zeros([BLOCK_D], tl.float32), axis=0)
        for start in range(0, dim, BLOCK_D):
            block = tl.load(x_row + start + cols, mask=start + cols < dim, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(block.to(tl.float32)), axis=0))
    scale = power_of_two_scale(amax, E4M3_MAX, SMALLEST_AMAX)
    for k in tl.static_range(TOP_K):
        dest = tl.load(dest_ptr + token * TOP_K + k).to(tl.int64)
        tl.store(inverse_ptr + dest, 1.0 / scale, mask=dest >= 0)
    for start in range(0, dim, BLOCK_D):
        if ONE_BLOCK:
            # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr ONE_BLOCK
            block = row
        else:
            block = tl.load(x_row + start + cols, mask=start + cols < dim, other=0.0)
        quantized = cast_to_e4m3(block.to(tl.float32) * scale, E4M3_MAX, ROUND_IN_FP32)
        for k in tl.static_range(TOP_K):
            dest = tl.load(dest_ptr + token * TOP_K + k).to(tl.int64)
            mask = start + cols < tl.where(dest >= 0, dim, 0)
            tl.store(rows_ptr + dest * dim + start + cols, block, mask=mask)
            tl.store(values_ptr + dest * dim + start + cols, quantized, mask=mask)


def _kernel_parts(
    parts: list[torch.Tensor], what: str, shape: str, layout: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The kernels' part arguments ``(first, second, FIRST, SECOND)``, ``FIRST`` and ``SECOND`` the parts'
    sizes in dimension 1 (where they join), once ``parts`` are 1 to ``MAX_PARTS`` tensors of ``shape``
    (``"[E, P, K]"``: dimension 1 is named P) that agree in every other dimension and in dtype, and
    the kernels can run on; each as ``layout`` returns it. One part: passed twice, ``SECOND`` 0."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"FP8 {what} quantisation takes 1 to {MAX_PARTS} {what} parts, got {len(parts)}")
    check_runnable(*parts)
    dims = shape.strip("[]").split(", ")

    def others(t: torch.Tensor) -> tuple:
        return (t.dim(), t.shape[:1], t.shape[2:], t.dtype)

    if len(parts[0].shape) != len(dims) or any(others(t) != others(parts[0]) for t in parts):
        kept = ", ".join(dims[:1] + dims[2:])
        given = [(tuple(t.shape), t.dtype) for t in parts]
        raise ValueError(f"{what} parts must be {shape} tensors of one {kept} and dtype: {given}")
    parts = [layout(t) for t in parts]
    first, second = parts[0], parts[-1]
    return first, second, first.shape[1], second.shape[1] if len(parts) > 1 else 0


def _unit_column_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


@kernel_op("quantize_rows")
def quantize_rows(w_parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(module docstring) ``w_parts``: one or two [E, P, K] tensors of one dtype and E, K."""
    first, second, first_rows, second_rows = _kernel_parts(w_parts, "weight", "[E, P, K]", torch.Tensor.contiguous)
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
        **rule_constexprs(),
        ROWS=rows_per_program,
        BLOCK_K=block_k,
        num_warps=8 if block_k >= 4096 else 4,
    )
    return values_ENK, inverse_EN1


@torch.library.register_fake(quantize_rows)
def _(w_parts):
    experts, _, dim = w_parts[0].shape
    rows = sum(w.shape[1] for w in w_parts)
    values = w_parts[0].new_empty(experts, rows, dim, dtype=torch.float8_e4m3fn)
    return values, w_parts[0].new_empty(experts, rows, 1, dtype=torch.float32)


@kernel_op("quantize_rows_transposed")
def quantize_rows_transposed(
    w_parts: list[torch.Tensor], inverse_E11: torch.Tensor, ordered_after: torch.Tensor | None = None
) -> torch.Tensor:
    """(module docstring) ``w_parts``: one or two [E, P, K] tensors of one dtype and E, K; ``inverse_E11``
    fp32, each expert's inverse scale (a power of two).

    ``ordered_after`` is never read: a compiled graph runs the op only once that tensor exists. The
    backward passes the gradient the weight multiplies, so the partitioner cannot quantise in the
    forward and keep the e4m3 copy until the backward (memory FSDP cannot free, unlike the weight)."""
    first, second, first_rows, second_rows = _kernel_parts(w_parts, "weight", "[E, P, K]", torch.Tensor.contiguous)
    experts, _, dim = first.shape
    rows = first_rows + second_rows
    if inverse_E11.shape != (experts, 1, 1) or inverse_E11.dtype != torch.float32:
        raise ValueError(
            f"the experts' inverse scales must be fp32 [E, 1, 1] = {[experts, 1, 1]} for these weight parts, "
            f"got {inverse_E11.dtype} {list(inverse_E11.shape)}"
        )
    values_EKN = first.new_empty(experts, dim, rows, dtype=torch.float8_e4m3fn)
    _quantize_rows_transposed_kernel[(experts, triton.cdiv(rows, BLOCK_N), triton.cdiv(dim, BLOCK_K))](
        first,
        second,
        first_rows,
        second_rows,
        inverse_E11.contiguous(),
        values_EKN,
        dim,
        E4M3_MAX=E4M3_MAX,
        ROUND_IN_FP32=interpreter_enabled(),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return values_EKN


@torch.library.register_fake(quantize_rows_transposed)
def _(w_parts, inverse_E11, ordered_after=None):
    experts, _, dim = w_parts[0].shape
    rows = sum(w.shape[1] for w in w_parts)
    return w_parts[0].new_empty(experts, dim, rows, dtype=torch.float8_e4m3fn)


@kernel_op("quantize_activation_rows")
def quantize_activation_rows(parts: list[torch.Tensor], group_end_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(module docstring) ``parts``: one or two [R, P] tensors of one dtype and R; ``group_end_E`` int32,
    an inclusive cumsum of the experts' row counts -> e4m3 ``values_RK`` and fp32 ``inverse_R1``, K the
    parts' summed columns, rows from ``group_end_E[-1]`` on unset."""
    first, second, first_cols, second_cols = _kernel_parts(parts, "activation", "[R, P]", _unit_column_stride)
    num_rows, total_cols = first.shape[0], first_cols + second_cols
    values_RK = first.new_empty(num_rows, total_cols, dtype=torch.float8_e4m3fn)
    inverse_R1 = first.new_empty(num_rows, 1, dtype=torch.float32)
    if num_rows == 0 or group_end_E.numel() == 0:
        return values_RK, inverse_R1
    block = min(ACTIVATION_BLOCK, triton.next_power_of_2(max(1, total_cols)))
    rows_per_program = max(1, ACTIVATION_PROGRAM_ELEMENTS // block)
    _quantize_activation_rows_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        first,
        second,
        first.stride(0),
        second.stride(0),
        first_cols,
        second_cols,
        values_RK,
        inverse_R1,
        group_end_E,
        group_end_E.numel(),
        **rule_constexprs(),
        ROWS=rows_per_program,
        BLOCK=block,
        ONE_BLOCK=block >= total_cols,
        num_warps=8 if rows_per_program * block >= 8192 else 4,
    )
    return values_RK, inverse_R1


@torch.library.register_fake(quantize_activation_rows)
def _(parts, group_end_E):
    num_rows, total_cols = parts[0].shape[0], sum(p.shape[1] for p in parts)
    values = parts[0].new_empty(num_rows, total_cols, dtype=torch.float8_e4m3fn)
    return values, parts[0].new_empty(num_rows, 1, dtype=torch.float32)


@kernel_op("permute_quantize_rows")
def permute_quantize_rows(
    x_TD: torch.Tensor, dest_row_S: torch.Tensor, top_k: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(module docstring) ``x_TD`` [T, D], ``dest_row_S`` [T * top_k] int32 (-1: a dropped slot) ->
    ``rows_RD`` in ``x_TD``'s dtype, e4m3 ``values_RD`` and fp32 ``inverse_R1``, R = ``num_rows``; rows no
    slot maps to unset."""
    check_runnable(x_TD, dest_row_S)
    if x_TD.dim() != 2 or dest_row_S.shape != (x_TD.shape[0] * top_k,):
        raise ValueError(
            f"the tokens must be [T, D] and the slots' rows [T * top_k] = [{x_TD.shape[0] * top_k}], got "
            f"{list(x_TD.shape)} and {list(dest_row_S.shape)}"
        )
    x_TD = x_TD.contiguous()
    num_tokens, dim = x_TD.shape
    rows_RD = x_TD.new_empty(num_rows, dim)
    values_RD = x_TD.new_empty(num_rows, dim, dtype=torch.float8_e4m3fn)
    inverse_R1 = x_TD.new_empty(num_rows, 1, dtype=torch.float32)
    if num_tokens == 0 or dim == 0:
        return rows_RD, values_RD, inverse_R1
    block = min(ACTIVATION_BLOCK, triton.next_power_of_2(dim))
    _permute_quantize_kernel[(num_tokens,)](
        x_TD,
        rows_RD,
        values_RD,
        inverse_R1,
        dest_row_S,
        dim,
        **rule_constexprs(),
        TOP_K=top_k,
        BLOCK_D=block,
        ONE_BLOCK=block >= dim,
        num_warps=8 if block >= 4096 else 4,
    )
    return rows_RD, values_RD, inverse_R1


@torch.library.register_fake(permute_quantize_rows)
def _(x_TD, dest_row_S, top_k, num_rows):
    rows = x_TD.new_empty(num_rows, x_TD.shape[1])
    values = x_TD.new_empty(num_rows, x_TD.shape[1], dtype=torch.float8_e4m3fn)
    return rows, values, x_TD.new_empty(num_rows, 1, dtype=torch.float32)
