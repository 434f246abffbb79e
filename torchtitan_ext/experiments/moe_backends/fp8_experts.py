"""FP8 rowwise expert GEMMs: e4m3 operands scaled per row along the contraction dimension.

The recipe (``moe.expert_precision = "fp8_rowwise"``), per grouped GEMM ``y = a @ w[e].T``; the gate
and up projections are one GEMM over ``w = [w1; w3]`` [E, 2F, D] (the tokens quantised once, one
GEMM of twice the width):

- forward: ``a`` [R, K] scaled per row, ``w`` [E, N, K] per (expert, output row), both along K;
  e4m3 operands, output in the activations' dtype (bf16 under FSDP); the GPU GEMMs accumulate with
  Hopper's fast FP8 accumulation (``use_fast_accum``, as torchao's FP8 MoE recipe does: without it
  ``torch._scaled_grouped_mm`` took twice bf16 ``torch._grouped_mm``'s time on an H200);
- input gradient ``d a = d y @ w[e]``: ``d y`` [R, N] scaled per row along N, ``w[e]`` transposed
  [K, N] with one scale per expert (the forward's row scales would run along this GEMM's contraction),
  the largest of the expert's inverse row scales from the forward (the rule's scale of the whole
  expert), so no maximum over the weights is taken again;
- weight gradient ``d w[e] = d y[rows of e].T @ a[rows of e]`` in the activations' dtype (high
  precision, torchao's ``rowwise_with_gw_hp`` recipe for linear layers): its contraction runs over
  each expert's tokens, whose per-expert scales would need 16-row aligned groups.

Scales are powers of two (``2^floor(log2(448 / amax))``), so dequantising is exact and the
reference, the emulation and the GPU kernels see the same e4m3 values. The down projection's input
``silu(gate) * up`` and the gate and up outputs' gradients are quantised by the SwiGLU kernels that
compute them (``kernels.fp8_swiglu``), the tokens and the output gradient by the activation kernel
(``kernels.fp8_quantize``). ``fp8_rowwise`` computes
the FP8 GEMMs with the kernels of ``FP8_GEMMS`` the backend names: ``torch._scaled_grouped_mm``
(``grouped_mm``; CUDA, compute capability 9.0+) or this project's Triton kernel
(``kernels.fp8_grouped_gemm``; ``triton``); ``fp8_rowwise_emulated`` quantises identically and
computes each GEMM from the dequantised operands in fp32 (any device: the CPU tests' path, and a
numerics check without such a GPU). ``reference_fp8_experts`` is the plain-torch definition all
are held to.
"""

from collections.abc import Callable, Sequence
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from torchtitan_ext.kernels.fp8_grouped_gemm import fp8_grouped_gemm
from torchtitan_ext.kernels.fp8_quantize import (
    E4M3_MAX,
    SMALLEST_AMAX,
    permute_quantize_rows,
    quantize_activation_rows,
    quantize_rows,
    quantize_rows_transposed,
)
from torchtitan_ext.kernels.fp8_swiglu import swiglu_backward_quantize_rows, swiglu_quantize_rows
from torchtitan_ext.kernels.moe_permute import routing_metadata, sum_token_rows

from .grouped_matmul import grouped_mm, row_major

ExpertPrecision = Literal["native", "fp8_rowwise", "fp8_rowwise_emulated"]
"""How the expert GEMMs compute: in the activations' dtype, in FP8 rowwise on the GPU, or FP8
rowwise emulated in fp32 (module docstring)."""

EXPERT_PRECISIONS: tuple[str, ...] = get_args(ExpertPrecision)
FP8_PRECISIONS: tuple[str, ...] = tuple(p for p in EXPERT_PRECISIONS if p.startswith("fp8"))

E4M3 = torch.float8_e4m3fn
FP8_ALIGN = 16
"""``torch._scaled_grouped_mm`` needs K and N in multiples of 16 elements (16 bytes of e4m3)."""


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] -> (e4m3 values [..., K], fp32 inverse scales [..., 1]) with
    ``x ~= values * inverse``; one power-of-two scale per row along the last dimension."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True).clamp(min=SMALLEST_AMAX)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return to_e4m3(x32 * scale), scale.reciprocal()


