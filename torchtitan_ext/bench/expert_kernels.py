"""Benchmark: fused Triton MoE expert kernels against torch._grouped_mm on one GPU.

Times the SwiGLU expert block (3 GEMMs) at real MoE shapes, balanced and skewed routing,
forward and forward+backward, in one process so the ratios compare like with like:

- grouped_mm:     torchtitan's expert path on rows already grouped by expert
                  (torch._grouped_mm x3 + SwiGLU), the anchor baseline.
- fused_grouped:  fused_moe_grouped on the same grouped rows.
- torch_routed:   tokens in, tokens out: gather rows by expert, grouped_mm experts,
                  weight by router scores, scatter-add back to tokens.
- fused_routed:   fused_moe_routed (gather and weighted scatter inside the kernels).

FLOPs: 6*N*D*F forward, 18*N*D*F forward+backward, N = T*K routed rows.

    python -m torchtitan_ext.bench.expert_kernels --out results.json
    TRITON_INTERPRET=1 python -m torchtitan_ext.bench.expert_kernels --tiny   # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [
    # name, tokens, dim D, hidden F, experts E, top_k K
    ("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    ("olmoe-1b-7b", 8192, 2048, 1024, 64, 8),
    ("deepseek-v2-lite", 8192, 2048, 1408, 64, 6),
    ("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
]
TINY_SHAPES = [("tiny", 24, 48, 40, 6, 2)]
SKEWS = (0.0, 2.0)


def route(num_tokens, num_experts, top_k, skew, device):
    """Top-k ids and softmax-renormalised scores from random logits; skew > 0 favours low ids."""
    logits_TE = torch.randn(num_tokens, num_experts, device=device)
    if skew:
        logits_TE = logits_TE + torch.linspace(skew, 0, num_experts, device=device)
    scores_TK, ids_TK = logits_TE.softmax(dim=-1).topk(top_k, dim=-1)
    return ids_TK, scores_TK / scores_TK.sum(dim=-1, keepdim=True)


def grouped_mm_experts(x_ND, w1_EFD, w2_EDF, w3_EFD, counts_E):
    offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    gate = torch._grouped_mm(x_ND, w1_EFD.transpose(-2, -1), offs=offsets_E)
    up = torch._grouped_mm(x_ND, w3_EFD.transpose(-2, -1), offs=offsets_E)
    return torch._grouped_mm(F.silu(gate) * up, w2_EDF.transpose(-2, -1), offs=offsets_E)


def torch_routed_experts(x_TD, w1_EFD, w2_EDF, w3_EFD, ids_TK, scores_TK, experts_fn):
    top_k = ids_TK.shape[1]
    slot_N = torch.argsort(ids_TK.reshape(-1), stable=True)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=w1_EFD.shape[0])
    token_N = slot_N // top_k
    y_ND = experts_fn(x_TD[token_N], w1_EFD, w2_EDF, w3_EFD, counts_E)
    y_ND = (y_ND.float() * scores_TK.reshape(-1)[slot_N, None]).to(x_TD.dtype)
    return torch.zeros_like(x_TD).index_add_(0, token_N, y_ND)


def make_timer(device):
    if device.type == "cuda":
        from triton.testing import do_bench

        def timer(fn, grad_to_none=None):
            return do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=grad_to_none)

        return timer

    def cpu_timer(fn, grad_to_none=None):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_timer


def dense_ceiling_tflops(timer, device):
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192**3 / timer(lambda: a @ b) / 1e9


def memory_of(fn_forward, grad_out, device):
    """(MB held after forward incl. output, peak MB over forward+backward), above the inputs."""
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn_forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    torch.autograd.backward(out, grad_out)
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return round(held / 2**20, 1), round(peak / 2**20, 1)


def kernel_breakdown(forward_backward, inputs, device, repeats=3):
    """Device time per kernel name (ms per forward+backward), from the profiler."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            for tensor in inputs:
                tensor.grad = None
            forward_backward()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        total_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total_us:
            totals[event.key[:60]] = round(total_us / repeats / 1e3, 3)
    return dict(sorted(totals.items(), key=lambda item: -item[1])[:12])


