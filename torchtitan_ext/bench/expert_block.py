"""Benchmark the SwiGLU expert block (3 GEMMs) of every compute backend on one device.

Implementations, timed in one process so that ratios compare like with like:

- every ``compute_backend`` of the backend table on rows already grouped by expert: the
  expert block alone (errors against the default backend);
- ``torch_routed``: tokens in, tokens out the stock way: gather rows by expert,
  default-backend experts, weight by router scores, scatter-add back to tokens;
- ``fused_routed``: the fused Triton kernels' routed mode (gather and weighted combine
  inside the kernels), the routed path of the Triton backend's spec.

FLOPs (reported on GPUs): 6*N*D*F forward, 18*N*D*F forward+backward, N = T*K routed rows.

    python -m torchtitan_ext.bench expert --json results.json
    python -m torchtitan_ext.bench expert --tiny        # CPU smoke run
"""

import torch

from torchtitan_ext.bench.common import (
    SKEWS,
    dense_ceiling_tflops,
    environment,
    expert_tflops,
    max_over_mean,
    median_fields,
    memory_mb,
    refuse_full_size_on_cpu,
    relative_error,
    time_in_rounds,
    write_json,
)
from torchtitan_ext.compat.torch_versions import apply_torch_version_fixes
from torchtitan_ext.experiments.moe_backends.expert_timing import (
    BenchShape,
    expert_inputs,
    make_timer,
    seeded_generator,
)

apply_torch_version_fixes()

from torchtitan_ext.experiments.moe_backends.experts import (  # noqa: E402
    BACKENDS,
    DEFAULT_BACKEND,
    get_backend,
)
from torchtitan_ext.kernels.fused_moe import fused_moe_routed, triton_available_reason  # noqa: E402

ROUTED_IMPLS = ("torch_routed", "fused_routed")
IMPLS = (*BACKENDS, *ROUTED_IMPLS)


def torch_routed_experts(x_TD, w1_EFD, w2_EDF, w3_EFD, ids_TK, scores_TK):
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
    forwards = {
        name: (lambda fn=spec.grouped: fn(x_RD, *weights, counts_E), [x_RD, *weights])
        for name, spec in BACKENDS.items()
    }
    forwards["torch_routed"] = (
        lambda: torch_routed_experts(x_TD, *weights, ids_TK, scores_TK),
        [x_TD, *weights, scores_TK],
    )
    forwards["fused_routed"] = (
        lambda: fused_moe_routed(x_TD, *weights, ids_TK, scores_TK),
        [x_TD, *weights, scores_TK],
    )
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

    calls = {name: (forwards[name][0], forward_backward(name), forwards[name][1]) for name in impls}
    times = time_in_rounds(calls, timer, rounds, label=f"  expert block  {shape.name:18s} skew {skew}")

    rows = []
    for name in impls:
        forward, inputs = forwards[name]
        with torch.no_grad():
            error = relative_error(forward(), references[kind_of(name)])
        held_mb, peak_mb = memory_mb(forward, grad_outs[kind_of(name)], device)
        for tensor in inputs:
            tensor.grad = None
        measured = median_fields(times[name])
        fwd_ms, fwdbwd_ms = measured.pop("fwd_ms"), measured.pop("fwdbwd_ms")
        rows.append(
            {
                "shape": shape.name,
                "skew": skew,
                "max_over_mean": max_over_mean(counts_E),
                "impl": name,
                "fwd_ms": round(fwd_ms, 3),
                "fwd_tflops": expert_tflops(shape, fwd_ms, device, backward=False),
                "fwdbwd_ms": round(fwdbwd_ms, 3),
                "fwdbwd_tflops": expert_tflops(shape, fwdbwd_ms, device, backward=True),
                "fwd_held_mb": held_mb,
                "fwdbwd_peak_mb": peak_mb,
                "rel_err": f"{error:.1e}",
                **measured,
            }
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(
    shapes: list[BenchShape], impls, device, dtype, command: str, out: str | None = None, skews=SKEWS, rounds: int = 1
) -> dict:
    """Measure every shape and skew (``rounds``: ``bench_shape``'s); ``out`` is rewritten after each shape.

    Raises ``ConfigError`` for full-size shapes on CPU.
    """
    refuse_full_size_on_cpu("expert", {shape.name: shape.dim for shape in shapes}, device)
    timer = make_timer(device)
    results = {"meta": environment(command, device, dtype), "rows": []}
    if device.type == "cuda":
        results["meta"]["dense_bf16_tflops"] = dense_ceiling_tflops(timer, device)
    for shape in shapes:
        for skew in skews:
            results["rows"] += bench_shape(shape, skew, impls, timer, device, dtype, rounds)
        write_json(out, results)
    return results


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


def unavailable_reason(impl: str) -> str | None:
    """Why ``impl`` cannot run here (None: it can): a backend's spec says; ``fused_routed`` is a Triton kernel."""
    if impl in BACKENDS:
        return BACKENDS[impl].unavailable_reason()
    return triton_available_reason() if impl == "fused_routed" else None


def default_impls() -> list[str]:
    """Every implementation that can run here."""
    return [name for name in IMPLS if unavailable_reason(name) is None]
