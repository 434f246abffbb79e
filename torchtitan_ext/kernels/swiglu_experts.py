"""SwiGLU experts over expert-grouped rows as a differentiable ``torch.library`` op.

For the rows of expert e (weights in torchtitan's layouts w1 [E,F,D], w2 [E,D,F], w3 [E,F,D]):

    gate = x @ w1[e].T,  up = x @ w3[e].T,  h = silu(gate) * up,  y = h @ w2[e].T

Two modes share the kernels:

- grouped: the rows of x_RD are already grouped by expert; expert e owns rows
  [group_end[e-1], group_end[e]); rows after group_end[E-1] belong to no expert: their
  output, pre-activation and input-gradient rows are not written (unset, as ``torch._grouped_mm``
  leaves them; EP's static receive rows hold unset values there too) and their score gradient is
  zero; they change no weight gradient. With row scores, the down projection's epilogue weights
  each row by its own score and the backward computes the scores' gradient from what it reads
  anyway, so the caller keeps no expert output for it (the expert-parallel combine then sums
  rows unweighted).
- routed: x_TD holds tokens; they are copied into expert order once (grouped row r holds token
  ``row_slot[r] // top_k``), the down projection's epilogue weights each row by its slot's router
  score, and the K weighted rows of each token are summed.

Backward reads the gate and up pre-activations ([R, F] each). The forward keeps them, or, in grouped
mode with ``recompute_preactivations``, keeps none and backward computes them again from x (one more
gate/up GEMM, ``torchtitan_ext::swiglu_experts_preactivations``): less memory between forward and
backward for more compute.

``torchtitan_ext::swiglu_experts_forward``, ``torchtitan_ext::swiglu_experts_backward`` and
``torchtitan_ext::swiglu_experts_preactivations`` are custom ops (``swiglu_passes`` launches their
kernels) with fake implementations and an autograd formula, so ``torch.compile(fullgraph=True)``
traces around them and CUDA graphs capture them: none reads anything on the host.
"""

from __future__ import annotations

import torch

from torchtitan_ext.kernels.availability import check_runnable
from torchtitan_ext.kernels.library_ops import kernel_op
from torchtitan_ext.kernels.swiglu_passes import swiglu_backward, swiglu_forward, swiglu_preactivations

_GRADIENT_INPUTS = (0, 1, 2, 3, 7)
"""Positions of the forward op's differentiable inputs: x, w1, w2, w3, scores."""


def _absent(like: torch.Tensor, dim: int) -> torch.Tensor:
    """A [0, dim] tensor standing for an output the op did not produce (op outputs cannot be None)."""
    return like.new_empty(0, dim)


@kernel_op("swiglu_experts_forward")
def swiglu_experts_forward(
    x_XD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    group_end_E: torch.Tensor,
    row_slot_S: torch.Tensor | None,
    slot_row_S: torch.Tensor | None,
    scores_S: torch.Tensor | None,
    top_k: int,
    keep_for_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, x_RD, gate_RF, up_RF)``; the last three are [0, *] unless ``keep_for_backward`` (and
    ``x_RD``, the tokens in expert order, only in routed mode)."""
    tensors = [x_XD, w1_EFD, w2_EDF, w3_EFD, group_end_E]
    check_runnable(*tensors, *(t for t in (row_slot_S, slot_row_S, scores_S) if t is not None))
    out, x_RD, gate_RF, up_RF = swiglu_forward(
        x_XD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, top_k, keep_for_backward
    )
    hidden, dim = w1_EFD.shape[1], x_XD.shape[1]
    return (
        out,
        _absent(x_XD, dim) if x_RD is None else x_RD,
        _absent(x_XD, hidden) if gate_RF is None else gate_RF,
        _absent(x_XD, hidden) if up_RF is None else up_RF,
    )


@torch.library.register_fake(swiglu_experts_forward)
def _(x_XD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, top_k, keep_for_backward):
    routed = row_slot_S is not None
    num_rows = row_slot_S.shape[0] if routed else x_XD.shape[0]
    hidden, dim = w1_EFD.shape[1], x_XD.shape[1]
    kept_rows = num_rows if keep_for_backward else 0
    return (
        x_XD.new_empty(x_XD.shape[0], dim),
        x_XD.new_empty(kept_rows if routed else 0, dim),
        x_XD.new_empty(kept_rows, hidden),
        x_XD.new_empty(kept_rows, hidden),
    )


@kernel_op("swiglu_experts_backward")
def swiglu_experts_backward(
    dout: torch.Tensor,
    x_RD: torch.Tensor | None,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    group_end_E: torch.Tensor,
    row_slot_S: torch.Tensor | None,
    slot_row_S: torch.Tensor | None,
    scores_S: torch.Tensor | None,
    gate_RF: torch.Tensor,
    up_RF: torch.Tensor,
    top_k: int,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw1, dw2, dw3, dscores)``; a gradient ``needs_grad`` does not ask for is a 0-size tensor."""
    grads = swiglu_backward(
        dout, x_RD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, gate_RF, up_RF, top_k,
        needs_grad,
    )  # fmt: skip
    dx, dw1, dw2, dw3, dscores = (dout.new_empty(0) if grad is None else grad for grad in grads)
    return dx, dw1, dw2, dw3, dscores


