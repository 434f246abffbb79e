"""The expert weight gradients on Hopper GPUs: one Gluon kernel whose TMA load pipeline runs
across output tiles.

``weight_gradient(a_RM, b_RN, group_end_E, out_EMN)`` computes, for every expert e,
``out[e] [M, N] = a[rows of e].T @ b[rows of e]`` over expert-grouped rows (expert e owns rows
``[group_end[e-1], group_end[e])``; an expert without rows gets zeros; rows after
``group_end[E-1]`` are unused). It is what ``swiglu_experts`` runs for d w1, d w2 and d w3 when
``usable`` says so, and the Triton kernel there otherwise.

Why a second kernel: with a few hundred rows per expert (Qwen3-30B-A3B: 512), each output tile's
reduction is short, so a Triton kernel that pipelines loads only inside a tile waits for its
first loads at every tile. Here each program walks its tiles with one ring of shared-memory
stages: the loads of the next tile's first steps are issued while the current tile finishes and
while its result is stored (a 16-bit result asynchronously, through TMA; an fp32 one, the
gradient of fp32 weights under autocast, straight from the registers). The reduction order is
the Triton kernel's (fp32, row steps in order), and the results are bit-identical to it.

Rows of a tile's last, partial step that belong to the next expert are zeroed in shared memory
before the product. Needs a Hopper GPU (wgmma), 16-bit operands of one dtype, an output of that
dtype or fp32, M a multiple of the tile's 128 rows, TMA-compatible strides, and a Triton whose
Gluon this kernel was checked with (``VERIFIED_TRITON``).
"""

from __future__ import annotations

import torch
import triton

from torchtitan_ext.kernels.availability import compute_capability_major, interpreter_enabled, persistent_programs
from torchtitan_ext.kernels.launch_configs import tensor_descriptors_usable

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # Names that moved between Triton minor versions: gl.thread_barrier in 3.6, gl.barrier from
    # 3.7; tma.async_load and tma.async_store from 3.8, whose older names 3.9 removed.
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
except ImportError:
    gluon = None

VERIFIED_TRITON = ("3.6", "3.7", "3.8", "3.9")
"""Triton minor versions on which this kernel ran on an H100 and matched the Triton kernel bit for
bit (Gluon's API changes between minor versions)."""
TRITON_MINOR = ".".join(triton.__version__.split(".")[:2])

BLOCK_M = 128
BLOCK_K = 64
STAGES = 3
STAGES_WITHOUT_STAGING = 4
"""Load stages when the result is stored from the registers (an fp32 result), which frees the
staging tile's shared memory: 1-7% faster than 3 stages on an H100 at the four benchmark shapes."""
NUM_WARPS = 8
GROUP_M = 8


def usable(a_RM: torch.Tensor, b_RN: torch.Tensor, out_EMN: torch.Tensor) -> bool:
    """Whether ``weight_gradient`` can compute ``out_EMN`` from these operands here."""
    if gluon is None or interpreter_enabled() or TRITON_MINOR not in VERIFIED_TRITON:
        return False
    if not a_RM.is_cuda or compute_capability_major(a_RM.device) != 9:
        return False
    if a_RM.dtype != b_RN.dtype or a_RM.dtype not in (torch.bfloat16, torch.float16):
        return False
    if out_EMN.dtype not in (a_RM.dtype, torch.float32):
        return False
    return (
        out_EMN.is_contiguous()
        and out_EMN.shape[1] % BLOCK_M == 0
        and a_RM.shape[0] > 0
        and tensor_descriptors_usable(a_RM, b_RN, *([out_EMN] if _stores_through_tma(a_RM, out_EMN) else []))
    )


def _stores_through_tma(a_RM: torch.Tensor, out_EMN: torch.Tensor) -> bool:
    """A 16-bit result (the operands' dtype) goes out through TMA; an fp32 one from the registers."""
    return out_EMN.dtype == a_RM.dtype


def _block_n(size_n: int) -> int:
    return min(256, max(64, triton.next_power_of_2(size_n)))


