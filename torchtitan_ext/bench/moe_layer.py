"""Benchmark one whole MoE layer (router + dispatch + experts + combine) per compute backend
against stock torchtitan 0.3.0's MoE layer, on one device, in one process.

    python -m torchtitan_ext.bench layer --json layer.json
    python -m torchtitan_ext.bench layer --tiny          # CPU smoke run

Both layers get the same weights and inputs, ``(B, L, D) = (2, 4096, D)`` in bf16 on a GPU.
Skewed routing adds the same expert bias (a linear ramp, calibrated to max/mean load about
3.5) to both layers' routers, so they route alike. Reported: forward and forward+backward
ms, speed-up over stock, the output's error vs stock and, on a GPU, expert-equivalent
TFLOP/s (6*N*D*F / 18*N*D*F), peak memory of forward+backward above the weights
(activation memory) and the host time to issue one forward+backward (``host_issue_ms``: where
it reaches the forward+backward ms, the GPU waited on the host).
"""

from functools import partial

import torch

from torchtitan_ext.bench import common
from torchtitan_ext.experiments.moe_backends.expert_timing import (
    BenchShape,
    Timer,
    host_issue_ms,
    seeded_generator,
)
from torchtitan_ext.experiments.moe_backends.experts import BACKENDS, DEFAULT_BACKEND
from torchtitan_ext.experiments.moe_backends.layer import (
    moe_layer_config,
    stock_moe_config,
)

STOCK = "torchtitan"
TARGET_MAX_OVER_MEAN = 3.5


def build(kind: str, shape: BenchShape, device, dtype) -> torch.nn.Module:
    config = (
        stock_moe_config(**shape.layer_kwargs())
        if kind == STOCK
        else moe_layer_config(compute_backend=kind, **shape.layer_kwargs())
    )
    with torch.device(device):
        layer = config.build()
    return layer.to(dtype).train()


def routed_counts(stock_layer, x_BLD: torch.Tensor) -> torch.Tensor:
    """(E,) routed rows per expert under the stock layer's router."""
    with torch.no_grad():
        _, ids_BLK, _ = stock_layer.router(x_BLD, stock_layer.expert_bias_E)
    return torch.bincount(ids_BLK.reshape(-1), minlength=stock_layer.expert_bias_E.numel())


def calibrate_skew(stock_layer, x_BLD: torch.Tensor, target: float) -> torch.Tensor:
    """Expert bias ``ramp * linspace(1, 0, E)`` whose routing has max/mean load near ``target``."""
    layer = stock_layer
    num_experts = layer.expert_bias_E.numel()
    ramp_E = torch.linspace(1, 0, num_experts, device=x_BLD.device)
    low, high = 0.0, 1.0
    for _ in range(24):
        middle = (low + high) / 2
        layer.expert_bias_E.copy_(middle * ramp_E)
        if common.max_over_mean(routed_counts(layer, x_BLD)) < target:
            low = middle
        else:
            high = middle
    return high * ramp_E


