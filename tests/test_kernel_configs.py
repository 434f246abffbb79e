"""The GEMM kernels' config choice: configs are listed best first, and the first one whose
tiles fit the shape and whose pipeline fits in shared memory is taken."""

from typing import ClassVar

import torch
import triton

from torchtitan_ext.kernels.launch_configs import (
    GATE_UP_FORWARD_CONFIGS,
    PLAIN_GEMM_CONFIGS,
    WEIGHT_GRADIENT_CONFIGS,
    FittedKernel,
    fit_to_shape,
)


def config(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


def choose(configs, *, dim, hidden, dtype=torch.bfloat16, **operands):
    fit = fit_to_shape(m=None, n="hidden", k="dim", **operands)
    return fit([config(*c) for c in configs], {"dim": dim, "hidden": hidden}, dtype.itemsize)


def blocks(chosen):
    return (
        chosen.kwargs["BLOCK_M"],
        chosen.kwargs["BLOCK_N"],
        chosen.kwargs["BLOCK_K"],
        chosen.num_warps,
        chosen.num_stages,
    )


def test_full_size_shapes_take_the_first_config():
    assert blocks(choose(PLAIN_GEMM_CONFIGS, dim=2048, hidden=768)) == PLAIN_GEMM_CONFIGS[0]


def test_tiles_larger_than_the_dimension_are_skipped():
    assert blocks(choose(PLAIN_GEMM_CONFIGS, dim=2048, hidden=100)) == (128, 128, 64, 8, 4)
    assert blocks(choose(PLAIN_GEMM_CONFIGS, dim=40, hidden=40)) == (64, 64, 64, 4, 4)


def test_pipelines_over_the_shared_memory_limit_are_skipped():
    # fp32 operands double the bytes of every stage: only the 3-stage 128x128 pipeline still fits.
    assert blocks(choose(PLAIN_GEMM_CONFIGS, dim=2048, hidden=768, dtype=torch.float32)) == (128, 128, 64, 4, 3)
    # Two B operands per stage (gate and up share the x tile).
    assert blocks(choose(GATE_UP_FORWARD_CONFIGS, dim=2048, hidden=768, b_tiles=2)) == GATE_UP_FORWARD_CONFIGS[0]


def test_smallest_config_when_none_fits():
    huge = [(256, 256, 256, 8, 8), (256, 256, 128, 8, 8)]
    assert blocks(choose(huge, dim=4096, hidden=4096)) == (256, 256, 128, 8, 8)


def test_every_listed_first_choice_fits_hopper_shared_memory():
    hopper_limit = 227 * 1024
    for configs, a_tiles, b_tiles in (
        (PLAIN_GEMM_CONFIGS, 1, 1),
        (GATE_UP_FORWARD_CONFIGS, 1, 2),
        (WEIGHT_GRADIENT_CONFIGS, 1, 1),
    ):
        bm, bn, bk, _, stages = configs[0]
        assert (a_tiles * bm * bk + b_tiles * bk * bn) * 2 * stages <= hopper_limit


class RecordingKernel:
    """Stands in for a ``@triton.jit`` kernel: records each launch's grid, arguments and options."""

    arg_names: ClassVar[list[str]] = ["x_ptr", "dim", "hidden", "USE_TMA", "EVEN_K", "BLOCK_M", "BLOCK_N", "BLOCK_K"]

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_fitted_kernel_chooses_once_per_shape_and_sets_the_divisibility_flags():
    fits, hooked = [], []
    rule = fit_to_shape(m=None, n="hidden", k="dim")

    def counting_fit(configs, named_args, element_size):
        fits.append((named_args["dim"], named_args["hidden"], element_size))
        return rule(configs, named_args, element_size)

    configs = [
        triton.Config(
            {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64},
            num_warps=8,
            num_stages=4,
            pre_hook=lambda named: hooked.append((named["BLOCK_N"], named["dim"])),
        ),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    ]
    recorder = RecordingKernel()
    kernel = FittedKernel(
        recorder, configs, key=["dim", "hidden", "USE_TMA"], fit=counting_fit, divides={"EVEN_K": ("dim", "BLOCK_K")}
    )
    x = torch.empty(4, dtype=torch.bfloat16)

    kernel[(7,)](x, 2048, 768, USE_TMA=True)
    kernel[(7,)](x, 2048, 768, USE_TMA=True)
    kernel[(3,)](x, 40, 40, USE_TMA=True)
    kernel[(3,)](x.float(), 2048, 768, USE_TMA=True)

    assert fits == [(2048, 768, 2), (40, 40, 2), (2048, 768, 4)]
    grid, args, options = recorder.launches[0]
    assert grid == (7,) and args == (x, 2048, 768)
    assert options == {
        "USE_TMA": True,
        "EVEN_K": True,
        "BLOCK_M": 128,
        "BLOCK_N": 256,
        "BLOCK_K": 64,
        "num_warps": 8,
        "num_stages": 4,
    }
    _, _, small = recorder.launches[2]
    assert (small["BLOCK_K"], small["EVEN_K"], small["num_warps"]) == (64, False, 4)
    _, _, fp32 = recorder.launches[3]
    assert fp32["BLOCK_N"] == 64  # the 128x256 pipeline does not fit in shared memory at 4 bytes
    assert hooked == [(256, 2048), (256, 2048)]  # only the config that has a pre-hook runs one
