"""Shared pieces of the benchmarks: named shapes, memory, FLOPs, reporting.

Shapes, seeded routing and inputs, and the timer come from
``experiments.moe_backends.expert_timing`` (the ``auto`` backend choice measures with them too).
FLOP rates are reported on GPUs only; CPU runs are for small shapes and report milliseconds.
"""

import datetime
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from torchtitan_ext.config import ConfigError
from torchtitan_ext.experiments.moe_backends.expert_timing import BenchShape, Timer

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
FULL_SIZE_MIN_DIM = 1024
"""Shapes and flavors with a model dim at least this large need CUDA (CPU runs are for small ones)."""


SMALL_SHAPES_HINT = f"--tiny, a tiny flavor (--flavor tiny-moe-grouped-mm) or dims below {FULL_SIZE_MIN_DIM}"
TINY_FLAVORS_HINT = "a tiny flavor (python -m torchtitan_ext.flavors lists them)"


def refuse_full_size_on_cpu(
    command: str, named_dims: dict[str, int], device: torch.device, *, hint: str = SMALL_SHAPES_HINT
) -> None:
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


def max_over_mean(counts_E: torch.Tensor) -> float:
    return round(float(counts_E.max()) / max(float(counts_E.float().mean()), 1e-9), 2)


def dense_ceiling_tflops(timer: Timer, device: torch.device) -> float:
    """bf16 8192^3 matrix product rate: the ceiling TFLOP/s figures are read against."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return round(2 * 8192**3 / timer(lambda: a @ b) / 1e9, 1)


def expert_tflops(shape: BenchShape, ms: float, device: torch.device, *, backward: bool) -> float | None:
    """Expert FLOP rate on a GPU, to 4 significant digits (a tiny shape's stays above zero): 6*N*D*F
    forward, 18*N*D*F forward+backward (N routed rows); None on CPU."""
    if device.type == "cpu":
        return None
    flops = (18 if backward else 6) * shape.routed_rows * shape.dim * shape.hidden_dim
    return float(f"{flops / ms / 1e9:.4g}")


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


def kernel_profile(
    step: Callable[[], None], device: torch.device, top: int, steps: int = 3, grad_to_none: Sequence[torch.Tensor] = ()
) -> list[dict]:
    """The ``top`` GPU kernels (on CPU: operators, by self time) of ``step``, in ms per call.

    One warm-up call, then ``steps`` calls under ``torch.profiler``; kernels of the same name
    are summed. ``grad_to_none`` tensors lose their grads before each call, as in the timed
    runs (otherwise every call after the first adds into the previous gradients). Returns
    ``[{"kernel": name, "ms": ms per call}]``, slowest first.
    """
    from torch.profiler import ProfilerActivity, profile

    def clean_step():
        for tensor in grad_to_none:
            tensor.grad = None
        step()

    on_gpu = device.type == "cuda"
    clean_step()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            clean_step()
        if on_gpu:
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in profiler.key_averages():
        total_us = event.device_time_total if on_gpu else event.self_cpu_time_total
        if total_us > 0:
            times[event.key] = times.get(event.key, 0.0) + total_us / steps / 1000
    slowest = sorted(times.items(), key=lambda item: -item[1])[:top]
    return [{"kernel": name, "ms": round(ms, 4)} for name, ms in slowest]


def print_kernel_profiles(rows: list[dict], label_keys: tuple[str, ...], device: torch.device) -> None:
    """Each row's ``kernels`` (from :func:`kernel_profile`) under a heading made of ``label_keys``."""
    what = "slowest GPU kernels" if device.type == "cuda" else "slowest operators (self CPU time)"
    for row in rows:
        if not row.get("kernels"):
            continue
        print("\n" + " ".join(str(row[key]) for key in label_keys) + f": {what}, ms per call")
        for kernel in row["kernels"]:
            print(f"  {kernel['ms']:9.3f}  {kernel['kernel'][:100]}")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the ``torchtitan_ext`` package that runs: a checkout's top folder, or site-packages."""


def checkout_commit(root: Path) -> str | None:
    """The short commit of the git checkout whose top folder is ``root``; None when ``root`` is not the
    top of one (an installed package, or a folder inside another repository) or git is missing."""

    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        except OSError:
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    return git("rev-parse", "--short", "HEAD")


def source_commit() -> str | None:
    """The measured code's commit: ``SOURCE_COMMIT`` when set (a copied checkout's ``.git`` may lag
    its files), else the commit of the checkout the package runs from (``PROJECT_ROOT``, whatever
    the current folder); None when it runs from no git checkout of its own."""
    return os.environ.get("SOURCE_COMMIT") or checkout_commit(PROJECT_ROOT)


def environment(command: str, device: torch.device, dtype: torch.dtype) -> dict:
    """What a result was measured with: commit, device, torch and triton, dtype, date, command (a missing
    commit is said on stderr)."""
    import triton

    commit = source_commit()
    if commit is None:
        progress(
            f"commit: none recorded ({PROJECT_ROOT} is not a git checkout of its own); "
            "set SOURCE_COMMIT to record the one measured"
        )
    return {
        "commit": commit,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "date": datetime.date.today().isoformat(),
        "command": command,
    }


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


TimedCalls = dict[str, tuple[Callable[[], object], Callable[[], None], list[torch.Tensor]]]
"""name -> (forward, forward+backward, tensors whose grads are cleared between calls)."""


def time_in_rounds(calls: TimedCalls, timer: Timer, rounds: int, label: str) -> dict[str, dict[str, list[float]]]:
    """Each name's forward and forward+backward ms, ``rounds`` times: each round times every name's
    forward, then every name's forward+backward, against each other (``Timer.round``: on a GPU the
    names take turns call by call). Progress lines read ``label``, what is timed and the round.
    Returns name -> {"fwd_ms": [...], "fwdbwd_ms": [...]}."""
    times = {name: {"fwd_ms": [], "fwdbwd_ms": []} for name in calls}
    names = ", ".join(calls)
    for round_index in range(rounds):
        of_rounds = f"  (round {round_index + 1} of {rounds})" if rounds > 1 else ""
        for key, what, index in (("fwd_ms", "forward", 0), ("fwdbwd_ms", "forward+backward", 1)):
            progress(f"{label}  {what}: {names}{of_rounds}")
            measured = timer.round({name: (call[index], call[2] if index else ()) for name, call in calls.items()})
            for name, ms in measured.items():
                times[name][key].append(ms)
        for _, _, grad_to_none in calls.values():
            for tensor in grad_to_none:
                tensor.grad = None
    return times


def median_fields(times: dict[str, list[float]]) -> dict:
    """A row's ``fwd_ms`` / ``fwdbwd_ms`` (medians over the rounds) and, after more than one round,
    the per-round times as ``fwd_ms_rounds`` / ``fwdbwd_ms_rounds``."""
    fields = {key: statistics.median(values) for key, values in times.items()}
    if any(len(values) > 1 for values in times.values()):
        fields |= {f"{key}_rounds": [round(ms, 3) for ms in values] for key, values in times.items()}
    return fields


def write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(
                results, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)
            )


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
