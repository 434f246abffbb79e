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
reference, the emulation and the GPU kernels see the same e4m3 values. ``fp8_rowwise`` computes
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
    quantize_activation_rows,
    quantize_rows,
    quantize_rows_transposed,
)

from .grouped_matmul import grouped_mm, row_major, weight_rows

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


def scaled_grouped_gemm(
    a_parts_RP: Sequence[torch.Tensor],
    w_values_ENK: torch.Tensor,
    w_inverse_EN1: torch.Tensor,
    offsets_E: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulated: bool,
    gemm: str,
) -> torch.Tensor:
    """``a_RK @ w[e].T`` over the row groups ending at ``offsets_E``, ``a_RK`` the parts ``a_parts_RP``
    joined along K (``[d gate, d up]``; one part as is): quantised rowwise along K here (on the GPU by
    ``kernels.fp8_quantize``'s activation kernel, which reads the parts in place and skips the rows past
    the groups; emulated, the same rule in plain torch), ``w`` comes quantised (row-major e4m3 values
    [E, N, K] and inverse scales [E, N, 1]) -> [R, N] in ``out_dtype``, computed by ``FP8_GEMMS[gemm]``
    (``emulated``: in fp32 from the dequantised operands). K and N must be multiples of ``FP8_ALIGN``."""
    if emulated:
        a_values, a_inverse = quantize_rowwise(_stacked(a_parts_RP))
        dequantized_w = w_values_ENK.float() * w_inverse_EN1
        return grouped_mm(a_values.float() * a_inverse, dequantized_w.transpose(-2, -1), offsets_E).to(out_dtype)
    a_values, a_inverse = quantize_activation_rows(list(a_parts_RP), offsets_E)
    return FP8_GEMMS[gemm](a_values, a_inverse, w_values_ENK, w_inverse_EN1, offsets_E, out_dtype)


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


class Fp8GroupedLinear(torch.autograd.Function):
    """``a_RK @ w_ENK[e].T`` in FP8 rowwise with the gradients of the module docstring's recipe, the
    weight ``w_ENK`` given as parts ``w_EPK`` stacked along N (``[w1; w3]``: one GEMM for the gate
    and up projections) -> one output [R, P] per part (column blocks of the one GEMM's output). The
    parts are saved, not their stack, and each part's weight gradient is its own GEMM, so no stacked
    copy outlives a pass and no gradient is sliced out of a stacked one.

    The parts may have another dtype than ``a_RK`` (fp32 parameters beside bf16 activations): they are
    quantised from their own values, with no cast to the activations' dtype before (a pass over the
    weights in each direction, and a copy the backward would keep), and their gradients come in their
    own dtype (the GEMM in ``a_RK``'s)."""

    @staticmethod
    def forward(ctx, a_RK, offsets_E, emulated: bool, gemm: str, *w_parts_EPK):
        ctx.emulated, ctx.gemm = emulated, gemm
        w_values, w_inverse = quantize_stacked_rows(w_parts_EPK, emulated=emulated)
        ctx.save_for_backward(a_RK, offsets_E, w_inverse.amax(dim=1, keepdim=True), *w_parts_EPK)
        y_RN = scaled_grouped_gemm([a_RK], w_values, w_inverse, offsets_E, a_RK.dtype, emulated=emulated, gemm=gemm)
        return y_RN.split([w.shape[1] for w in w_parts_EPK], dim=1)

    @staticmethod
    # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); torch documents one argument per output
    def backward(ctx, *grad_parts_RP):
        a_RK, offsets_E, expert_inverse_E11, *w_parts_EPK = ctx.saved_tensors
        grad_parts_RP = [row_major(grad) for grad in grad_parts_RP]
        grad_a = None
        if ctx.needs_input_grad[0]:
            w_values_T = quantize_stacked_rows_transposed(
                w_parts_EPK, expert_inverse_E11, emulated=ctx.emulated, ordered_after=grad_parts_RP[0]
            )
            grad_a = scaled_grouped_gemm(
                grad_parts_RP,
                w_values_T,
                expert_inverse_E11.expand(-1, a_RK.shape[1], -1).contiguous(),
                offsets_E,
                a_RK.dtype,
                emulated=ctx.emulated,
                gemm=ctx.gemm,
            )
        grad_w_parts = [
            grouped_mm(grad.transpose(0, 1), a_RK, offsets_E).to(w.dtype) if needed else None
            for grad, w, needed in zip(grad_parts_RP, w_parts_EPK, ctx.needs_input_grad[4:], strict=True)
        ]
        return grad_a, None, None, None, *grad_w_parts


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
    ``FP8_GEMMS[gemm]``, the gate and up projections as one; rows grouped by expert, no host sync. D
    and F are zero-padded to multiples of 16 and the output cut back. With ``row_scores_R`` (``(R,)``)
    each output row is weighted by its score through the down projection's input (``weight_rows``),
    which is then quantised."""
    dim = x_RD.shape[1]
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

    def linear(a_RK: torch.Tensor, *w_parts_EPK: torch.Tensor) -> tuple[torch.Tensor, ...]:
        padded = [_pad_last_dims(w, 2) for w in w_parts_EPK]
        return Fp8GroupedLinear.apply(a_RK, offsets_E, emulated, gemm, *padded)

    x_RD = row_major(_pad_last_dims(x_RD, 1))
    gate_RF, up_RF = linear(x_RD, w1_EFD, w3_EFD)
    (out_RD,) = linear(weight_rows(F.silu(gate_RF) * up_RF, row_scores_R), w2_EDF)
    return out_RD[:, :dim]


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
