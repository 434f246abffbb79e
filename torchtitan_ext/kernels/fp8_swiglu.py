"""The FP8 experts' SwiGLU with the quantisation of the GEMM operand it produces, forward and backward,
one Triton kernel each over expert-grouped rows (``experiments.moe_backends.fp8_experts`` is the recipe).

``gate_up_RF2`` [R, 2F] is the gate and up projections' output, gate in columns [0, F) and up in
[F, 2F); ``row_scores_R`` (optional, ``(R,)``) weights each row (``experts_apply_scores``); the
activations' dtype is ``gate_up_RF2``'s. Rows from ``group_end_E[-1]`` on belong to no expert and are
not read (outputs there are unset, except the score gradient, zero).

``swiglu_quantize_rows``: the down projection's input ``a = dtype(silu(gate) * up * score)`` (fp32
arithmetic, one rounding to the activations' dtype) quantised per row with the rule of
``fp8_quantize``: e4m3 ``values_RF`` and fp32 ``inverse_R1``. ``a`` itself is not written (the
backward writes it again for the weight gradient).

``swiglu_backward_quantize_rows``: from ``grad_RF``, the gradient of ``a``: the gradients of the gate
and up projections' outputs (``d up = d a * score * silu(gate)``, ``d gate = d a * score * up *
silu'(gate)``, each rounded to the activations' dtype), ``a`` again (the down projection's weight
gradient operand), the scores' gradient (``sum_f d a * silu(gate) * up``, fp32 arithmetic, in the
scores' dtype; ``(0,)`` without scores), and ``[d gate, d up]`` quantised per row as one row of 2F
(the gate and up projections' input gradient operand).

Each replaces an elementwise pass and the quantisation pass that read its output again. A program
holds ``ROWS`` rows of up to ``SWIGLU_BLOCK`` columns; longer rows are computed twice, in blocks (the
row's maximum first). Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels.availability import check_runnable
from torchtitan_ext.kernels.fp8_quantize import cast_to_e4m3, power_of_two_scale, rule_constexprs
from torchtitan_ext.kernels.library_ops import kernel_op

SWIGLU_BLOCK = 2048
"""Columns of F the kernels hold per row at once: longer rows are computed in two passes."""
FORWARD_PROGRAM_ELEMENTS = 4096
BACKWARD_PROGRAM_ELEMENTS = 2048
"""Elements of F per program (rows of up to ``SWIGLU_BLOCK`` columns, at least one row); the backward
holds more values per element."""


@triton.jit
def _gate_up_block(gate_up_ptr, gate_up_stride, rows, row_ok, cols, HIDDEN):
    """fp32 gate and up [ROWS, BLOCK] at columns ``cols`` of F (zeros outside), and the block's mask."""
    mask = row_ok[:, None] & (cols < HIDDEN)[None, :]
    gate_ptrs = gate_up_ptr + rows.to(tl.int64)[:, None] * gate_up_stride + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + HIDDEN, mask=mask, other=0.0).to(tl.float32)
    return gate, up, mask


@triton.jit
def _swiglu_block(gate_up_ptr, gate_up_stride, rows, row_ok, cols, score, HIDDEN, out_dtype):
    """``a = silu(gate) * up * score`` [ROWS, BLOCK] at columns ``cols`` of F, rounded to ``out_dtype`` and
    back to fp32, and the block's mask."""
    gate, up, mask = _gate_up_block(gate_up_ptr, gate_up_stride, rows, row_ok, cols, HIDDEN)
    return (gate * tl.sigmoid(gate) * up * score[:, None]).to(out_dtype).to(tl.float32), mask


