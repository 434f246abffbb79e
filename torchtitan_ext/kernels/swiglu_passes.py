"""Host side of the SwiGLU expert block: one forward pass and one backward pass, each a sequence of
``swiglu_kernels`` launches over expert-grouped rows. No autograd here (``swiglu_experts`` is the op).

Forward computes gate and up pre-activations [R, F] (kept when the caller will run backward),
h = silu(gate) * up and y = h @ w2[e].T; in routed mode it first copies the tokens into expert order
(each token read once, written to its K rows) and ends with the sum over K of the weighted slot rows.
Backward recomputes h from gate and up and writes d gate and d up into new buffers, freeing d gate
once d w1 is done, before d w3 is allocated. Every reduction has a fixed order: results are the same
from run to run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import triton

from torchtitan_ext.kernels import hopper_weight_gradient
from torchtitan_ext.kernels.availability import persistent_programs
from torchtitan_ext.kernels.launch_configs import (
    block_experts,
    dot_precision,
    num_row_tiles_upper_bound,
    tensor_descriptors,
)
from torchtitan_ext.kernels.moe_permute import scatter_token_rows, sum_slots
from torchtitan_ext.kernels.swiglu_kernels import (
    _down_backward_kernel,
    _down_forward_kernel,
    _gate_up_backward_input_kernel,
    _gate_up_forward_kernel,
    _gate_up_pass_kernel,
    _swiglu_backward_kernel,
    _weight_gradient_kernel,
)

GROUP_M = 8
"""Row tiles swizzled per column sweep (neighbouring programs share operands in L2)."""
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


def row_tile_grid(num_rows: int, num_experts: int, num_cols: int):
    """Launch grid of a row-tile kernel over ``num_rows`` expert-grouped rows and ``num_cols`` output
    columns: enough programs for any expert counts (``num_row_tiles_upper_bound``)."""

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


def row_tile_meta(dtype: torch.dtype, num_experts: int) -> dict:
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


def _release(buffer: torch.Tensor) -> None:
    """Free the memory of a backward buffer that is no longer read, before backward returns (the
    launch arguments still hold it until then)."""
    buffer.untyped_storage().resize_(0)


def _gate_up(
    x_RD: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, group_end_E: torch.Tensor, keep_preactivations: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``(gate_RF, up_RF, h_RF)`` of the expert-grouped rows ``x_RD`` (weights already in its dtype,
    contiguous); the pre-activations are None unless ``keep_preactivations``."""
    num_rows, dim = x_RD.shape
    num_experts, hidden, _ = w1.shape
    split = gate_up_in_two_passes(dim, hidden)
    gate_RF = x_RD.new_empty(num_rows, hidden) if keep_preactivations or split else None
    up_RF = x_RD.new_empty(num_rows, hidden) if keep_preactivations else None
    h_RF = x_RD.new_empty(num_rows, hidden)
    common = row_tile_meta(x_RD.dtype, num_experts)
    grid = row_tile_grid(num_rows, num_experts, hidden)
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
                SAVE_UP=keep_preactivations,
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
            SAVE_PREACT=keep_preactivations,
            USE_TMA=use_tma,
            **common,
        )
    return (gate_RF, up_RF, h_RF) if keep_preactivations else (None, None, h_RF)


