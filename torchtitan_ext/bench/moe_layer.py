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

Compiled variants (``compiled_kinds``) are the same layer objects under ``torch.compile`` as
torchtitan compiles a block (``common.compile_like_torchtitan``), timed in the same rounds as the
eager ones. Each is compiled by its first forward+backward, before any timing, and that call's
seconds are reported apart (``first_call_s``). Speed-ups are reported against stock eager and,
where measured, stock compiled.
"""

import importlib.util
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
from torchtitan.models.common.moe import MoE

from torchtitan_ext.bench import common
from torchtitan_ext.experiments.moe_backends.expert_timing import (
    BenchShape,
    Timer,
    host_issue_ms,
    seeded_generator,
)
from torchtitan_ext.experiments.moe_backends.experts import BACKENDS, DEFAULT_BACKEND, fp8_backends
from torchtitan_ext.experiments.moe_backends.fp8_experts import ExpertPrecision, fp8_gemms_unavailable_reason
from torchtitan_ext.experiments.moe_backends.layer import (
    moe_layer_config,
    stock_moe_config,
    with_expert_precision,
)

STOCK = "torchtitan"
TARGET_MAX_OVER_MEAN = 3.5


def build(kind: str, shape: BenchShape, device, dtype) -> torch.nn.Module:
    if kind == STOCK:
        config = stock_moe_config(**shape.layer_kwargs())
    elif kind == STOCK_FP8:
        config = torchtitan_float8_experts(stock_moe_config(**shape.layer_kwargs()))
    else:
        config = with_expert_precision(
            moe_layer_config(compute_backend=BACKEND_OF_KIND[kind], **shape.layer_kwargs()),
            PRECISION_OF_KIND.get(kind, "native"),
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


class Variant(NamedTuple):
    """One measured layer: its kind (``STOCK`` or a compute backend) and whether it is compiled."""

    kind: str
    compiled: bool

    @property
    def name(self) -> str:
        return common.variant_name(self.kind, self.compiled)


def variants(kinds: Sequence[str], compiled_kinds: Sequence[str], modes: Sequence[bool]) -> list[Variant]:
    """What ``bench_shape`` measures, in order: stock eager (always: the reference of the errors and
    of the eager speed-ups), the eager ``kinds`` when ``modes`` has eager, then stock compiled and the
    ``compiled_kinds`` when it has compiled."""
    eager = [STOCK, *(kind for kind in kinds if kind != STOCK)] if False in modes else [STOCK]
    compiled = [STOCK, *(kind for kind in compiled_kinds if kind != STOCK)] if True in modes else []
    return [Variant(kind, False) for kind in eager] + [Variant(kind, True) for kind in compiled]


def bench_shape(
    shape: BenchShape,
    skew: float,
    measured: Sequence[Variant],
    timer,
    device,
    dtype,
    batch: int,
    profile_top: int = 0,
    rounds: int = 1,
    compile_backend: str = "inductor",
) -> list[dict]:
    """One row per variant (``measured``, stock eager first), with the medians of ``rounds`` rounds
    of timings in which the variants take turns (``common.time_in_rounds``). A compiled variant
    whose compilation fails gets a row with the error and no timings."""
    seq_len = shape.tokens // batch
    generator = seeded_generator(device)
    x_BLD = torch.randn(batch, seq_len, shape.dim, device=device, dtype=dtype, generator=generator)
    stock = build(STOCK, shape, device, dtype)
    with torch.no_grad():
        for param in stock.parameters():
            param.normal_(std=0.02, generator=generator)
    stock_bias_E = stock.get_buffer("expert_bias_E")
    bias_E = calibrate_skew(stock, x_BLD, TARGET_MAX_OVER_MEAN) if skew else torch.zeros_like(stock_bias_E)
    stock_bias_E.copy_(bias_E)
    counts_E = routed_counts(stock, x_BLD)
    x_BLD.requires_grad_()
    grad_BLD = torch.randn(x_BLD.shape, device=device, dtype=dtype, generator=generator)
    with torch.no_grad():
        reference = stock(x_BLD)

    layers = {}
    for kind in dict.fromkeys(variant.kind for variant in measured):
        layer = stock if kind == STOCK else build(kind, shape, device, dtype)
        if layer is not stock:
            layer.load_state_dict(stock.state_dict())
            layer.get_buffer("expert_bias_E").copy_(bias_E)
        layers[kind] = layer
    runs = {
        variant: common.compile_like_torchtitan(layers[variant.kind], compile_backend)
        if variant.compiled
        else layers[variant.kind]
        for variant in measured
    }

    def forward(layer: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: layer(x_BLD)

    def forward_backward(layer: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        return lambda: torch.autograd.backward(layer(x_BLD), grad_BLD)

    label = f"  MoE layer     {shape.name:18s} {common.skew_name(skew)}"
    first_call, failed = {}, {}
    for variant, layer in runs.items():
        if variant.compiled:
            common.progress(f"{label}  compile (first forward+backward): {variant.name}")
        try:
            first_call[variant] = common.first_call_s(forward_backward(layer), device)
        except Exception as error:
            if not variant.compiled:
                raise
            failed[variant] = common.compile_failure(error)
            common.progress(f"{label}  {variant.name}: {failed[variant]}")
        for tensor in [x_BLD, *layers[variant.kind].parameters()]:
            tensor.grad = None
    calls: common.TimedCalls = {
        variant.name: (forward(layer), forward_backward(layer), [x_BLD, *layers[variant.kind].parameters()])
        for variant, layer in runs.items()
        if variant not in failed
    }
    times = common.time_in_rounds(calls, timer, rounds, label=label)

    rows = []
    for variant, layer in runs.items():
        identity = {"layer": variant.kind, "compiled": variant.compiled}
        if variant in failed:
            where = {"shape": shape.name, "skew": skew, "max_over_mean": common.max_over_mean(counts_E)}
            rows.append(where | identity | {"fwd_ms": None, "fwdbwd_ms": None, "error": failed[variant]})
            continue
        grad_to_none = calls[variant.name][2]
        error = common.relative_error(layer(x_BLD).detach(), reference)  # with grad: the graph that was timed
        _, peak_mb = common.memory_mb(partial(layer, x_BLD), grad_BLD, device)
        kernels = (
            common.kernel_profile(forward_backward(layer), device, profile_top, grad_to_none=grad_to_none)
            if profile_top
            else None
        )
        host_ms = round(host_issue_ms(forward_backward(layer), grad_to_none), 3) if device.type == "cuda" else None
        for tensor in grad_to_none:
            tensor.grad = None
        rows.append(
            common.timed_row(shape, skew, counts_E, times[variant.name], device)
            | identity
            | {
                "fwdbwd_peak_mb": peak_mb,
                "rel_err_vs_stock": f"{error:.1e}",
                "first_call_s": first_call[variant],
                **({"fwdbwd_host_ms": host_ms} if host_ms is not None else {}),
                **({"kernels": kernels} if kernels else {}),
            }
        )
    del layers, runs, stock
    if device.type == "cuda":
        torch.cuda.empty_cache()
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Each row's forward and forward+backward speed-ups over stock eager (``fwd_speedup``,
    ``fwdbwd_speedup``) and over stock compiled (``..._vs_stock_compiled``; None where stock
    compiled was not measured or failed)."""
    stock = {row["compiled"]: row for row in rows if row["layer"] == STOCK}
    for row in rows:
        for key in ("fwd", "fwdbwd"):
            row[f"{key}_speedup"] = common.speedup(stock[False][f"{key}_ms"], row[f"{key}_ms"])
            compiled_ms = stock[True][f"{key}_ms"] if True in stock else None
            row[f"{key}_speedup_vs_stock_compiled"] = common.speedup(compiled_ms, row[f"{key}_ms"])