def bench_shape(name, tokens, dim, hidden, num_experts, top_k, skew, timer, device, dtype, impl_names):
    from torchtitan_ext.kernels.fused_moe import fused_moe_grouped, fused_moe_routed, reference_grouped

    ids_TK, scores_TK = route(tokens, num_experts, top_k, skew, device)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=num_experts)
    slot_N = torch.argsort(ids_TK.reshape(-1), stable=True)
    num_rows = tokens * top_k
    x_TD = torch.randn(tokens, dim, device=device, dtype=dtype).requires_grad_()
    x_ND = x_TD.detach()[slot_N // top_k].clone().requires_grad_()
    weights = [
        (torch.randn(num_experts, hidden, dim, device=device, dtype=dtype) * 0.02).requires_grad_(),
        (torch.randn(num_experts, dim, hidden, device=device, dtype=dtype) * 0.02).requires_grad_(),
        (torch.randn(num_experts, hidden, dim, device=device, dtype=dtype) * 0.02).requires_grad_(),
    ]
    scores_TK = scores_TK.to(dtype).requires_grad_()
    experts_fn = grouped_mm_experts if device.type == "cuda" else reference_grouped
    impls = {
        "grouped_mm": (lambda: experts_fn(x_ND, *weights, counts_E), [x_ND, *weights]),
        "fused_grouped": (lambda: fused_moe_grouped(x_ND, *weights, counts_E), [x_ND, *weights]),
        "torch_routed": (
            lambda: torch_routed_experts(x_TD, *weights, ids_TK, scores_TK, experts_fn),
            [x_TD, *weights, scores_TK],
        ),
        "fused_routed": (lambda: fused_moe_routed(x_TD, *weights, ids_TK, scores_TK), [x_TD, *weights, scores_TK]),
    }
    flops_fwd = 6 * num_rows * dim * hidden
    row = {
        "shape": name, "tokens": tokens, "D": dim, "F": hidden, "E": num_experts, "K": top_k,
        "skew": skew, "rows": num_rows,
        "max_over_mean": round(float(counts_E.max()) / (num_rows / num_experts), 2),
    }
    with torch.no_grad():
        references = {
            "grouped": experts_fn(x_ND, *weights, counts_E).float(),
            "routed": torch_routed_experts(x_TD, *weights, ids_TK, scores_TK, experts_fn).float(),
        }
    for impl_name in impl_names:
        fn, inputs = impls[impl_name]
        reference = references["routed" if "routed" in impl_name else "grouped"]
        with torch.no_grad():
            out = fn().float()
        rel_err = float((out - reference).norm() / reference.norm())
        grad_out = torch.randn_like(reference).to(dtype)
        fwd_ms = timer(fn)

        def forward_backward():
            torch.autograd.backward(fn(), grad_out)

        fwdbwd_ms = timer(forward_backward, grad_to_none=inputs)
        for tensor in inputs:
            tensor.grad = None
        held_mb, peak_mb = memory_of(fn, grad_out, device)
        kernel_ms = kernel_breakdown(forward_backward, inputs, device) if impl_name.startswith("fused") else None
        for tensor in inputs:
            tensor.grad = None
        row[impl_name] = {
            "fwd_ms": round(fwd_ms, 3), "fwd_tflops": round(flops_fwd / fwd_ms / 1e9, 1),
            "fwdbwd_ms": round(fwdbwd_ms, 3), "fwdbwd_tflops": round(3 * flops_fwd / fwdbwd_ms / 1e9, 1),
            "fwd_held_mb": held_mb, "fwdbwd_peak_mb": peak_mb, "rel_err_vs_grouped_mm": rel_err,
        }
        if kernel_ms:
            row[impl_name]["fwdbwd_kernel_ms"] = kernel_ms
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def chosen_configs():
    from torchtitan_ext.kernels import swiglu_experts as module

    chosen = {}
    for kernel_name in (
        "_gate_up_forward_kernel", "_down_forward_kernel", "_down_backward_kernel",
        "_gate_up_backward_input_kernel", "_down_backward_weight_kernel", "_gate_up_backward_weight_kernel",
    ):
        cache = getattr(getattr(module, kernel_name), "cache", {})
        chosen[kernel_name] = {str(key): str(config) for key, config in cache.items()}
    return chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--shapes", nargs="*", help="subset of shape names")
    parser.add_argument("--impls", nargs="*", default=["grouped_mm", "fused_grouped", "torch_routed", "fused_routed"])
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import triton

    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype),
        "date": datetime.date.today().isoformat(),
        "command": "python -m torchtitan_ext.bench.expert_kernels" + (" --tiny" if args.tiny else ""),
    }
    timer = make_timer(device)
    torch.manual_seed(0)
    if device.type == "cuda":
        meta["dense_bf16_tflops"] = round(dense_ceiling_tflops(timer, device), 1)
    print(json.dumps(meta), flush=True)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = [shape for shape in shapes if shape[0] in args.shapes]
    rows = []
    for shape in shapes:
        for skew in SKEWS:
            row = bench_shape(*shape, skew, timer, device, dtype, args.impls)
            rows.append(row)
            print(json.dumps(row), flush=True)
    results = {"meta": meta, "rows": rows, "configs": chosen_configs()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print_table(rows, args.impls)
    return results


def print_table(rows, impl_names):
    header = f"{'shape':18s} {'skew':>4s} " + " ".join(f"{n + ' f/fb':>22s}" for n in impl_names)
    print(header)
    for row in rows:
        cells = []
        for name in impl_names:
            r = row[name]
            cells.append(f"{r['fwd_tflops']:>9.1f}/{r['fwdbwd_tflops']:<6.1f}{r['fwdbwd_ms']:>6.2f}ms")
        print(f"{row['shape']:18s} {row['skew']:>4.1f} " + " ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