def to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 ``scaled`` clamped to +-448 and cast to e4m3 (round to nearest, ties to even)."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 with rowwise scales along its last dimension, in fp32."""
    values, inverse = quantize_rowwise(x)
    return values.float() * inverse


Fp8Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
"""``(a_values_RK, a_inverse_R1, w_values_ENK, w_inverse_EN1, offsets_E, out_dtype) -> [R, N]``: the FP8
grouped GEMM ``a @ w[e].T`` of e4m3 operands with their rows' inverse scales along K, over the row
groups ending at ``offsets_E``."""


def _torch_fp8_gemm(a_values_RK, a_inverse_R1, w_values_ENK, w_inverse_EN1, offsets_E, out_dtype):
    """``torch._scaled_grouped_mm`` with fast accumulation; it writes bf16, cast to ``out_dtype``."""
    return torch._scaled_grouped_mm(
        a_values_RK,
        w_values_ENK.transpose(-2, -1),
        a_inverse_R1.squeeze(-1),
        w_inverse_EN1.squeeze(-1),
        offsets_E,
        out_dtype=torch.bfloat16,
        use_fast_accum=True,
    ).to(out_dtype)


FP8_GEMMS: dict[str, Fp8Gemm] = {"torch": _torch_fp8_gemm, "triton": fp8_grouped_gemm}
"""The FP8 grouped GEMM kernels by name: ``torch._scaled_grouped_mm`` or the Triton kernel
(``kernels.fp8_grouped_gemm``, which writes ``out_dtype`` directly)."""


