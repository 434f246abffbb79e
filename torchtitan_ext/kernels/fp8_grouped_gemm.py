"""FP8 grouped GEMM with rowwise scales over expert-grouped rows, as a ``torch.library`` op.

For the rows r of expert e (``group_end`` as the SwiGLU kernels: expert e owns rows
[group_end[e-1], group_end[e])):

    out[r, n] = (sum_k a[r, k] * w[e, n, k]) * a_inverse[r] * w_inverse[e, n]

``a`` [R, K] and ``w`` [E, N, K] hold e4m3 values, ``a_inverse`` [R, 1] and ``w_inverse`` [E, N, 1]
the fp32 inverse scales of their rows along K. Products accumulate in fp32 (on Hopper with the tensor
cores' fast FP8 accumulation, Triton's default there, as
``torch._scaled_grouped_mm(use_fast_accum=True)``); the scales apply in the epilogue. Rows after
group_end[E-1] belong to no expert: their output rows are not written (unset). The op reads nothing
on the host, so ``torch.compile(fullgraph=True)`` traces around it and CUDA graphs capture it; it has
no autograd formula (the FP8 recipe, ``fp8_experts.Fp8SwigluExperts``, is the differentiable layer).
"""

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels.availability import check_runnable
from torchtitan_ext.kernels.launch_configs import (
    FP8_GEMM_CONFIGS,
    descriptor_blocks,
    fit_to_shape,
    fitted,
    gemm_configs,
    tensor_descriptors,
)
from torchtitan_ext.kernels.library_ops import kernel_op
from torchtitan_ext.kernels.swiglu_kernels import WEIGHT_BLOCK, program_tile_of_rows_times_weight_transposed
from torchtitan_ext.kernels.swiglu_passes import row_tile_grid, row_tile_meta


@fitted(
    gemm_configs(FP8_GEMM_CONFIGS, pre_hook=descriptor_blocks(a_desc=("BLOCK_M", "BLOCK_K"), w_desc=WEIGHT_BLOCK)),
    key=["size_n", "size_k", "USE_TMA"],
    fit=fit_to_shape(m=None, n="size_n", k="size_k"),
    divides={"EVEN_K": ("size_k", "BLOCK_K")},
)
@triton.jit
def _scaled_grouped_gemm_kernel(
    a_desc,
    w_desc,
    a_ptr,
    w_ptr,
    a_inverse_ptr,
    w_inverse_ptr,
    out_ptr,
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
    """One [BLOCK_M, BLOCK_N] output tile (module docstring); a row tile may read rows past its
    expert's segment through the descriptor, whose outputs are masked at the store."""
    acc, expert, rows, row_mask, cols, col_mask = program_tile_of_rows_times_weight_transposed(
        a_desc,
        w_desc,
        a_ptr,
        w_ptr,
        group_end_ptr,
        num_rows,
        num_experts,
        size_n,
        size_k,
        USE_TMA,
        DOT_PRECISION,
        BLOCK_E,
        GROUP_M,
        EVEN_K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    if expert >= num_experts:
        return
    a_inverse = tl.load(a_inverse_ptr + rows, mask=row_mask, other=0.0)
    weight_rows = expert.to(tl.int64) * size_n
    w_inverse = tl.load(w_inverse_ptr + weight_rows + cols, mask=col_mask, other=0.0)
    acc = acc * a_inverse[:, None] * w_inverse[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * size_n + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@kernel_op("fp8_grouped_gemm")
def fp8_grouped_gemm(
    a_values_RK: torch.Tensor,
    a_inverse_R1: torch.Tensor,
    w_values_ENK: torch.Tensor,
    w_inverse_EN1: torch.Tensor,
    group_end_E: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[R, N]`` in ``out_dtype`` (module docstring); ``group_end_E`` int32, an inclusive cumsum of
    the experts' row counts."""
    operands = (a_values_RK, a_inverse_R1, w_values_ENK, w_inverse_EN1, group_end_E)
    check_runnable(*operands)
    num_rows, size_k = a_values_RK.shape
    num_experts, size_n, _ = w_values_ENK.shape
    out_RN = a_values_RK.new_empty(num_rows, size_n, dtype=out_dtype)
    if num_rows == 0:
        return out_RN
    a_RK, w_ENK = a_values_RK.contiguous(), w_values_ENK.contiguous()
    use_tma, (a_desc, w_desc) = tensor_descriptors(a_RK, w_ENK)
    _scaled_grouped_gemm_kernel[row_tile_grid(num_rows, num_experts, size_n)](
        a_desc,
        w_desc,
        a_RK,
        w_ENK,
        a_inverse_R1.float().contiguous(),
        w_inverse_EN1.float().contiguous(),
        out_RN,
        group_end_E,
        num_rows,
        num_experts,
        size_n,
        size_k,
        USE_TMA=use_tma,
        **row_tile_meta(a_RK.dtype, num_experts),
    )
    return out_RN


@torch.library.register_fake(fp8_grouped_gemm)
def _(a_values_RK, a_inverse_R1, w_values_ENK, w_inverse_EN1, group_end_E, out_dtype):
    return a_values_RK.new_empty(a_values_RK.shape[0], w_values_ENK.shape[1], dtype=out_dtype)
