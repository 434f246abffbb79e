"""Shared pieces of the benchmarks: shapes, routing, timing, memory, FLOPs, reporting.

GPU timings are medians from CUDA events (``triton.testing.do_bench``) after warm-up;
CPU timings are medians of wall-clock repeats (for smoke runs on small shapes).
"""

import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class BenchShape:
    """One MoE layer's dimensions and the tokens it sees per step."""

    name: str
    tokens: int
    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int

    @property
    def routed_rows(self) -> int:
        return self.tokens * self.top_k

    def layer_kwargs(self) -> dict:
        return dict(dim=self.dim, hidden_dim=self.hidden_dim, num_experts=self.num_experts,
                    top_k=self.top_k)


SHAPES = {
    shape.name: shape
    for shape in (
        BenchShape("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
        BenchShape("olmoe-1b-7b", 8192, 2048, 1024, 64, 8),
        BenchShape("deepseek-v2-lite", 8192, 2048, 1408, 64, 6),
        BenchShape("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
    )
}
TINY_SHAPE = BenchShape("tiny", 32, 48, 40, 6, 2)
SKEWS = (0.0, 2.0)
"""0: balanced; 2: logits + linspace(2, 0, E), max/mean load about 3.5 at the shapes above."""


def route(num_tokens: int, num_experts: int, top_k: int, skew: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK, scores_TK): top-k of random softmax logits, renormalised; skew favours low ids."""
    logits_TE = torch.randn(num_tokens, num_experts, device=device)
    if skew:
        logits_TE = logits_TE + torch.linspace(skew, 0, num_experts, device=device)
    scores_TK, ids_TK = logits_TE.softmax(dim=-1).topk(top_k, dim=-1)
    return ids_TK, scores_TK / scores_TK.sum(dim=-1, keepdim=True)


def max_over_mean(counts_E: torch.Tensor) -> float:
    return round(float(counts_E.max()) / max(float(counts_E.float().mean()), 1e-9), 2)


Timer = Callable[..., float]


def make_timer(device: torch.device, *, warmup_ms: int = 25, repeat_ms: int = 100) -> Timer:
    """``timer(fn, grad_to_none=None) -> median ms``."""
    if device.type == "cuda":
        from triton.testing import do_bench

        def cuda_timer(fn, grad_to_none=None):
            return do_bench(fn, warmup=warmup_ms, rep=repeat_ms, return_mode="median",
                            grad_to_none=grad_to_none)

        return cuda_timer

    def cpu_timer(fn, grad_to_none=None):
        fn()
        times = []
        for _ in range(3):
            for tensor in grad_to_none or []:
                tensor.grad = None
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_timer


def dense_ceiling_tflops(timer: Timer, device: torch.device) -> float:
    """bf16 8192^3 matrix product rate: the ceiling TFLOP/s figures are read against."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return round(2 * 8192**3 / timer(lambda: a @ b) / 1e9, 1)


def expert_tflops(shape: BenchShape, ms: float, *, backward: bool) -> float:
    """Expert FLOP rate: 6*N*D*F forward, 18*N*D*F forward+backward (N routed rows)."""
    flops = (18 if backward else 6) * shape.routed_rows * shape.dim * shape.hidden_dim
    return round(flops / ms / 1e9, 1)


def memory_mb(forward: Callable[[], torch.Tensor], grad_out: torch.Tensor, device) -> tuple:
    """(MB held after the forward, peak MB over forward+backward), above what existed before."""
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    torch.autograd.backward(out, grad_out)
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return round(held / 2**20, 1), round(peak / 2**20, 1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


def environment(command: str, device: torch.device, dtype: torch.dtype) -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "date": datetime.date.today().isoformat(),
        "command": command,
    }


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Rows of dicts as an aligned text table; ``columns`` is [(key, header)]."""
    cells = [[header for _, header in columns]]
    for row in rows:
        cells.append(["" if row.get(key) is None else str(row.get(key)) for key, _ in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