def quantize_activations(
    parts_RP: Sequence[torch.Tensor], offsets_E: torch.Tensor, *, emulated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``parts_RP`` joined along their last dimension, quantised rowwise: e4m3 values [R, K] and
    fp32 inverse scales [R, 1]. On the GPU ``kernels.fp8_quantize``'s activation kernel, which reads the
    parts in place and leaves the rows past the groups ending at ``offsets_E`` unset; emulated, the same
    rule in plain torch on every row."""
    if emulated:
        return quantize_rowwise(_stacked(parts_RP))
    return quantize_activation_rows(list(parts_RP), offsets_E)


def fp8_gemm(
    a_values_RK: torch.Tensor,
    a_inverse_R1: torch.Tensor,
    w_values_ENK: torch.Tensor,
    w_inverse_EN1: torch.Tensor,
    offsets_E: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulated: bool,
    gemm: str,
) -> torch.Tensor:
    """``a @ w[e].T`` over the row groups ending at ``offsets_E`` from e4m3 operands and their rows' inverse
    scales along K (``Fp8Gemm``) -> [R, N] in ``out_dtype``, computed by ``FP8_GEMMS[gemm]`` or, emulated,
    in fp32 from the dequantised operands. K and N must be multiples of ``FP8_ALIGN``."""
    if emulated:
        dequantized_w = w_values_ENK.float() * w_inverse_EN1
        a = a_values_RK.float() * a_inverse_R1
        return grouped_mm(a, dequantized_w.transpose(-2, -1), offsets_E).to(out_dtype)
    return FP8_GEMMS[gemm](a_values_RK, a_inverse_R1, w_values_ENK, w_inverse_EN1, offsets_E, out_dtype)


def quantize_stacked_rows(w_parts_EPK: Sequence[torch.Tensor], *, emulated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack ``[w_parts]`` [E, N, K] quantised per (expert, row) along K: e4m3 values [E, N, K] and
    inverse scales [E, N, 1] (the forward's weight operand). On the GPU one Triton kernel
    (``kernels.fp8_quantize``) that reads each row once; emulated, the same rule in plain torch."""
    if emulated:
        return quantize_rowwise(_stacked(w_parts_EPK))
    return quantize_rows(list(w_parts_EPK))


def quantize_stacked_rows_transposed(
    w_parts_EPK: list[torch.Tensor],
    inverse_E11: torch.Tensor,
    *,
    emulated: bool,
    ordered_after: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stack ``[w_parts]`` [E, N, K] scaled by one inverse scale per expert, ``inverse_E11`` (fp32
    powers of two), in e4m3, transposed row-major [E, K, N] (the input gradient's weight operand). On the
    GPU one Triton kernel (``kernels.fp8_quantize``), computed after ``ordered_after`` exists (its
    docstring); emulated, the same values from plain torch, which a compiled graph may compute in the
    forward and keep until the backward."""
    if emulated:
        return row_major(to_e4m3(_stacked(w_parts_EPK).float() / inverse_E11).transpose(-2, -1))
    return quantize_rows_transposed(w_parts_EPK, inverse_E11, ordered_after)


def swiglu_quantized(
    gate_up_RF2: torch.Tensor, row_scores_R: torch.Tensor | None, offsets_E: torch.Tensor, *, emulated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The down projection's input ``a = silu(gate) * up`` (times each row's score), rounded to
    ``gate_up_RF2``'s dtype and quantised rowwise: e4m3 values [R, F] and fp32 inverse scales [R, 1]
    (``kernels.fp8_swiglu``; emulated, the same arithmetic in plain torch)."""
    if not emulated:
        return swiglu_quantize_rows(gate_up_RF2, row_scores_R, offsets_E)
    gate, up = gate_up_RF2.float().chunk(2, dim=1)
    return quantize_rowwise(_scored(F.silu(gate) * up, row_scores_R).to(gate_up_RF2.dtype))


def swiglu_backward_quantized(
    grad_a_RF: torch.Tensor,
    gate_up_RF2: torch.Tensor,
    row_scores_R: torch.Tensor | None,
    offsets_E: torch.Tensor,
    *,
    emulated: bool,
) -> tuple[torch.Tensor, ...]:
    """From the gradient of ``swiglu_quantized``'s ``a``: ``(d gate, d up, a, d scores, [d gate, d up]
    quantised rowwise as values [R, 2F] and inverse scales [R, 1])`` (``kernels.fp8_swiglu``, whose
    docstring gives the arithmetic; emulated, the same in plain torch)."""
    if not emulated:
        return swiglu_backward_quantize_rows(grad_a_RF, gate_up_RF2, row_scores_R, offsets_E)
    dtype = gate_up_RF2.dtype
    gate, up = gate_up_RF2.float().chunk(2, dim=1)
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    grad_a = grad_a_RF.float()
    grad_swiglu = _scored(grad_a, row_scores_R)
    grad_up = (grad_swiglu * silu).to(dtype)
    grad_gate = (grad_swiglu * up * sigmoid * (1 + gate * (1 - sigmoid))).to(dtype)
    a = _scored(silu * up, row_scores_R).to(dtype)
    grad_scores = (
        (grad_a * silu * up).sum(dim=1).to(row_scores_R.dtype)
        if row_scores_R is not None
        else gate_up_RF2.new_empty(0, dtype=torch.float32)
    )
    return grad_gate, grad_up, a, grad_scores, *quantize_rowwise(torch.cat([grad_gate, grad_up], dim=1))


def _scored(rows_RF: torch.Tensor, row_scores_R: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``rows_RF`` with row ``r`` times ``row_scores_R[r]``; as they are without scores."""
    return rows_RF if row_scores_R is None else rows_RF * row_scores_R.float()[:, None]


Quantized = tuple[torch.Tensor, torch.Tensor]
"""Rows already quantised rowwise: e4m3 values [R, K] and fp32 inverse scales [R, 1]."""


def fp8_experts_forward(
    x_RD: torch.Tensor,
    x_quantized: Quantized | None,
    offsets_E: torch.Tensor,
    row_scores_R: torch.Tensor | None,
    weights: Sequence[torch.Tensor],
    *,
    emulated: bool,
    gemm: str,
) -> tuple[torch.Tensor, tuple]:
    """The forward of ``Fp8SwigluExperts`` (no autograd): ``x_RD`` (quantised here unless ``x_quantized``
    gives its rows) through the expert block -> ``(out_RD, saved)``, ``saved`` what
    ``fp8_experts_backward`` takes."""
    w1_EFD, w2_EDF, w3_EFD = weights
    gate_up_values, gate_up_inverse = quantize_stacked_rows([w1_EFD, w3_EFD], emulated=emulated)
    x_values, x_inverse = x_quantized or quantize_activations([x_RD], offsets_E, emulated=emulated)
    gate_up_RF2 = fp8_gemm(
        x_values, x_inverse, gate_up_values, gate_up_inverse, offsets_E, x_RD.dtype, emulated=emulated, gemm=gemm
    )
    del gate_up_values, x_values, x_inverse
    a_values, a_inverse = swiglu_quantized(gate_up_RF2, row_scores_R, offsets_E, emulated=emulated)
    down_values, down_inverse = quantize_stacked_rows([w2_EDF], emulated=emulated)
    out_RD = fp8_gemm(
        a_values, a_inverse, down_values, down_inverse, offsets_E, x_RD.dtype, emulated=emulated, gemm=gemm
    )
    expert_inverses = (gate_up_inverse.amax(dim=1, keepdim=True), down_inverse.amax(dim=1, keepdim=True))
    return out_RD, (x_RD, offsets_E, row_scores_R, gate_up_RF2, *expert_inverses, *weights)


def fp8_experts_backward(
    saved: Sequence[torch.Tensor],
    grad_out_RD: torch.Tensor,
    grad_quantized: Quantized | None,
    needs: Sequence[bool],
    *,
    emulated: bool,
    gemm: str,
) -> tuple[torch.Tensor | None, ...]:
    """The backward of ``Fp8SwigluExperts`` (no autograd) from ``fp8_experts_forward``'s ``saved`` and the
    output gradient (quantised here unless ``grad_quantized`` gives its rows) -> the gradients of ``(x,
    row scores, w1, w2, w3)``, None where ``needs`` (in that order) says none is wanted."""
    x_RD, offsets_E, row_scores_R, gate_up_RF2, gate_up_inverse_E11, down_inverse_E11, *weights = saved
    w1_EFD, w2_EDF, w3_EFD = weights
    needs_x, needs_scores, needs_w1, needs_w2, needs_w3 = needs
    dim, hidden = x_RD.shape[1], w1_EFD.shape[1]
    down_values_T = quantize_stacked_rows_transposed(
        [w2_EDF], down_inverse_E11, emulated=emulated, ordered_after=grad_out_RD
    )
    grad_values, grad_inverse = grad_quantized or quantize_activations([grad_out_RD], offsets_E, emulated=emulated)
    down_inverse = down_inverse_E11.expand(-1, hidden, -1).contiguous()
    grad_a_RF = fp8_gemm(
        grad_values, grad_inverse, down_values_T, down_inverse, offsets_E, x_RD.dtype, emulated=emulated, gemm=gemm
    )
    del down_values_T, grad_values, grad_inverse
    grad_gate_RF, grad_up_RF, a_RF, grad_scores_R, grad_values, grad_inverse = swiglu_backward_quantized(
        grad_a_RF, gate_up_RF2, row_scores_R, offsets_E, emulated=emulated
    )
    grad_w2 = grouped_mm(grad_out_RD.transpose(0, 1), a_RF, offsets_E).to(w2_EDF.dtype) if needs_w2 else None
    del a_RF
    grad_x = None
    if needs_x:
        gate_up_values_T = quantize_stacked_rows_transposed(
            [w1_EFD, w3_EFD], gate_up_inverse_E11, emulated=emulated, ordered_after=grad_gate_RF
        )
        gate_up_inverse = gate_up_inverse_E11.expand(-1, dim, -1).contiguous()
        grad_x = fp8_gemm(
            grad_values, grad_inverse, gate_up_values_T, gate_up_inverse, offsets_E, x_RD.dtype, emulated=emulated,
            gemm=gemm,
        )  # fmt: skip
    grad_w1, grad_w3 = (
        grouped_mm(grad.transpose(0, 1), x_RD, offsets_E).to(w.dtype) if needed else None
        for grad, w, needed in ((grad_gate_RF, w1_EFD, needs_w1), (grad_up_RF, w3_EFD, needs_w3))
    )
    return grad_x, grad_scores_R if needs_scores else None, grad_w1, grad_w2, grad_w3


class Fp8SwigluExperts(torch.autograd.Function):
    """The SwiGLU expert block in FP8 rowwise with the gradients of the module docstring's recipe: ``x_RD``
    through the gate and up projections as one GEMM over ``[w1; w3]``, ``a = silu(gate) * up`` (times
    each row's score), the down projection -> [R, D].

    The SwiGLU writes the down projection's e4m3 input, and its backward the gate and up projections'
    e4m3 output gradient, each in one kernel (``kernels.fp8_swiglu``): no pass reads an activation again
    to quantise it. The forward keeps the tokens, the gate and up outputs, the scores and each weight
    stack's per-expert inverse scale (fp32 [E, 1, 1]); the backward writes ``a`` again for the down
    projection's weight gradient. The weights are saved as they come, never a stacked or e4m3 copy,
    and may have another dtype than ``x_RD`` (fp32 parameters beside bf16 activations): they are
    quantised from their own values, and their gradients come in their own dtype (the GEMM in
    ``x_RD``'s)."""

    @staticmethod
    def forward(ctx, x_RD, offsets_E, row_scores_R, emulated: bool, gemm: str, *weights):
        ctx.emulated, ctx.gemm = emulated, gemm
        out_RD, saved = fp8_experts_forward(x_RD, None, offsets_E, row_scores_R, weights, emulated=emulated, gemm=gemm)
        ctx.save_for_backward(*saved)
        return out_RD

    @staticmethod
    # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); torch documents one argument per output
    def backward(ctx, grad_out_RD):
        needs_x, _, needs_scores, _, _, *needs_weights = ctx.needs_input_grad
        grad_x, grad_scores, *grad_weights = fp8_experts_backward(
            ctx.saved_tensors,
            row_major(grad_out_RD),
            None,
            (needs_x, needs_scores, *needs_weights),
            emulated=ctx.emulated,
            gemm=ctx.gemm,
        )
        return grad_x, None, grad_scores, None, None, *grad_weights


class Fp8RoutedExperts(torch.autograd.Function):
    """``out[t] = sum_k scores[t, k] * expert_{ids[t, k]}(x[t])`` with ``Fp8SwigluExperts``' block on one
    device, the tokens permuted here: ``x_TD`` [T, D], ``ids_TK`` [T, K] in [0, E] (E: dropped, nothing)
    and ``scores_TK`` [T, K] -> [T, D] in ``x_TD``'s dtype; D and F multiples of ``FP8_ALIGN``.

    The permute writes each token's e4m3 rows beside its copies (``kernels.fp8_quantize``'s
    ``permute_quantize_rows``), and in the backward the output gradient's, so no activation is quantised
    in a pass of its own. Each row's score multiplies the down projection's input (as under expert
    parallelism with ``experts_apply_scores``), the K rows of a token are summed unweighted, and the
    scores' gradient comes from the SwiGLU's backward: no expert output is kept. Rows are grouped by
    ``kernels.moe_permute.routing_metadata``; no host sync."""

    @staticmethod
    def forward(ctx, x_TD, ids_TK, scores_TK, gemm: str, *weights):
        num_experts, top_k = weights[0].shape[0], ids_TK.shape[1]
        row_slot_S, slot_row_S, group_end_E = routing_metadata(ids_TK, num_experts)
        dest_row_S = torch.where(ids_TK.reshape(-1) < num_experts, slot_row_S, -1)
        rows_RD, *x_quantized = permute_quantize_rows(x_TD, dest_row_S, top_k, row_slot_S.shape[0])
        row_scores_R = scores_TK.reshape(-1)[row_slot_S.long()]
        out_RD, saved = fp8_experts_forward(
            rows_RD, tuple(x_quantized), group_end_E, row_scores_R, weights, emulated=False, gemm=gemm
        )
        ctx.gemm, ctx.num_tokens, ctx.top_k = gemm, x_TD.shape[0], top_k
        ctx.save_for_backward(row_slot_S, dest_row_S, *saved)
        return sum_token_rows(out_RD, dest_row_S, top_k)

    @staticmethod
    # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); torch documents one argument per output
    def backward(ctx, grad_out_TD):
        row_slot_S, dest_row_S, *saved = ctx.saved_tensors
        needs_x, _, needs_scores, _, *needs_weights = ctx.needs_input_grad
        grad_rows_RD, *grad_quantized = permute_quantize_rows(grad_out_TD, dest_row_S, ctx.top_k, row_slot_S.shape[0])
        grad_rows_x, grad_row_scores, *grad_weights = fp8_experts_backward(
            saved, grad_rows_RD, tuple(grad_quantized), (needs_x, needs_scores, *needs_weights), emulated=False,
            gemm=ctx.gemm,
        )  # fmt: skip
        grad_x = sum_token_rows(grad_rows_x, dest_row_S, ctx.top_k) if grad_rows_x is not None else None
        grad_scores = None
        if grad_row_scores is not None:
            grad_scores = torch.empty_like(grad_row_scores).index_copy_(0, row_slot_S.long(), grad_row_scores)
            grad_scores = grad_scores.view(ctx.num_tokens, ctx.top_k)
        return grad_x, None, grad_scores, None, *grad_weights


def _stacked(parts) -> torch.Tensor:
    """``parts`` (weights [E, P, K] or gradients [R, P]) joined along dimension 1; one part as is."""
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _pad_last_dims(t: torch.Tensor, dims: int) -> torch.Tensor:
    """Zero-pad the last ``dims`` dimensions of ``t`` to multiples of ``FP8_ALIGN`` (zeros change no result)."""
    pad: list[int] = []
    for size in reversed(t.shape[-dims:]):
        pad += [0, -size % FP8_ALIGN]
    return F.pad(t, pad) if any(pad) else t


def fp8_grouped_experts(
    x_RD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
    row_scores_R: torch.Tensor | None = None,
    *,
    emulated: bool,
    gemm: str = "torch",
) -> torch.Tensor:
    """The SwiGLU expert block (``experts`` module docstring) with FP8 rowwise GEMMs computed by
    ``FP8_GEMMS[gemm]`` (``Fp8SwigluExperts``); rows grouped by expert, no host sync. D and F are
    zero-padded to multiples of 16 and the output cut back. With ``row_scores_R`` (``(R,)``) each output
    row is weighted by its score through the down projection's input (the down projection is linear in
    its rows), which is then quantised."""
    if row_scores_R is not None and row_scores_R.shape != (x_RD.shape[0],):
        raise ValueError(f"row scores must have shape ({x_RD.shape[0]},), got {tuple(row_scores_R.shape)}")
    dim = x_RD.shape[1]
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    x_RD = row_major(_pad_last_dims(x_RD, 1))
    weights = [_pad_last_dims(w, 2) for w in (w1_EFD, w2_EDF, w3_EFD)]
    out_RD = Fp8SwigluExperts.apply(x_RD, offsets_E, row_scores_R, emulated, gemm, *weights)
    return out_RD[:, :dim]


def fp8_routed_experts(
    x_TD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    topk_expert_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    *,
    gemm: str = "triton",
) -> torch.Tensor:
    """``out[t] = sum_k scores[t, k] * SwiGLU_{ids[t, k]}(x[t])`` with FP8 rowwise GEMMs computed by
    ``FP8_GEMMS[gemm]`` on one device (``Fp8RoutedExperts``; the backends' ``routed`` contract): tokens
    [T, D], top-k ids (in [0, E]; E: dropped) and scores [T, K] -> [T, D] in ``x_TD``'s dtype. D and F
    are zero-padded to multiples of 16 and the output cut back. GPU kernels only: the emulation takes
    the dispatcher's rows (``fp8_grouped_experts``)."""
    dim = x_TD.shape[1]
    weights = [_pad_last_dims(w, 2) for w in (w1_EFD, w2_EDF, w3_EFD)]
    x_TD = row_major(_pad_last_dims(x_TD, 1))
    return Fp8RoutedExperts.apply(x_TD, topk_expert_ids_TK, topk_scores_TK, gemm, *weights)[:, :dim]


class _ReferenceFp8Linear(torch.autograd.Function):
    """``a @ w.T`` of one expert in fp32 from e4m3-rounded operands; gradients per the recipe: the input
    gradient from ``w`` rounded to e4m3 with one scale for the whole expert."""

    @staticmethod
    def forward(ctx, a_MK, w_NK):
        ctx.save_for_backward(a_MK, w_NK)
        return quantize_dequantize(a_MK) @ quantize_dequantize(w_NK).T

    @staticmethod
    # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); torch documents one argument per output
    def backward(ctx, grad_MN):
        a_MK, w_NK = ctx.saved_tensors
        grad_a = quantize_dequantize(grad_MN) @ quantize_dequantize(w_NK.reshape(1, -1)).reshape(w_NK.shape)
        return grad_a, grad_MN.T @ a_MK


def reference_fp8_experts(
    x_RD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
    row_scores_R: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 rowwise expert block in plain torch: one expert at a time, the gate and up projections
    as one GEMM over ``[w1; w3]``, every GEMM in fp32 from quantised-dequantised operands (host
    sync; for tests). With ``row_scores_R`` each row of the down projection's input times its score
    before it is quantised. Output: the experts' rows (the counts' sum) in ``x_RD``'s dtype."""
    outputs = []
    start = 0
    for expert, count in enumerate(num_tokens_per_expert_E.tolist()):
        x_MD = x_RD[start : start + count].float()
        gate_up = _ReferenceFp8Linear.apply(x_MD, torch.cat([w1_EFD[expert], w3_EFD[expert]]).float())
        gate, up = gate_up.chunk(2, dim=-1)
        h_MF = F.silu(gate) * up
        if row_scores_R is not None:
            h_MF = h_MF * row_scores_R[start : start + count].float()[:, None]
        start += count
        outputs.append(_ReferenceFp8Linear.apply(h_MF, w2_EDF[expert].float()))
    return torch.cat(outputs).to(x_RD.dtype)


def reference_routed_fp8_experts(
    x_TD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    topk_expert_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
) -> torch.Tensor:
    """``fp8_routed_experts`` in plain torch: each expert's slots in token order, their rows weighted by
    their scores before the down projection (``reference_fp8_experts`` with row scores), summed per token;
    slots of expert E (dropped) contribute nothing."""
    num_experts, top_k = w1_EFD.shape[0], topk_expert_ids_TK.shape[1]
    slots = torch.cat([torch.nonzero(topk_expert_ids_TK.reshape(-1) == e).flatten() for e in range(num_experts)])
    counts = torch.stack([(topk_expert_ids_TK == e).sum() for e in range(num_experts)])
    rows = reference_fp8_experts(
        x_TD[slots // top_k], w1_EFD, w2_EDF, w3_EFD, counts, topk_scores_TK.reshape(-1)[slots]
    )
    return torch.zeros_like(x_TD).index_add(0, slots // top_k, rows)


def fp8_gemms_unavailable_reason() -> str | None:
    """Why FP8 expert GEMMs cannot run on this machine (None: they can): they need a CUDA GPU of
    compute capability 9.0 or newer."""
    if not torch.cuda.is_available():
        return (
            "FP8 expert GEMMs need a CUDA GPU of compute capability 9.0 or newer (H100, H200), "
            "and CUDA is not available"
        )
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return (
            f"FP8 expert GEMMs need a GPU of compute capability 9.0 or newer (H100, H200); this GPU has {major}.{minor}"
        )
    return None


def fp8_unavailable_reason(precision: str) -> str | None:
    """Why ``moe.expert_precision = precision`` cannot compute on this machine (None: it can), naming the
    emulated precision that trains here."""
    reason = fp8_gemms_unavailable_reason() if precision == "fp8_rowwise" else None
    if reason is not None:
        reason += "; moe.expert_precision = 'fp8_rowwise_emulated' computes the same numerics in fp32 here"
    return reason