@triton.jit
def _row_scores(scores_ptr, rows, row_ok, HAS_SCORES: tl.constexpr, ROWS: tl.constexpr):
    if HAS_SCORES:
        return tl.load(scores_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    return tl.full([ROWS], 1.0, tl.float32)


@triton.jit
def _swiglu_quantize_kernel(
    gate_up_ptr,
    gate_up_stride,
    scores_ptr,
    values_ptr,
    inverse_ptr,
    group_end_ptr,
    num_experts,
    HIDDEN,
    E4M3_MAX: tl.constexpr,
    SMALLEST_AMAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    HAS_SCORES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    """One program per ``ROWS`` rows (module docstring); rows from ``group_end[E-1]`` on are skipped."""
    num_assigned = tl.load(group_end_ptr + num_experts - 1)
    first_row = tl.program_id(0) * ROWS
    if first_row >= num_assigned:
        return
    rows = first_row + tl.arange(0, ROWS)
    row_ok = rows < num_assigned
    score = _row_scores(scores_ptr, rows, row_ok, HAS_SCORES, ROWS)
    out_dtype = gate_up_ptr.dtype.element_ty
    out_rows = values_ptr + rows.to(tl.int64)[:, None] * HIDDEN
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        a, mask = _swiglu_block(gate_up_ptr, gate_up_stride, rows, row_ok, cols, score, HIDDEN, out_dtype)
        amax = tl.max(tl.abs(a), axis=1)
    else:
        amax = tl.zeros([ROWS], tl.float32)
        for start in range(0, HIDDEN, BLOCK):
            a, mask = _swiglu_block(gate_up_ptr, gate_up_stride, rows, row_ok, start + cols, score, HIDDEN, out_dtype)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
    scale = power_of_two_scale(amax, E4M3_MAX, SMALLEST_AMAX)
    tl.store(inverse_ptr + rows, 1.0 / scale, mask=row_ok)
    if ONE_BLOCK:
        # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr ONE_BLOCK
        tl.store(out_rows + cols[None, :], cast_to_e4m3(a * scale[:, None], E4M3_MAX, ROUND_IN_FP32), mask=mask)
    else:
        for start in range(0, HIDDEN, BLOCK):
            a, mask = _swiglu_block(gate_up_ptr, gate_up_stride, rows, row_ok, start + cols, score, HIDDEN, out_dtype)
            quantized = cast_to_e4m3(a * scale[:, None], E4M3_MAX, ROUND_IN_FP32)
            tl.store(out_rows + (start + cols)[None, :], quantized, mask=mask)


@triton.jit
def _swiglu_backward_block(
    grad_ptr, grad_stride, gate_up_ptr, gate_up_stride, rows, row_ok, cols, score, HIDDEN, out_dtype
):
    """[ROWS, BLOCK] at columns ``cols`` of F: d gate and d up rounded to ``out_dtype`` and back to fp32,
    ``a`` in ``out_dtype``, the per-row partial sums of the scores' gradient, and the block's mask."""
    gate, up, mask = _gate_up_block(gate_up_ptr, gate_up_stride, rows, row_ok, cols, HIDDEN)
    grad_ptrs = grad_ptr + rows.to(tl.int64)[:, None] * grad_stride + cols[None, :]
    grad_a = tl.load(grad_ptrs, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    swiglu = silu * up
    grad_swiglu = grad_a * score[:, None]
    grad_up = (grad_swiglu * silu).to(out_dtype).to(tl.float32)
    grad_gate = (grad_swiglu * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))).to(out_dtype).to(tl.float32)
    a = (swiglu * score[:, None]).to(out_dtype)
    return grad_gate, grad_up, a, tl.sum(grad_a * swiglu, axis=1), mask


@triton.jit
def _swiglu_backward_quantize_kernel(
    grad_ptr,
    grad_stride,
    gate_up_ptr,
    gate_up_stride,
    scores_ptr,
    grad_gate_ptr,
    grad_up_ptr,
    a_ptr,
    grad_scores_ptr,
    values_ptr,
    inverse_ptr,
    group_end_ptr,
    num_experts,
    num_rows,
    HIDDEN,
    E4M3_MAX: tl.constexpr,
    SMALLEST_AMAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    HAS_SCORES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    """One program per ``ROWS`` rows (module docstring); rows from ``group_end[E-1]`` on only get a zero
    score gradient."""
    num_assigned = tl.load(group_end_ptr + num_experts - 1)
    first_row = tl.program_id(0) * ROWS
    rows = first_row + tl.arange(0, ROWS)
    if first_row >= num_assigned:
        if HAS_SCORES:
            tl.store(grad_scores_ptr + rows, tl.zeros([ROWS], tl.float32), mask=rows < num_rows)
        return
    row_ok = rows < num_assigned
    score = _row_scores(scores_ptr, rows, row_ok, HAS_SCORES, ROWS)
    out_dtype = gate_up_ptr.dtype.element_ty
    out_rows = rows.to(tl.int64)[:, None] * HIDDEN
    values_rows = values_ptr + rows.to(tl.int64)[:, None] * (2 * HIDDEN)
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        grad_gate, grad_up, a, grad_score, mask = _swiglu_backward_block(
            grad_ptr, grad_stride, gate_up_ptr, gate_up_stride, rows, row_ok, cols, score, HIDDEN, out_dtype
        )
        _store_backward_block(grad_gate_ptr, grad_up_ptr, a_ptr, out_rows + cols[None, :], grad_gate, grad_up, a, mask)
        amax = tl.maximum(tl.max(tl.abs(grad_gate), axis=1), tl.max(tl.abs(grad_up), axis=1))
    else:
        amax = tl.zeros([ROWS], tl.float32)
        grad_score = tl.zeros([ROWS], tl.float32)
        for start in range(0, HIDDEN, BLOCK):
            grad_gate, grad_up, a, partial, mask = _swiglu_backward_block(
                grad_ptr, grad_stride, gate_up_ptr, gate_up_stride, rows, row_ok, start + cols, score, HIDDEN,
                out_dtype,
            )  # fmt: skip
            at = out_rows + (start + cols)[None, :]
            _store_backward_block(grad_gate_ptr, grad_up_ptr, a_ptr, at, grad_gate, grad_up, a, mask)
            grad_score += partial
            amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(grad_gate), axis=1), tl.max(tl.abs(grad_up), axis=1)))
    if HAS_SCORES:
        # zero past the experts' rows: their loads were masked to zeros
        tl.store(grad_scores_ptr + rows, grad_score.to(grad_scores_ptr.dtype.element_ty), mask=rows < num_rows)
    scale = power_of_two_scale(amax, E4M3_MAX, SMALLEST_AMAX)
    tl.store(inverse_ptr + rows, 1.0 / scale, mask=row_ok)
    if ONE_BLOCK:
        # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr ONE_BLOCK
        _store_quantized_pair(values_rows + cols[None, :], grad_gate, grad_up, scale, mask, HIDDEN, E4M3_MAX,
                              ROUND_IN_FP32)  # fmt: skip
    else:
        for start in range(0, HIDDEN, BLOCK):
            grad_gate, grad_up, _, _, mask = _swiglu_backward_block(
                grad_ptr, grad_stride, gate_up_ptr, gate_up_stride, rows, row_ok, start + cols, score, HIDDEN,
                out_dtype,
            )  # fmt: skip
            _store_quantized_pair(values_rows + (start + cols)[None, :], grad_gate, grad_up, scale, mask, HIDDEN,
                                  E4M3_MAX, ROUND_IN_FP32)  # fmt: skip


