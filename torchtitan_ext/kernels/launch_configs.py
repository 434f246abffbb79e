"""How the Triton kernels are launched: the configs they try (listed best first), the choice of one
per shape, TMA tensor descriptors, and block sizes of the row kernels."""

from __future__ import annotations

import functools

import torch
import triton

from torchtitan_ext.kernels.availability import cuda_properties, interpreter_enabled

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


def gemm_configs(configs: list[tuple[int, int, int, int, int]], pre_hook=None) -> list[triton.Config]:
    """Kernel configs from (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tuples.

    Under the interpreter a single small config keeps CPU tests fast. ``pre_hook`` runs on
    the launch arguments of the chosen config before each launch.
    """
    if interpreter_enabled():
        configs = [(16, 16, 16, 1, 1)]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages, pre_hook=pre_hook
        )
        for bm, bn, bk, warps, stages in configs
    ]


def tensor_descriptors_usable(*tensors: torch.Tensor) -> bool:
    """Whether these row-major tensors can be read through TMA tensor descriptors.

    Needs a Hopper or newer GPU (or the interpreter), a Triton with host tensor descriptors,
    no empty dimension, a contiguous last dimension, and 16-byte aligned base pointers and
    outer strides.
    """
    if TensorDescriptor is None:
        return False
    on_hopper = all(t.is_cuda for t in tensors) and cuda_properties(tensors[0].get_device()).major >= 9
    if not (interpreter_enabled() or on_hopper):
        return False
    return all(
        t.dim() >= 2
        and min(t.shape) > 0
        and t.stride(-1) == 1
        and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
        and t.data_ptr() % 16 == 0
        for t in tensors
    )


def tensor_descriptors(*tensors: torch.Tensor) -> tuple[bool, list]:
    """``(usable, descriptors)``: when ``tensor_descriptors_usable``, one descriptor per tensor (its
    block shape set per config by a ``descriptor_blocks`` pre-hook), else a None per tensor."""
    if TensorDescriptor is None or not tensor_descriptors_usable(*tensors):
        return False, [None] * len(tensors)
    return True, [TensorDescriptor.from_tensor(t, [1] * t.dim()) for t in tensors]


def descriptor_blocks(**block_shapes: tuple[int | str, ...]):
    """Config pre-hook: give each named descriptor argument its block shape, whose entries are
    sizes or the names of the config's block sizes (e.g. ``a_desc=("BLOCK_K", "BLOCK_M")``).
    Descriptor arguments passed as None (no TMA) are left alone."""

    def set_blocks(args: dict) -> None:
        for name, shape in block_shapes.items():
            if args[name] is not None:
                args[name].block_shape = [args[entry] if isinstance(entry, str) else entry for entry in shape]

    return set_blocks


def _block_cap(size: int) -> int:
    """Largest tile worth trying along a dimension of ``size``: its next power of 2, at least 16."""
    return max(16, triton.next_power_of_2(max(1, size)))


def _shared_memory_bytes(config: triton.Config, a_tiles: int, b_tiles: int, element_size: int) -> int:
    """Shared memory of ``a_tiles`` [M, K] and ``b_tiles`` [K, N] tiles over the pipeline's stages."""
    block = config.kwargs
    tile = a_tiles * block["BLOCK_M"] * block["BLOCK_K"] + b_tiles * block["BLOCK_K"] * block["BLOCK_N"]
    return tile * element_size * max(1, config.num_stages)


def _shared_memory_limit() -> int:
    if torch.cuda.is_available():
        properties = cuda_properties(torch.cuda.current_device())
        # pyrefly: ignore[missing-attribute]  # torch's stub of _CudaDeviceProperties lacks it
        return properties.shared_memory_per_block_optin
    return 227 * 1024


def fit_to_shape(m: str | None, n: str | None, k: str | None, a_tiles: int = 1, b_tiles: int = 1):
    """The config choice of a GEMM kernel whose M/N/K sizes are the named kernel arguments
    (None: the row count, which varies), reading ``a_tiles`` A and ``b_tiles`` B operands per stage:
    ``fit(configs, named_args, element_size) -> config``.

    Configs are listed best first; this keeps the first one whose tiles are no larger than
    their dimensions need and whose pipeline fits in shared memory for the operands' element
    size (the smallest config when none fits): the same choice on every run.
    """

    def fit(configs, named_args, element_size):
        caps = {
            block: _block_cap(named_args[arg])
            for block, arg in (("BLOCK_M", m), ("BLOCK_N", n), ("BLOCK_K", k))
            if arg is not None
        }
        limit = _shared_memory_limit()
        fitting = (
            config
            for config in configs
            if all(config.kwargs[block] <= cap for block, cap in caps.items())
            and _shared_memory_bytes(config, a_tiles, b_tiles, element_size) <= limit
        )
        first = next(fitting, None)
        if first is None:
            first = min(configs, key=lambda c: _shared_memory_bytes(c, a_tiles, b_tiles, element_size))
        return first

    return fit


def tuned(configs: list[triton.Config], key: list[str]):
    """``triton.autotune`` over ``configs``, per value of the ``key`` arguments: every config is
    benchmarked on first use. The choice persists in Triton's on-disk cache
    (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), keyed by the kernel source, the ``key``
    arguments and the dtypes."""
    return triton.autotune(configs=configs, key=key, cache_results=True)