def bench_shape(
    shape: BenchShape, skew: float, kinds, timer, device, dtype, batch: int, profile_top: int = 0, rounds: int = 1
) -> list[dict]:
    """One row per layer kind (stock first), with the medians of ``rounds`` rounds of timings in
    which the layers take turns (``common.time_in_rounds``)."""
    seq_len = shape.tokens // batch
    generator = seeded_generator(device)
    x_BLD = torch.randn(batch, seq_len, shape.dim, device=device, dtype=dtype, generator=generator)
    stock = build(STOCK, shape, device, dtype)
    with torch.no_grad():
        for param in stock.parameters():
            param.normal_(std=0.02, generator=generator)
    bias_E = calibrate_skew(stock, x_BLD, TARGET_MAX_OVER_MEAN) if skew else torch.zeros_like(stock.expert_bias_E)
    stock.expert_bias_E.copy_(bias_E)
    counts_E = routed_counts(stock, x_BLD)
    x_BLD.requires_grad_()
    grad_BLD = torch.randn(x_BLD.shape, device=device, dtype=dtype, generator=generator)
    with torch.no_grad():
        reference = stock(x_BLD)

    layers = {}
    for kind in kinds:
        layer = stock if kind == STOCK else build(kind, shape, device, dtype)
        if layer is not stock:
            layer.load_state_dict(stock.state_dict())
            layer.expert_bias_E.copy_(bias_E)
        layers[kind] = layer

    def forward_backward(layer):
        return lambda: torch.autograd.backward(layer(x_BLD), grad_BLD)

    calls = {
        kind: (lambda layer=layer: layer(x_BLD), forward_backward(layer), [x_BLD, *layer.parameters()])
        for kind, layer in layers.items()
    }
    times = common.time_in_rounds(calls, timer, rounds, label=f"  MoE layer     {shape.name:18s} skew {skew}")

    rows = []
    for kind, layer in layers.items():
        with torch.no_grad():
            error = common.relative_error(layer(x_BLD), reference)
        _, peak_mb = common.memory_mb(partial(layer, x_BLD), grad_BLD, device)
        kernels = (
            common.kernel_profile(forward_backward(layer), device, profile_top, grad_to_none=calls[kind][2])
            if profile_top
            else None
        )
        host_ms = round(host_issue_ms(forward_backward(layer), calls[kind][2]), 3) if device.type == "cuda" else None
        for tensor in calls[kind][2]:
            tensor.grad = None
        rows.append(
            common.timed_row(shape, skew, counts_E, times[kind], device)
            | {
                "layer": kind,
                "fwdbwd_peak_mb": peak_mb,
                "rel_err_vs_stock": f"{error:.1e}",
                **({"fwdbwd_host_ms": host_ms} if host_ms is not None else {}),
                **({"kernels": kernels} if kernels else {}),
            }
        )
    del layers, stock
    if device.type == "cuda":
        torch.cuda.empty_cache()
    stock_row = rows[0]
    for row in rows:
        row["fwd_speedup"] = round(stock_row["fwd_ms"] / row["fwd_ms"], 2)
        row["fwdbwd_speedup"] = round(stock_row["fwdbwd_ms"] / row["fwdbwd_ms"], 2)
    return rows


BACKEND_OF_KIND = {STOCK: DEFAULT_BACKEND, **{name: name for name in BACKENDS}}
"""Layers measured, torchtitan's own first, then one per compute backend, and the compute backend
each runs (torchtitan's experts: ``torch._grouped_mm``, the default backend's op)."""
KINDS = tuple(BACKEND_OF_KIND)


def default_kinds() -> list[str]:
    """Every layer that can run here."""
    return common.runnable(KINDS, BACKEND_OF_KIND)


TABLE = [
    ("shape", "shape"),
    ("skew", "skew"),
    ("max_over_mean", "max/mean"),
    ("layer", "layer"),
    ("fwd_ms", "fwd ms"),
    ("fwdbwd_ms", "fwd+bwd ms"),
    ("fwdbwd_host_ms", "host ms"),
    ("fwdbwd_tflops", "fwd+bwd TF/s"),
    ("fwd_speedup", "fwd x"),
    ("fwdbwd_speedup", "fwd+bwd x"),
    ("fwdbwd_peak_mb", "peak MB"),
    ("rel_err_vs_stock", "err vs stock"),
]


def run(
    shapes,
    kinds,
    device,
    dtype,
    batch: int,
    command: str,
    out: str | None = None,
    skews=common.SKEWS,
    profile_top: int = 0,
    rounds: int = 1,
) -> dict:
    """Measure every shape and skew (``common.measure_shapes``). ``profile_top > 0``
    adds each layer's slowest kernels in one forward+backward to its row (``kernels``);
    ``rounds`` is ``bench_shape``'s.

    Raises ``ConfigError`` for full-size shapes on CPU.
    """

    def measure(shape: BenchShape, skew: float, timer: Timer) -> list[dict]:
        return bench_shape(shape, skew, kinds, timer, device, dtype, batch, profile_top, rounds)

    return common.measure_shapes(
        "layer", shapes, skews, device, measure, common.environment(command, device, dtype), out
    )