@torch.library.register_fake(swiglu_experts_backward)
def _(dout, x_RD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, gate_RF, up_RF, top_k,
      needs_grad):  # fmt: skip
    needs_dx, needs_dw1, needs_dw2, needs_dw3, needs_dscores = needs_grad
    num_inputs = dout.shape[0]
    absent = dout.new_empty(0)
    return (
        dout.new_empty(num_inputs, dout.shape[1], dtype=gate_RF.dtype) if needs_dx else absent,
        torch.empty_like(w1_EFD) if needs_dw1 or needs_dw3 else absent,
        torch.empty_like(w2_EDF) if needs_dw2 else absent,
        torch.empty_like(w3_EFD) if needs_dw1 or needs_dw3 else absent,
        torch.empty_like(scores_S) if needs_dscores and scores_S is not None else absent,
    )


@kernel_op("swiglu_experts_preactivations")
def swiglu_experts_preactivations(
    x_RD: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, group_end_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_RF, up_RF)`` of expert-grouped rows: what a forward that kept none would have kept."""
    check_runnable(x_RD, w1_EFD, w3_EFD, group_end_E)
    return swiglu_preactivations(x_RD, w1_EFD, w3_EFD, group_end_E)


@torch.library.register_fake(swiglu_experts_preactivations)
def _(x_RD, w1_EFD, w3_EFD, group_end_E):
    hidden = w1_EFD.shape[1]
    return x_RD.new_empty(x_RD.shape[0], hidden), x_RD.new_empty(x_RD.shape[0], hidden)


def _setup_context(ctx, inputs, output) -> None:
    x_XD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, top_k, keep_for_backward = inputs
    _, x_RD, gate_RF, up_RF = output
    ctx.mark_non_differentiable(x_RD, gate_RF, up_RF)
    ctx.set_materialize_grads(False)
    # A grouped forward that needed a gradient but kept nothing recomputes its pre-activations in backward.
    needs_a_gradient = any(ctx.needs_input_grad[i] for i in _GRADIENT_INPUTS)
    ctx.recompute = row_slot_S is None and not keep_for_backward and needs_a_gradient
    weight_rows = x_RD if row_slot_S is not None else x_XD
    needs_weight_rows = any(ctx.needs_input_grad[1:4]) or ctx.recompute
    ctx.save_for_backward(
        weight_rows if needs_weight_rows else None,
        w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, gate_RF, up_RF,
    )  # fmt: skip
    ctx.top_k = top_k


def _backward(ctx, dout, _dx_RD, _dgate_RF, _dup_RF):
    x_RD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, gate_RF, up_RF = ctx.saved_tensors
    if ctx.recompute:
        gate_RF, up_RF = swiglu_experts_preactivations(x_RD, w1_EFD, w3_EFD, group_end_E)
    needs_grad = [ctx.needs_input_grad[i] for i in _GRADIENT_INPUTS]
    grads = swiglu_experts_backward(
        dout, x_RD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, gate_RF, up_RF,
        ctx.top_k, needs_grad,
    )  # fmt: skip
    dx, dw1, dw2, dw3, dscores = (grad if need else None for grad, need in zip(grads, needs_grad))
    return dx, dw1, dw2, dw3, None, None, None, dscores, None, None


torch.library.register_autograd(swiglu_experts_forward, _backward, setup_context=_setup_context)


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
    recompute_preactivations: bool = False,
) -> torch.Tensor:
    """SwiGLU experts; grouped mode when row_slot_S is None, routed mode otherwise.

    Args:
        x_XD: grouped mode: [R, D] rows grouped by expert; routed mode: [T, D] tokens.
        group_end_E: [E] int32 exclusive end row of each expert's segment.
        row_slot_S: routed mode: [S = T*K] int32 token-major slot of each grouped row.
        scores_S: routed mode: [S] router weight of each slot (token-major); grouped mode: None, or
            [R] the weight of each row (its output is multiplied by it; differentiable).
        top_k: routed mode: K.
        slot_row_S: routed mode: [S] int32 grouped row of each slot, the inverse of row_slot_S
            (``routing_metadata`` returns both).
        recompute_preactivations: grouped mode: keep no gate/up pre-activations for backward, which
            computes them again from x_XD.

    Returns:
        grouped: [R, D] (times scores_S); routed: [T, D] = sum_k scores * expert output. Dtype of x.
    """
    if row_slot_S is not None and (scores_S is None or slot_row_S is None):
        raise ValueError("routed mode needs scores_S and slot_row_S alongside row_slot_S")
    if row_slot_S is not None and recompute_preactivations:
        raise ValueError("recompute_preactivations applies to grouped mode only")
    if row_slot_S is None and scores_S is not None and scores_S.shape != (x_XD.shape[0],):
        raise ValueError(f"grouped mode's row scores must have shape ({x_XD.shape[0]},), got {tuple(scores_S.shape)}")
    differentiable = (x_XD, w1_EFD, w2_EDF, w3_EFD, scores_S)
    needs_backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)
    keep_for_backward = needs_backward and not recompute_preactivations
    out, _, _, _ = swiglu_experts_forward(
        x_XD, w1_EFD, w2_EDF, w3_EFD, group_end_E, row_slot_S, slot_row_S, scores_S, top_k, keep_for_backward
    )
    return out