STOCK_FP8 = "torchtitan_fp8"
"""torchtitan's own MoE layer with its float8 rowwise experts (``Float8GroupedExpertsConverter``,
computed by torchao): the stock counterpart of the FP8 layers."""


def torchtitan_float8_experts(config: MoE.Config) -> MoE.Config:
    """``config`` converted by torchtitan's ``Float8GroupedExpertsConverter`` (its constructor needs torchao
    and a GPU of compute capability 8.9+)."""
    from torchtitan.components.quantization.float8 import Float8GroupedExpertsConverter

    converted = Float8GroupedExpertsConverter.Config(model_compile_enabled=True).build().convert(config)
    if not isinstance(converted, MoE.Config):
        raise TypeError(f"the float8 converter returned {type(converted).__qualname__}, not an MoE config")
    return converted


def torchao_missing_reason() -> str | None:
    """Why torchtitan's float8 experts cannot run here for want of torchao (None: it is installed)."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed: torchtitan's float8 experts compute through it (pip install torchao)"
    return None


PRECISION_OF_KIND: dict[str, ExpertPrecision] = {f"{name}_fp8": "fp8_rowwise" for name in fp8_backends()}
"""The FP8 layers: a compute backend with FP8 rowwise expert GEMMs (``moe.expert_precision``)."""
BACKEND_OF_KIND = {
    STOCK: DEFAULT_BACKEND,
    **{name: name for name in BACKENDS},
    **{kind: kind.removesuffix("_fp8") for kind in PRECISION_OF_KIND},
    STOCK_FP8: DEFAULT_BACKEND,
}
"""Layers measured, torchtitan's own first, then one per compute backend, one per FP8 backend and
torchtitan's own with float8 experts, and the compute backend each runs (torchtitan's experts:
``torch._grouped_mm``, the default backend's op)."""
KINDS = tuple(BACKEND_OF_KIND)
NEEDS_OF_KIND: common.Needs = {
    **dict.fromkeys(PRECISION_OF_KIND, fp8_gemms_unavailable_reason),
    STOCK_FP8: lambda: torchao_missing_reason() or fp8_gemms_unavailable_reason(),
}
"""What the FP8 layers need besides their compute backend: FP8 GEMMs here (a CUDA GPU of compute
capability 9.0 or newer), and torchao for torchtitan's."""


