"""Tile scheduling inside the grouped GEMM kernels (``@triton.jit`` helpers)."""

import triton
import triton.language as tl


@triton.jit
def locate_row_tile(
    m_tile,
    group_end_ptr,
    num_experts,
    num_rows,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Map a row-tile index to (expert, first row, end row) over expert-contiguous segments.

    ``group_end_ptr[e]`` is the exclusive end row of expert e (an inclusive cumsum of the
    counts). Tiles after the last expert's tiles cover the trailing unassigned rows
    [group_end[E-1], num_rows) and report expert == num_experts; tiles past those get an
    empty row range.
    """
    expert_idx = tl.arange(0, BLOCK_E)
    in_range = expert_idx < num_experts
    ends = tl.load(group_end_ptr + expert_idx, mask=in_range, other=0)
    starts = tl.load(group_end_ptr + expert_idx - 1, mask=in_range & (expert_idx > 0), other=0)
    tiles = tl.where(in_range, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_ends <= m_tile).to(tl.int32), 0)
    is_expert = expert_idx == expert
    first_tile = tl.sum(tl.where(is_expert, tile_ends - tiles, 0), 0)
    seg_start = tl.sum(tl.where(is_expert, starts, 0), 0)
    seg_end = tl.sum(tl.where(is_expert, ends, 0), 0)
    past_experts = expert >= num_experts
    last_end = tl.sum(tl.where(expert_idx == num_experts - 1, ends, 0), 0)
    first_tile = tl.where(past_experts, tl.sum(tiles, 0), first_tile)
    seg_start = tl.where(past_experts, last_end, seg_start)
    seg_end = tl.where(past_experts, num_rows, seg_end)
    row_start = seg_start + (m_tile - first_tile) * BLOCK_M
    return expert, row_start, seg_end


@triton.jit
def swizzle_tile(pid, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """Group GROUP_M row tiles per column sweep so neighbouring programs share operands in L2."""
    tiles_per_group = GROUP_M * num_n_tiles
    group = pid // tiles_per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m_tiles - first_m, GROUP_M)
    m_tile = first_m + (pid % tiles_per_group) % group_size
    n_tile = (pid % tiles_per_group) // group_size
    return m_tile, n_tile