if gluon is not None:

    @gluon.jit
    def _tile_of(
        tile,
        total,
        group_end_ptr,
        tiles_per_expert,
        num_m_tiles,
        num_n_tiles,
        GROUP_M: gl.constexpr,
        BLOCK_K: gl.constexpr,
    ):
        """(expert, m tile, n tile, first row, end row, row steps) of output tile ``tile``;
        0 steps when ``tile >= total``."""
        live = tile < total
        tile = gl.minimum(tile, total - 1)
        expert = tile // tiles_per_expert
        local = tile % tiles_per_expert
        tiles_per_group = GROUP_M * num_n_tiles
        first_m = (local // tiles_per_group) * GROUP_M
        group_size = gl.minimum(num_m_tiles - first_m, GROUP_M)
        m_tile = first_m + (local % tiles_per_group) % group_size
        n_tile = (local % tiles_per_group) // group_size
        row_end = gl.load(group_end_ptr + expert)
        row_start = gl.load(group_end_ptr + expert - 1, mask=expert > 0, other=0)
        steps = (row_end - row_start + BLOCK_K - 1) // BLOCK_K * live.to(gl.int32)
        return expert, m_tile, n_tile, row_start, row_end, steps

    @gluon.jit
    def _next_load(
        tile,
        step,
        steps,
        row_start,
        m_tile,
        n_tile,
        total,
        num_programs,
        group_end_ptr,
        tiles_per_expert,
        num_m_tiles,
        num_n_tiles,
        GROUP_M: gl.constexpr,
        BLOCK_K: gl.constexpr,
    ):
        """The (tile, step) after the given one among this program's loads, skipping tiles without
        rows; tile >= total once there are none left."""
        step += 1
        while (step >= steps) & (tile < total):
            tile += num_programs
            step = 0
            _, m_tile, n_tile, row_start, _, steps = _tile_of(
                tile, total, group_end_ptr, tiles_per_expert, num_m_tiles, num_n_tiles, GROUP_M, BLOCK_K
            )
        return tile, step, steps, row_start, m_tile, n_tile

    @gluon.jit
    def _issue_load(
        a_desc,
        b_desc,
        a_smem,
        b_smem,
        ready,
        stage,
        tile,
        step,
        row_start,
        m_tile,
        n_tile,
        total,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
    ):
        """TMA loads of one row step's a [BLOCK_K, BLOCK_M] and b [BLOCK_K, BLOCK_N] into ``stage``
        (nothing when tile >= total)."""
        live = tile < total
        bar = ready.index(stage)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=live)
        row = row_start + step * BLOCK_K
        _tma_load(a_desc, [row, m_tile * BLOCK_M], bar, a_smem.index(stage), pred=live)
        _tma_load(b_desc, [row, n_tile * BLOCK_N], bar, b_smem.index(stage), pred=live)

    @gluon.jit
    def _weight_gradient_kernel(
        a_desc,
        b_desc,
        c_desc,
        c_ptr,
        group_end_ptr,
        num_experts,
        size_m,
        size_n,
        num_programs,
        STORE_TMA: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Persistent: program p computes output tiles p, p + num_programs, ... of c [E * M, N].

        STORE_TMA: tiles go out through c_desc (16-bit c, its dtype the operands'); otherwise each
        thread stores its part of the accumulator through c_ptr (an fp32 c, whose tile staging
        buffer would not fit beside the load ring)."""
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        num_m_tiles = gl.cdiv(size_m, BLOCK_M)
        num_n_tiles = gl.cdiv(size_n, BLOCK_N)
        tiles_per_expert = num_m_tiles * num_n_tiles
        total = num_experts * tiles_per_expert

        a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], a_desc.layout)
        b_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
        if STORE_TMA:
            c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for first_use in gl.static_range(STAGES):
            mbarrier.init(ready.index(first_use), count=1)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        mask_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        pid = gl.program_id(0)
        load_tile = pid - num_programs
        load_step = 0
        load_steps = 0
        load_row = 0
        load_m = 0
        load_n = 0
        load_tile, load_step, load_steps, load_row, load_m, load_n = _next_load(
            load_tile,
            load_step,
            load_steps,
            load_row,
            load_m,
            load_n,
            total,
            num_programs,
            group_end_ptr,
            tiles_per_expert,
            num_m_tiles,
            num_n_tiles,
            GROUP_M,
            BLOCK_K,
        )
        for prefetched in gl.static_range(STAGES - 1):
            _issue_load(
                a_desc,
                b_desc,
                a_smem,
                b_smem,
                ready,
                prefetched,
                load_tile,
                load_step,
                load_row,
                load_m,
                load_n,
                total,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            load_tile, load_step, load_steps, load_row, load_m, load_n = _next_load(
                load_tile,
                load_step,
                load_steps,
                load_row,
                load_m,
                load_n,
                total,
                num_programs,
                group_end_ptr,
                tiles_per_expert,
                num_m_tiles,
                num_n_tiles,
                GROUP_M,
                BLOCK_K,
            )

        consumed = 0
        for tile in range(pid, total, num_programs):
            expert, m_tile, n_tile, row_start, row_end, steps = _tile_of(
                tile, total, group_end_ptr, tiles_per_expert, num_m_tiles, num_n_tiles, GROUP_M, BLOCK_K
            )
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
            for step in range(steps):
                stage = consumed % STAGES
                mbarrier.wait(ready.index(stage), (consumed // STAGES) & 1)
                rows_left = row_end - row_start - step * BLOCK_K
                if rows_left < BLOCK_K:
                    # Both operands' rows past the expert's last are zeroed: they hold the next expert's
                    # rows or memory nobody wrote (possibly NaN, and 0 x NaN is NaN).
                    rows = gl.expand_dims(gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, mask_layout)), 1)
                    a_part = a_smem.index(stage).load(mask_layout)
                    a_smem.index(stage).store(gl.where(rows < rows_left, a_part, gl.zeros_like(a_part)))
                    b_part = b_smem.index(stage).load(mask_layout)
                    b_smem.index(stage).store(gl.where(rows < rows_left, b_part, gl.zeros_like(b_part)))
                    fence_async_shared()
                    _cta_barrier()
                acc = warpgroup_mma(a_smem.index(stage).permute((1, 0)), b_smem.index(stage), acc, is_async=True)
                # The previous step's product is done: its stage takes the load STAGES - 1 steps ahead.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                _issue_load(
                    a_desc,
                    b_desc,
                    a_smem,
                    b_smem,
                    ready,
                    (consumed + STAGES - 1) % STAGES,
                    load_tile,
                    load_step,
                    load_row,
                    load_m,
                    load_n,
                    total,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                )
                load_tile, load_step, load_steps, load_row, load_m, load_n = _next_load(
                    load_tile,
                    load_step,
                    load_steps,
                    load_row,
                    load_m,
                    load_n,
                    total,
                    num_programs,
                    group_end_ptr,
                    tiles_per_expert,
                    num_m_tiles,
                    num_n_tiles,
                    GROUP_M,
                    BLOCK_K,
                )
                consumed += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if STORE_TMA:
                tma.store_wait(pendings=0)
                _cta_barrier()
                # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr STORE_TMA
                c_smem.store(acc.to(dtype))
                fence_async_shared()
                _tma_store(c_desc, [expert * size_m + m_tile * BLOCK_M, n_tile * BLOCK_N], c_smem)
            else:
                rows = (
                    expert * size_m + m_tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                ).to(gl.int64)
                cols = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                offsets = gl.expand_dims(rows, 1) * size_n + gl.expand_dims(cols, 0)
                gl.store(c_ptr + offsets, acc, mask=gl.expand_dims(cols < size_n, 0))
        if STORE_TMA:
            tma.store_wait(pendings=0)
        for last_use in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(last_use))


def weight_gradient(a_RM: torch.Tensor, b_RN: torch.Tensor, group_end_E: torch.Tensor, out_EMN: torch.Tensor) -> None:
    """out[e] = a[rows of e].T @ b[rows of e] for every expert; a [R, M], b [R, N], group_end [E]
    int32, out [E, M, N] (written in full). Only where ``usable(a_RM, b_RN, out_EMN)``."""
    num_experts, size_m, size_n = out_EMN.shape
    block_n = _block_n(size_n)
    dtype = _GLUON_DTYPES[a_RM.dtype]

    def descriptor(tensor, block_shape):
        layout = gl.NVMMASharedLayout.get_default_for(block_shape, dtype)
        return GluonTensorDescriptor.from_tensor(tensor, block_shape, layout)

    a_desc = descriptor(a_RM, [BLOCK_K, BLOCK_M])
    b_desc = descriptor(b_RN, [BLOCK_K, block_n])
    store_tma = _stores_through_tma(a_RM, out_EMN)
    c_desc = descriptor(out_EMN.view(num_experts * size_m, size_n), [BLOCK_M, block_n]) if store_tma else None
    tiles = num_experts * (size_m // BLOCK_M) * triton.cdiv(size_n, block_n)
    num_programs = min(tiles, persistent_programs(a_RM.device))
    _weight_gradient_kernel[(num_programs,)](
        a_desc,
        b_desc,
        c_desc,
        out_EMN,
        group_end_E,
        num_experts,
        size_m,
        size_n,
        num_programs,
        STORE_TMA=store_tma,
        GROUP_M=GROUP_M,
        STAGES=STAGES if store_tma else STAGES_WITHOUT_STAGING,
        num_warps=NUM_WARPS,
    )
