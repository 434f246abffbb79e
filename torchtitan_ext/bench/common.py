"""Shared pieces of the benchmarks: shapes, routing, timing, memory, FLOPs, reporting.

GPU timings are medians from CUDA events (``triton.testing.do_bench``) after warm-up;
CPU timings are medians of ``torch.utils.benchmark.Timer.blocked_autorange`` blocks after
warm-up calls, on one thread, in process CPU time: time the process spends computing, not
time it waits for a core. On a busy 2-core machine, wall-clock timings of the tiny shapes on
all threads varied up to a thousandfold from run to run; these stay within a few percent.
Routing and inputs come from seeded generators, so every run measures the same tokens.
FLOP rates are reported on GPUs only; CPU runs are for small shapes and report milliseconds.
"""

import datetime
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.utils.benchmark as torch_benchmark

from torchtitan_ext.overrides import ConfigError


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
SEED = 0
"""Seed of every benchmark's routing and inputs."""

FULL_SIZE_MIN_DIM = 1024
"""Shapes and flavors with a model dim at least this large need CUDA (CPU runs are for small ones)."""


SMALL_SHAPES_HINT = f"--tiny, a tiny flavor (--flavor tiny-moe-grouped-mm) or dims below {FULL_SIZE_MIN_DIM}"
TINY_FLAVORS_HINT = "a tiny flavor (python -m torchtitan_ext.flavors lists them)"


def refuse_full_size_on_cpu(command: str, named_dims: dict[str, int], device: torch.device, *,
                            hint: str = SMALL_SHAPES_HINT) -> None:
    """``ConfigError`` on CPU when any of ``{name: model dim}`` is full-size (dim >= ``FULL_SIZE_MIN_DIM``).

    ``hint`` names what to measure on CPU instead.
    """
    if device.type != "cpu":
        return
    full_size = [f"{name} (dim {dim})" for name, dim in named_dims.items() if dim >= FULL_SIZE_MIN_DIM]
    if full_size:
        raise ConfigError(
            f"bench {command}: {', '.join(full_size)} is full-size and needs a CUDA GPU "
            f"(minutes per measurement on CPU); on CPU measure {hint}"
        )


def seeded_generator(device, seed: int = SEED) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def route(num_tokens: int, num_experts: int, top_k: int, skew: float, device,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK, scores_TK): top-k of random softmax logits, renormalised; skew favours low ids."""
    logits_TE = torch.randn(num_tokens, num_experts, device=device, generator=generator)
    if skew:
        logits_TE = logits_TE + torch.linspace(skew, 0, num_experts, device=device)
    scores_TK, ids_TK = logits_TE.softmax(dim=-1).topk(top_k, dim=-1)
    return ids_TK, scores_TK / scores_TK.sum(dim=-1, keepdim=True)


def max_over_mean(counts_E: torch.Tensor) -> float:
    return round(float(counts_E.max()) / max(float(counts_E.float().mean()), 1e-9), 2)


Timer = Callable[..., float]


def make_timer(device: torch.device, *, warmup_ms: int = 25, repeat_ms: int = 100) -> Timer:
    """``timer(fn, grad_to_none=None) -> median ms``; ``grad_to_none`` tensors lose their grads before each call.

    CUDA: ``triton.testing.do_bench`` (``warmup_ms`` then ``repeat_ms`` of calls). CPU: warm-up calls
    for ``warmup_ms`` (at least one), then ``blocked_autorange`` on one thread, in process CPU
    time, for at least ``repeat_ms`` and five calls' time.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        def cuda_timer(fn, grad_to_none=None):
            return do_bench(fn, warmup=warmup_ms, rep=repeat_ms, return_mode="median",
                            grad_to_none=grad_to_none)

        return cuda_timer

    def cpu_timer(fn, grad_to_none=None):
        def call():
            for tensor in grad_to_none or ():
                tensor.grad = None
            fn()

        calls, start = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - start < warmup_ms / 1e3:
            call()
            calls += 1
        seconds_per_call = (time.perf_counter() - start) / calls
        timer = torch_benchmark.Timer(stmt="call()", globals={"call": call}, num_threads=1,
                                      timer=time.process_time)
        measurement = timer.blocked_autorange(min_run_time=max(repeat_ms / 1e3, 5 * seconds_per_call))
        return measurement.median * 1e3

    return cpu_timer


def dense_ceiling_tflops(timer: Timer, device: torch.device) -> float:
    """bf16 8192^3 matrix product rate: the ceiling TFLOP/s figures are read against."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return round(2 * 8192**3 / timer(lambda: a @ b) / 1e9, 1)


def expert_tflops(shape: BenchShape, ms: float, device: torch.device, *, backward: bool) -> float | None:
    """Expert FLOP rate on a GPU: 6*N*D*F forward, 18*N*D*F forward+backward (N routed rows); None on CPU."""
    if device.type == "cpu":
        return None
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
    """Rows of dicts as an aligned text table; ``columns`` is [(key, header)].

    A column no row has a value for (e.g. TFLOP/s and memory on CPU) is left out.
    """
    columns = [(key, header) for key, header in columns if any(row.get(key) is not None for row in rows)]
    cells = [[header for _, header in columns]]
    for row in rows:
        cells.append(["" if row.get(key) is None else str(row.get(key)) for key, _ in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