def swiglu_preactivations(
    x_RD: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, group_end_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_RF, up_RF)`` of expert-grouped rows, as :func:`swiglu_forward` keeps them for backward:
    the gate/up GEMM again, for a backward whose forward kept none."""
    w1, w3 = (w.to(x_RD.dtype).contiguous() for w in (w1_EFD, w3_EFD))
    gate_RF, up_RF, _ = _gate_up(x_RD.contiguous(), w1, w3, group_end_E, keep_preactivations=True)
    assert gate_RF is not None and up_RF is not None
    return gate_RF, up_RF


def swiglu_forward(
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(out, x_RD, gate_RF, up_RF)``: the expert block's output and, with ``keep_for_backward``, what
    backward reads (``x_RD``: the tokens in expert order, routed mode only; grouped mode's rows are
    ``x_XD`` itself). Arguments as :func:`swiglu_experts.swiglu_experts`."""
    routed = row_slot_S is not None
    num_experts, hidden, dim = w1_EFD.shape
    num_rows = row_slot_S.shape[0] if routed else x_XD.shape[0]
    _announce_first_use(x_XD, w1_EFD, routed)
    x_XD = x_XD.contiguous()
    w1, w2, w3 = (w.to(x_XD.dtype).contiguous() for w in (w1_EFD, w2_EDF, w3_EFD))
    if routed:
        assert slot_row_S is not None and scores_S is not None, "routed mode needs slot_row_S and scores_S"
        x_RD = _grouped_rows(x_XD, slot_row_S, top_k)
    else:
        x_RD = x_XD
    scores = None if scores_S is None else scores_S.contiguous()
    gate_RF, up_RF, h_RF = _gate_up(x_RD, w1, w3, group_end_E, keep_for_backward)
    rows_out = x_XD.new_empty(num_rows, dim)
    common = row_tile_meta(x_XD.dtype, num_experts)
    use_tma, (h_desc, w2_desc) = tensor_descriptors(h_RF, w2)
    _down_forward_kernel[row_tile_grid(num_rows, num_experts, dim)](
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
        HAS_SCORES=scores is not None,
        USE_TMA=use_tma,
        **common,
    )
    out = sum_slots(rows_out, None, top_k, num_rows // top_k) if routed and top_k > 1 else rows_out
    if not keep_for_backward:
        return out, None, None, None
    return out, x_RD if routed else None, gate_RF, up_RF


def swiglu_backward(
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
    needs_grad: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dw1, dw2, dw3, dscores)`` for ``needs_grad`` (the same five, in that order; None where
    not needed). ``x_RD``: the expert-ordered rows forward computed on (needed for weight gradients);
    ``gate_RF`` / ``up_RF``: forward's pre-activations, read only. Weight gradients come in the
    weights' dtype, ``dscores`` in the scores' dtype."""
    routed = row_slot_S is not None
    num_experts, hidden, dim = w1_EFD.shape
    num_rows = gate_RF.shape[0]
    dout = dout.to(gate_RF.dtype).contiguous()
    w1, w2, w3 = (w.to(gate_RF.dtype).contiguous() for w in (w1_EFD, w2_EDF, w3_EFD))
    row_common = row_tile_meta(gate_RF.dtype, num_experts)
    needs_dx, needs_dw1, needs_dw2, needs_dw3, needs_dscores = needs_grad

    if routed:
        assert slot_row_S is not None and scores_S is not None, "routed mode needs slot_row_S and scores_S"
        dout_RD = _grouped_rows(dout, slot_row_S, top_k)
    else:
        dout_RD = dout
    scores = None if scores_S is None else scores_S.contiguous()
    dh_RF = gate_RF.new_empty(num_rows, hidden)
    use_tma, (dy_desc, w2_desc) = tensor_descriptors(dout_RD, w2)
    _down_backward_kernel[row_tile_grid(num_rows, num_experts, hidden)](
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
    dscores_S = None if scores is None else torch.zeros(num_rows, device=dout.device, dtype=torch.float32)
    dgate_RF, dup_RF = torch.empty_like(gate_RF), torch.empty_like(up_RF)
    rows_per_program, block_f = _elementwise_tile(hidden)
    _swiglu_backward_kernel[(max(1, triton.cdiv(num_rows, rows_per_program)),)](
        dh_RF,
        gate_RF,
        up_RF,
        dgate_RF,
        dup_RF,
        row_slot_S,
        scores,
        dscores_S,
        group_end_E,
        num_experts,
        hidden,
        HAS_GATHER=routed,
        HAS_SCORES=scores is not None,
        ROWS=rows_per_program,
        BLOCK_F=block_f,
    )
    hs_RF = dh_RF

    dw2 = None
    if needs_dw2:
        dw2 = torch.empty_like(w2_EDF)
        _weight_gradient(dout_RD, hs_RF, group_end_E, dw2)
    del dout_RD, hs_RF, dh_RF

    dx = None
    if needs_dx:
        dx_rows = gate_RF.new_empty(num_rows, dim)
        operands = (dgate_RF, dup_RF, w1, w3)
        use_tma, descriptors = tensor_descriptors(*operands)
        _gate_up_backward_input_kernel[row_tile_grid(num_rows, num_experts, dim)](
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
    if needs_dw1 or needs_dw3:
        assert x_RD is not None, "weight gradients need the rows forward computed on"
        x_RD = x_RD.contiguous()
        dw1 = torch.empty_like(w1_EFD)
        _weight_gradient(dgate_RF, x_RD, group_end_E, dw1)
        _release(dgate_RF)
        dw3 = torch.empty_like(w3_EFD)
        _weight_gradient(dup_RF, x_RD, group_end_E, dw3)
    dscores = dscores_S.to(scores_S.dtype) if needs_dscores and dscores_S is not None and scores_S is not None else None
    return dx, dw1, dw2, dw3, dscores