COMPILED_BY_DEFAULT = (STOCK, "grouped_mm", "triton", *PRECISION_OF_KIND, STOCK_FP8)
"""The layers given a compiled variant unless others are named: stock torchtitan's (the baseline of
every claim) and the backends that are fast compiled. ``for_loop`` and ``batched_mm_padded`` trace
too (data-dependent sizes as unbacked symbols) but are slow, and Inductor may refuse them: they
get a compiled variant only when named."""


def default_kinds() -> list[str]:
    """Every layer that can run here."""
    return common.runnable(KINDS, BACKEND_OF_KIND, NEEDS_OF_KIND)


def default_compiled_kinds(kinds: Sequence[str]) -> list[str]:
    """The ``kinds`` given a compiled variant by default (``COMPILED_BY_DEFAULT``)."""
    return [kind for kind in kinds if kind in COMPILED_BY_DEFAULT]


TABLE = [
    ("shape", "shape"),
    ("skew", "skew"),
    ("max_over_mean", "max/mean"),
    ("layer", "layer"),
    ("compiled", "compiled"),
    ("fwd_ms", "fwd ms"),
    ("fwdbwd_ms", "fwd+bwd ms"),
    ("fwdbwd_host_ms", "host ms"),
    ("fwdbwd_tflops", "fwd+bwd TF/s"),
    ("fwd_speedup", "fwd x stock"),
    ("fwdbwd_speedup", "fwd+bwd x stock"),
    ("fwd_speedup_vs_stock_compiled", "fwd x stock compiled"),
    ("fwdbwd_speedup_vs_stock_compiled", "fwd+bwd x stock compiled"),
    ("fwdbwd_peak_mb", "peak MB"),
    ("rel_err_vs_stock", "err vs stock"),
    ("first_call_s", "1st call s"),
    ("error", "error"),
]


def run(
    shapes,
    measured: Sequence[Variant],
    device,
    dtype,
    batch: int,
    command: str,
    out: str | None = None,
    skews=common.SKEWS,
    profile_top: int = 0,
    rounds: int = 1,
    compile_backend: str = "inductor",
) -> dict:
    """Measure every shape and skew (``common.measure_shapes``). ``profile_top > 0``
    adds each layer's slowest kernels in one forward+backward to its row (``kernels``);
    ``rounds`` and ``compile_backend`` are ``bench_shape``'s. Compiled code is dropped when the
    shape changes (``torch._dynamo.reset``), kept across the skews of one shape: the same graphs.

    Raises ``ConfigError`` for full-size shapes on CPU.
    """
    compiles = any(variant.compiled for variant in measured)

    def measure(shape: BenchShape, skew: float, timer: Timer) -> list[dict]:
        if compiles and skew == skews[0]:
            torch._dynamo.reset()
        return bench_shape(shape, skew, measured, timer, device, dtype, batch, profile_top, rounds, compile_backend)

    meta = common.environment(command, device, dtype) | ({"compile_backend": compile_backend} if compiles else {})
    return common.measure_shapes("layer", shapes, skews, device, measure, meta, out)