@triton.jit
def _store_backward_block(grad_gate_ptr, grad_up_ptr, a_ptr, at, grad_gate, grad_up, a, mask):
    """Store one block of d gate, d up (fp32 values already rounded) and ``a`` at offsets ``at``."""
    tl.store(grad_gate_ptr + at, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + at, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)
    tl.store(a_ptr + at, a, mask=mask)


@triton.jit
def _store_quantized_pair(at, grad_gate, grad_up, scale, mask, HIDDEN, E4M3_MAX: tl.constexpr,
                          ROUND_IN_FP32: tl.constexpr):  # fmt: skip
    """Store one block of the joined row ``[d gate, d up]`` scaled by its row's ``scale`` in e4m3."""
    tl.store(at, cast_to_e4m3(grad_gate * scale[:, None], E4M3_MAX, ROUND_IN_FP32), mask=mask)
    tl.store(at + HIDDEN, cast_to_e4m3(grad_up * scale[:, None], E4M3_MAX, ROUND_IN_FP32), mask=mask)


def _check_rows(
    gate_up_RF2: torch.Tensor, row_scores_R: torch.Tensor | None, group_end_E: torch.Tensor, *others: torch.Tensor
) -> int:
    """F, once ``gate_up_RF2`` is [R, 2F] with unit column stride, the scores ``(R,)`` and ``group_end_E`` a
    1-D int32 tensor, all (and ``others``) where the kernels can run."""
    check_runnable(gate_up_RF2, group_end_E, *others, *([row_scores_R] if row_scores_R is not None else []))
    if gate_up_RF2.dim() != 2 or gate_up_RF2.shape[1] % 2 or gate_up_RF2.stride(1) != 1:
        raise ValueError(
            "the gate and up outputs must be one [R, 2F] tensor with unit column stride, got shape "
            f"{list(gate_up_RF2.shape)} and strides {list(gate_up_RF2.stride())}"
        )
    if row_scores_R is not None and row_scores_R.shape != gate_up_RF2.shape[:1]:
        raise ValueError(f"row scores must have shape ({gate_up_RF2.shape[0]},), got {tuple(row_scores_R.shape)}")
    if group_end_E.dim() != 1 or group_end_E.dtype != torch.int32:
        raise ValueError(f"group_end must be a 1-D int32 tensor, got {group_end_E.dtype} {list(group_end_E.shape)}")
    return gate_up_RF2.shape[1] // 2