class FittedKernel:
    """A ``@triton.jit`` kernel launched with one config per shape, chosen without benchmarking.

    ``fit`` (a ``fit_to_shape``) picks the config once per value of the ``key`` arguments and
    the operands' element size; ``divides`` maps constexpr flags to (size argument, block size)
    pairs, each flag true when the size is a multiple of the chosen block (``EVEN_K`` skips load
    masks); the config's ``pre_hook`` runs on the named arguments before every launch. Launch as
    ``kernel[grid](*args, **constexprs)``, ``grid`` a tuple or a function of the named arguments.

    This is what ``triton.autotune`` with a one-config prune plus ``triton.heuristics`` would do,
    without their per-launch rebuilding of argument dicts and keys: for kernels of a few hundred
    microseconds that host time adds up.
    """

    def __init__(self, kernel, configs: list[triton.Config], key: list[str], fit, divides: dict | None = None):
        self.fn = kernel
        self._arg_names = kernel.arg_names
        self._configs = configs
        self._key = key
        self._fit = fit
        self._divides = divides or {}
        self._chosen: dict[tuple, triton.Config] = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **constexprs):
        named = dict(zip(self._arg_names, args))
        named.update(constexprs)
        element_size = _operand_element_size(args)
        choice = (*(named[name] for name in self._key), element_size)
        config = self._chosen.get(choice)
        if config is None:
            config = self._fit(self._configs, named, element_size)
            self._chosen[choice] = config
        named.update(config.kwargs)
        for flag, (size, block) in self._divides.items():
            constexprs[flag] = named[size] % named[block] == 0
        if config.pre_hook is not None:
            config.pre_hook(named)
        self.fn[grid](*args, **constexprs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def fitted(configs: list[triton.Config], key: list[str], fit, divides: dict | None = None):
    """Decorator: the ``@triton.jit`` kernel below as a :class:`FittedKernel`."""
    return lambda kernel: FittedKernel(kernel, configs, key, fit, divides)


def _operand_element_size(args) -> int:
    """Bytes per element of the first floating-point tensor argument (2 when there is none)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return arg.element_size()
    return 2


# Hopper (H100/H200), bf16/fp16: wgmma-sized tiles, cp.async pipelines. Each list is ordered by
# the kernel's time inside a whole MoE layer forward+backward on an H100 at the Qwen3-30B-A3B,
# DeepSeek-V2-Lite and Mixtral-8x7B shapes (the first entry was fastest at all three); later
# entries serve smaller dimensions and GPUs with less shared memory.
PLAIN_GEMM_CONFIGS = [
    (128, 256, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
]
"""One accumulator fed by one A and one B tile per step: the down projection forward, d h = d y @ w2,
and d x = d gate @ w1 + d up @ w3 (two K loops in sequence)."""
FP8_GEMM_CONFIGS = [
    (128, 256, 128, 8, 3),
    (128, 128, 128, 8, 4),
    (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
]
"""The FP8 grouped GEMM (``fp8_grouped_gemm``), e4m3 operands: ``PLAIN_GEMM_CONFIGS``' tiles with twice
the K step, the same bytes per pipeline stage. On an H200 the first was the fastest, or within 2% of it,
at 9 of the 12 GEMMs of the Qwen3-30B-A3B, OLMoE-1B-7B and Mixtral-8x7B layers against 7 other configs
(4 stages: up to 10% faster where K <= 1024, 17% slower at Mixtral's gate and up input gradient)."""
GATE_UP_FORWARD_CONFIGS = [
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
]
WEIGHT_GRADIENT_CONFIGS = [
    (128, 256, 32, 8, 5),
    (128, 128, 64, 8, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
]
"""Per-expert A^T @ B of the weight gradients (persistent, TMA loads on Hopper). The first entry was
the fastest, or within 3% of it, for dW2 and dW1 alone on an H100 at all four benchmark shapes
(against 128x128 and 256x128 tiles, 3-5 stages, and one program per tile instead of one per SM)."""


def num_row_tiles_upper_bound(num_rows: int, num_experts: int, block_m: int) -> int:
    """Row tiles that cover every expert segment plus a trailing segment of unassigned rows.

    Each segment wastes at most one partial tile, so this bound holds for any counts and
    sizes the grid without reading the counts on the host; programs past the real tiles exit.
    """
    return triton.cdiv(num_rows, block_m) + min(num_experts, num_rows) + 1


def block_experts(num_experts: int) -> int:
    return max(2, triton.next_power_of_2(num_experts))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full fp32 products; 16-bit inputs use the tensor cores' native path."""
    return "ieee" if dtype == torch.float32 else "tf32"


def row_block_d(dim: int) -> int:
    """Columns a row kernel handles per step: the row, up to 1024."""
    return min(1024, triton.next_power_of_2(dim))


def permute_block_d(dim: int) -> int:
    """Columns the token permute copies per step: the row, up to 2048 (fastest on an H100 for
    D = 2048 and 4096 against 1024-column steps and several rows per program)."""
    return min(2048, triton.next_power_of_2(dim))


def row_copy_configs(configs: list[tuple[int, int, int]]) -> list[triton.Config]:
    """Autotune configs of row-copy kernels from (ROWS, BLOCK_D, num_warps) tuples.

    Under the interpreter a single small config keeps CPU tests fast.
    """
    if interpreter_enabled():
        configs = [(4, 16, 1)]
    return [triton.Config({"ROWS": rows, "BLOCK_D": block_d}, num_warps=warps) for rows, block_d, warps in configs]


# Rows moved between GPUs (NVLink loads or stores): enough bytes in flight per SM.
ROW_COPY_CONFIGS = [(4, 1024, 4), (8, 1024, 8), (16, 1024, 8), (8, 512, 4), (16, 512, 4), (32, 256, 4)]
