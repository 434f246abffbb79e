"""Benchmark the SwiGLU expert block (3 GEMMs) of every compute backend on one device.

Implementations, timed in one process so that ratios compare like with like:

- every ``compute_backend`` of the backend table on rows already grouped by expert: the
  expert block alone (errors against the default backend);
- ``torch_routed``: tokens in, tokens out the stock way: gather rows by expert,
  default-backend experts, weight by router scores, scatter-add back to tokens;
- ``fused_routed``: the fused Triton kernels' routed mode (gather and weighted combine
  inside the kernels), the routed path of the Triton backend's spec.

An implementation runs where the compute backend it uses runs (``BACKEND_OF_IMPL``).

FLOPs (reported on GPUs): 6*N*D*F forward, 18*N*D*F forward+backward, N = T*K routed rows.

    python -m torchtitan_ext.bench expert --json results.json
    python -m torchtitan_ext.bench expert --tiny        # CPU smoke run
"""

from collections.abc import Callable

import torch

from torchtitan_ext.bench.common import (
    SKEWS,
    TimedCalls,
    dense_ceiling_tflops,
    environment,
    measure_shapes,
    memory_mb,
    relative_error,
    runnable,
    skew_name,
    time_in_rounds,
    timed_row,
)
from torchtitan_ext.experiments.moe_backends.expert_timing import (
    BenchShape,
    Timer,
    expert_inputs,
    seeded_generator,
)
from torchtitan_ext.experiments.moe_backends.experts import (
    BACKENDS,
    DEFAULT_BACKEND,
    ExpertCompute,
    RoutedExpertCompute,
    get_backend,
)

FUSED_ROUTED_BACKEND = "triton"
"""The compute backend whose routed path ``fused_routed`` times."""
ROUTED_IMPLS = {"torch_routed": DEFAULT_BACKEND, "fused_routed": FUSED_ROUTED_BACKEND}
"""The tokens-in/tokens-out implementations and the compute backend each runs."""
BACKEND_OF_IMPL = {**{name: name for name in BACKENDS}, **ROUTED_IMPLS}
"""Every implementation timed and the compute backend it runs."""
IMPLS = tuple(BACKEND_OF_IMPL)


def torch_routed_experts(
    x_TD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    ids_TK: torch.Tensor,
    scores_TK: torch.Tensor,
) -> torch.Tensor:
    """The stock tokens-in/tokens-out path: permute, default-backend experts, weighted combine."""
    top_k = ids_TK.shape[1]
    slot_S = torch.argsort(ids_TK.reshape(-1), stable=True)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=w1_EFD.shape[0])
    token_S = slot_S // top_k
    y_SD = get_backend(DEFAULT_BACKEND).grouped(x_TD[token_S], w1_EFD, w2_EDF, w3_EFD, counts_E)
    y_SD = (y_SD.float() * scores_TK.reshape(-1)[slot_S, None]).to(x_TD.dtype)
    return torch.zeros_like(x_TD).index_add_(0, token_S, y_SD)


def bench_shape(shape: BenchShape, skew: float, impls, timer, device, dtype, rounds: int = 1) -> list[dict]:
    """One row per implementation: ms (medians of ``rounds`` rounds in which the implementations take
    turns, ``common.time_in_rounds``), TFLOP/s and memory (GPU), error vs grouped_mm."""
    ids_TK, scores_TK, counts_E, x_TD, x_RD, weights = expert_inputs(shape, skew, device, dtype)

    def grouped(compute: ExpertCompute) -> Callable[[], torch.Tensor]:
        return lambda: compute(x_RD, *weights, counts_E)

    def routed(compute: RoutedExpertCompute) -> Callable[[], torch.Tensor]:
        return lambda: compute(x_TD, *weights, ids_TK, scores_TK)

    fused_routed = get_backend(FUSED_ROUTED_BACKEND).routed
    assert fused_routed is not None, f"the {FUSED_ROUTED_BACKEND} backend has a routed path"
    forwards: dict[str, tuple[Callable[[], torch.Tensor], list[torch.Tensor]]] = {
        name: (grouped(spec.grouped), [x_RD, *weights]) for name, spec in BACKENDS.items()
    }
    forwards["torch_routed"] = (routed(torch_routed_experts), [x_TD, *weights, scores_TK])
    forwards["fused_routed"] = (routed(fused_routed), [x_TD, *weights, scores_TK])
    with torch.no_grad():
        references = {"grouped": forwards[DEFAULT_BACKEND][0](), "routed": forwards["torch_routed"][0]()}

    grad_outs = {
        kind: torch.randn(reference.shape, device=device, generator=seeded_generator(device, 1)).to(dtype)
        for kind, reference in references.items()
    }

    def kind_of(name):
        return "routed" if name in ROUTED_IMPLS else "grouped"

    def forward_backward(name):
        forward = forwards[name][0]
        return lambda: torch.autograd.backward(forward(), grad_outs[kind_of(name)])

    calls: TimedCalls = {name: (forwards[name][0], forward_backward(name), forwards[name][1]) for name in impls}
    times = time_in_rounds(calls, timer, rounds, label=f"  expert block  {shape.name:18s} {skew_name(skew)}")

    rows = []
    for name in impls:
        forward, inputs = forwards[name]
        with torch.no_grad():
            error = relative_error(forward(), references[kind_of(name)])
        held_mb, peak_mb = memory_mb(forward, grad_outs[kind_of(name)], device)
        for tensor in inputs:
            tensor.grad = None
        rows.append(
            timed_row(shape, skew, counts_E, times[name], device)
            | {"impl": name, "fwd_held_mb": held_mb, "fwdbwd_peak_mb": peak_mb, "rel_err": f"{error:.1e}"}
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(
    shapes: list[BenchShape], impls, device, dtype, command: str, out: str | None = None, skews=SKEWS, rounds: int = 1
) -> dict:
    """Measure every shape and skew (``common.measure_shapes``; ``rounds``: ``bench_shape``'s), on
    CUDA after the dense bf16 ceiling (``dense_bf16_tflops`` in the meta).

    Raises ``ConfigError`` for full-size shapes on CPU.
    """
    meta = environment(command, device, dtype)
    if device.type == "cuda":
        meta["dense_bf16_tflops"] = dense_ceiling_tflops(device)

    def measure(shape: BenchShape, skew: float, timer: Timer) -> list[dict]:
        return bench_shape(shape, skew, impls, timer, device, dtype, rounds)

    return measure_shapes("expert", shapes, skews, device, measure, meta, out)


TABLE = [
    ("shape", "shape"),
    ("skew", "skew"),
    ("max_over_mean", "max/mean"),
    ("impl", "impl"),
    ("fwd_ms", "fwd ms"),
    ("fwd_tflops", "fwd TF/s"),
    ("fwdbwd_ms", "fwd+bwd ms"),
    ("fwdbwd_tflops", "fwd+bwd TF/s"),
    ("fwdbwd_peak_mb", "peak MB"),
    ("rel_err", "rel err"),
]


def default_impls() -> list[str]:
    """Every implementation that can run here."""
    return runnable(IMPLS, BACKEND_OF_IMPL)