def _launch_shape(hidden: int, program_elements: int) -> tuple[int, int]:
    """(columns per block, rows per program) for rows of ``hidden`` columns."""
    block = min(SWIGLU_BLOCK, triton.next_power_of_2(max(1, hidden)))
    return block, max(1, program_elements // block)


@kernel_op("swiglu_quantize_rows")
def swiglu_quantize_rows(
    gate_up_RF2: torch.Tensor, row_scores_R: torch.Tensor | None, group_end_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(module docstring) -> e4m3 ``values_RF`` and fp32 ``inverse_R1``, rows past the experts' unset."""
    hidden = _check_rows(gate_up_RF2, row_scores_R, group_end_E)
    num_rows = gate_up_RF2.shape[0]
    values_RF = gate_up_RF2.new_empty(num_rows, hidden, dtype=torch.float8_e4m3fn)
    inverse_R1 = gate_up_RF2.new_empty(num_rows, 1, dtype=torch.float32)
    if num_rows == 0 or hidden == 0 or group_end_E.numel() == 0:
        return values_RF, inverse_R1
    block, rows_per_program = _launch_shape(hidden, FORWARD_PROGRAM_ELEMENTS)
    _swiglu_quantize_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        gate_up_RF2,
        gate_up_RF2.stride(0),
        row_scores_R if row_scores_R is not None else inverse_R1,
        values_RF,
        inverse_R1,
        group_end_E,
        group_end_E.numel(),
        hidden,
        **rule_constexprs(),
        HAS_SCORES=row_scores_R is not None,
        ROWS=rows_per_program,
        BLOCK=block,
        ONE_BLOCK=block >= hidden,
        num_warps=8 if rows_per_program * block >= 8192 else 4,
    )
    return values_RF, inverse_R1


@torch.library.register_fake(swiglu_quantize_rows)
def _(gate_up_RF2, row_scores_R, group_end_E):
    num_rows, hidden = gate_up_RF2.shape[0], gate_up_RF2.shape[1] // 2
    values = gate_up_RF2.new_empty(num_rows, hidden, dtype=torch.float8_e4m3fn)
    return values, gate_up_RF2.new_empty(num_rows, 1, dtype=torch.float32)


@kernel_op("swiglu_backward_quantize_rows")
def swiglu_backward_quantize_rows(
    grad_RF: torch.Tensor, gate_up_RF2: torch.Tensor, row_scores_R: torch.Tensor | None, group_end_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(module docstring) -> ``(grad_gate_RF, grad_up_RF, a_RF, grad_scores_R, values_RK, inverse_R1)``, K = 2F,
    ``grad_scores_R`` ``(0,)`` without scores; rows past the experts' unset but the score gradient's (zero)."""
    hidden = _check_rows(gate_up_RF2, row_scores_R, group_end_E, grad_RF)
    num_rows = gate_up_RF2.shape[0]
    if grad_RF.shape != (num_rows, hidden) or grad_RF.stride(1) != 1 or grad_RF.dtype != gate_up_RF2.dtype:
        raise ValueError(
            f"the gradient must be [R, F] = {[num_rows, hidden]} of the gate and up outputs' dtype "
            f"{gate_up_RF2.dtype} with unit column stride, got {grad_RF.dtype} {list(grad_RF.shape)} "
            f"strides {list(grad_RF.stride())}"
        )
    grad_gate_RF, grad_up_RF, a_RF = (gate_up_RF2.new_empty(num_rows, hidden) for _ in range(3))
    grad_scores_R = (
        row_scores_R.new_empty(num_rows) if row_scores_R is not None else gate_up_RF2.new_empty(0, dtype=torch.float32)
    )
    values_RK = gate_up_RF2.new_empty(num_rows, 2 * hidden, dtype=torch.float8_e4m3fn)
    inverse_R1 = gate_up_RF2.new_empty(num_rows, 1, dtype=torch.float32)
    outputs = (grad_gate_RF, grad_up_RF, a_RF, grad_scores_R, values_RK, inverse_R1)
    if num_rows == 0 or hidden == 0 or group_end_E.numel() == 0:
        if row_scores_R is not None:
            grad_scores_R.zero_()
        return outputs
    block, rows_per_program = _launch_shape(hidden, BACKWARD_PROGRAM_ELEMENTS)
    _swiglu_backward_quantize_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        grad_RF,
        grad_RF.stride(0),
        gate_up_RF2,
        gate_up_RF2.stride(0),
        row_scores_R if row_scores_R is not None else inverse_R1,
        grad_gate_RF,
        grad_up_RF,
        a_RF,
        grad_scores_R if row_scores_R is not None else inverse_R1,
        values_RK,
        inverse_R1,
        group_end_E,
        group_end_E.numel(),
        num_rows,
        hidden,
        **rule_constexprs(),
        HAS_SCORES=row_scores_R is not None,
        ROWS=rows_per_program,
        BLOCK=block,
        ONE_BLOCK=block >= hidden,
        num_warps=8 if rows_per_program * block >= 4096 else 4,
    )
    return outputs


@torch.library.register_fake(swiglu_backward_quantize_rows)
def _(grad_RF, gate_up_RF2, row_scores_R, group_end_E):
    num_rows, hidden = gate_up_RF2.shape[0], gate_up_RF2.shape[1] // 2
    rows = [gate_up_RF2.new_empty(num_rows, hidden) for _ in range(3)]
    grad_scores = (
        row_scores_R.new_empty(num_rows) if row_scores_R is not None else gate_up_RF2.new_empty(0, dtype=torch.float32)
    )
    values = gate_up_RF2.new_empty(num_rows, 2 * hidden, dtype=torch.float8_e4m3fn)
    return *rows, grad_scores, values, gate_up_RF2.new_empty(num_rows, 1, dtype=torch.float32)
