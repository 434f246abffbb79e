"""Shared pieces of the benchmarks: named shapes, which measurements run here, errors, memory,
FLOPs, reporting.

The named shapes are the MoE layers of public models (``experiments.moe_backends.model_shapes``,
the dimensions the full-size flavors are built with) at a fixed token count. Seeded routing and
inputs, and the timer come from ``experiments.moe_backends.expert_timing`` (the ``auto`` backend
choice measures with them too). FLOP rates are reported on GPUs only; CPU runs are for small
shapes and report milliseconds.
"""

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from torchtitan_ext.config import ConfigError
from torchtitan_ext.experiments.moe_backends.expert_timing import BenchShape, TimedCall, Timer, make_timer
from torchtitan_ext.experiments.moe_backends.experts import get_backend
from torchtitan_ext.experiments.moe_backends.model_shapes import (
    DEEPSEEK_V2_LITE_MOE_LAYER,
    MIXTRAL_8X7B,
    OLMOE_1B_7B,
    QWEN3_30B_A3B,
)

SHAPE_TOKENS = 8192
"""Tokens per step of the named shapes."""
SHAPES = {
    name: BenchShape.of_layer(name, SHAPE_TOKENS, layer)
    for name, layer in (
        ("qwen3-30b-a3b", QWEN3_30B_A3B.moe_layer),
        ("olmoe-1b-7b", OLMOE_1B_7B.moe_layer),
        ("deepseek-v2-lite", DEEPSEEK_V2_LITE_MOE_LAYER),
        ("mixtral-8x7b", MIXTRAL_8X7B.moe_layer),
    )
}
TINY_SHAPE = BenchShape("tiny", 32, 48, 40, 6, 2)
SKEWS = (0.0, 2.0)
"""0: balanced; 2: logits + linspace(2, 0, E), max/mean load about 3.5 at the shapes above."""
SKEW_NAMES = {"balanced": 0.0, "skewed": 2.0}
"""How tables, progress lines and ``--skew`` name the skews of ``SKEWS``."""


def skew_name(skew: float) -> str:
    """``"balanced"`` or ``"skewed"`` for a skew of ``SKEWS``; another one as ``"skew X"``."""
    return next((name for name, value in SKEW_NAMES.items() if value == skew), f"skew {skew}")


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


def dense_ceiling_tflops(device: torch.device) -> float:
    """bf16 8192^3 matrix product rate: the ceiling TFLOP/s figures are read against."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return round(2 * 8192**3 / make_timer(device)(lambda: a @ b) / 1e9, 1)


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
    """``||actual - expected|| / ||expected||`` in fp64 (the denominator floored at 1e-12)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


Needs = Mapping[str, Callable[[], str | None]]
"""What some measured names need besides their compute backend: ``needs[name]()`` says why it is
missing here (None: it is not)."""


def unavailable_reasons(
    names: Iterable[str], backend_of: Mapping[str, str], needs: Needs | None = None
) -> dict[str, str]:
    """Why each of the measured ``names`` that cannot run here cannot: the reason the backend table
    gives for the compute backend it runs, ``backend_of[name]``, else what ``needs[name]`` says."""
    needs = needs or {}
    reasons = {
        name: get_backend(backend_of[name]).unavailable_reason() or (needs[name]() if name in needs else None)
        for name in names
    }
    return {name: reason for name, reason in reasons.items() if reason is not None}


def runnable(names: Sequence[str], backend_of: Mapping[str, str], needs: Needs | None = None) -> list[str]:
    """The ``names`` that can run here (``unavailable_reasons``), in order."""
    unavailable = unavailable_reasons(names, backend_of, needs)
    return [name for name in names if name not in unavailable]


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


COMPILE_MODES = {"eager": (False,), "compiled": (True,), "both": (False, True)}
"""``--compile`` choices: which variants (compiled or not) of each measured implementation run."""
COMPILE_BACKENDS = ("inductor", "aot_eager")
"""``--compile-backend`` choices: torchtitan's default (Inductor generates the kernels) and
``aot_eager`` (traced forward and backward graphs run by eager ops: compiles in seconds on CPU)."""


def compile_modes(choice: str | None, device: torch.device) -> tuple[bool, ...]:
    """The variants ``--compile choice`` runs; without a choice both on CUDA, eager only elsewhere
    (Inductor takes minutes to compile on a CPU)."""
    return COMPILE_MODES[choice or ("both" if device.type == "cuda" else "eager")]


def variant_name(name: str, compiled: bool) -> str:
    """How progress lines, tables and plots name an implementation's compiled variant."""
    return f"{name} compiled" if compiled else name


def compile_like_torchtitan(module: torch.nn.Module, backend: str) -> Callable:
    """``module`` under ``torch.compile`` as torchtitan's ``apply_compile`` compiles a transformer
    block: one graph (``fullgraph=True``), data-dependent sizes captured as unbacked symbols
    (``capture_scalar_outputs``). Compiles on its first call."""
    torch._dynamo.config.capture_scalar_outputs = True
    return torch.compile(module, backend=backend, fullgraph=True)


def compile_failure(error: Exception) -> str:
    """One line for a row whose compilation failed: the exception's type and first message line."""
    first_line = next((line for line in str(error).splitlines() if line.strip()), "")
    return f"compile failed: {type(error).__name__}: {first_line[:300]}"


def first_call_s(call: Callable[[], object], device: torch.device) -> float:
    """Seconds of ``call``'s first run (a compiled variant compiles in it), the device synchronized."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    synchronize()
    start = time.perf_counter()
    call()
    synchronize()
    return float(f"{time.perf_counter() - start:.4g}")


def speedup(baseline_ms: float | None, ms: float | None) -> float | None:
    """``baseline_ms / ms`` to 2 decimals; None where either is missing."""
    return round(baseline_ms / ms, 2) if baseline_ms and ms else None


TimedCalls = dict[str, tuple[Callable[[], object], Callable[[], None], list[torch.Tensor]]]
"""name -> (forward, forward+backward, tensors whose grads are cleared between calls)."""


def time_in_rounds(calls: TimedCalls, timer: Timer, rounds: int, label: str) -> dict[str, dict[str, list[float]]]:
    """Each name's forward and forward+backward ms, ``rounds`` times: each round times every name's
    forward, then every name's forward+backward, against each other (``Timer.round``: on a GPU the
    names take turns call by call). Progress lines read ``label``, what is timed and the round.
    Returns name -> {"fwd_ms": [...], "fwdbwd_ms": [...]}."""
    times = {name: {"fwd_ms": [], "fwdbwd_ms": []} for name in calls}
    names = ", ".join(calls)
    forwards: dict[str, TimedCall] = {name: (forward, ()) for name, (forward, _, _) in calls.items()}
    steps: dict[str, TimedCall] = {name: (step, grad_to_none) for name, (_, step, grad_to_none) in calls.items()}
    for round_index in range(rounds):
        of_rounds = f"  (round {round_index + 1} of {rounds})" if rounds > 1 else ""
        for key, what, timed in (("fwd_ms", "forward", forwards), ("fwdbwd_ms", "forward+backward", steps)):
            progress(f"{label}  {what}: {names}{of_rounds}")
            measured = timer.round(timed)
            for name, ms in measured.items():
                times[name][key].append(ms)
        for _, _, grad_to_none in calls.values():
            for tensor in grad_to_none:
                tensor.grad = None
    return times


def timed_row(
    shape: BenchShape, skew: float, counts_E: torch.Tensor, times: dict[str, list[float]], device: torch.device
) -> dict:
    """The fields an ``expert`` or ``layer`` row starts with: the shape, the skew, the max/mean
    expert load, ``fwd_ms`` / ``fwdbwd_ms`` (medians over the rounds of ``time_in_rounds``) with the
    expert TFLOP/s of each and, after more than one round, the per-round times as
    ``fwd_ms_rounds`` / ``fwdbwd_ms_rounds``."""
    fwd_ms, fwdbwd_ms = (statistics.median(times[key]) for key in ("fwd_ms", "fwdbwd_ms"))
    row = {
        "shape": shape.name,
        "skew": skew,
        "max_over_mean": max_over_mean(counts_E),
        "fwd_ms": round(fwd_ms, 3),
        "fwd_tflops": expert_tflops(shape, fwd_ms, device, backward=False),
        "fwdbwd_ms": round(fwdbwd_ms, 3),
        "fwdbwd_tflops": expert_tflops(shape, fwdbwd_ms, device, backward=True),
    }
    if any(len(values) > 1 for values in times.values()):
        row |= {f"{key}_rounds": [round(ms, 3) for ms in values] for key, values in times.items()}
    return row


def measure_shapes(
    subcommand: str,
    shapes: Sequence[BenchShape],
    skews: Sequence[float],
    device: torch.device,
    bench_shape: Callable[[BenchShape, float, Timer], list[dict]],
    meta: dict,
    out: str | None,
) -> dict:
    """``{"meta": meta, "rows": rows}``: the rows ``bench_shape(shape, skew, timer)`` gives for every
    shape and skew with the device's timer (``make_timer``), rewritten to ``out`` after each shape.

    Raises ``ConfigError`` for full-size shapes on CPU (``refuse_full_size_on_cpu``), before any.
    """
    refuse_full_size_on_cpu(subcommand, {shape.name: shape.dim for shape in shapes}, device)
    timer = make_timer(device)
    results = {"meta": meta, "rows": []}
    for shape in shapes:
        for skew in skews:
            results["rows"] += bench_shape(shape, skew, timer)
        write_json(out, results)
    return results


def write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(
                results, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)
            )


def _cell(key: str, value) -> str:
    """A table cell: a skew by its name (``skew_name``), anything else as ``str`` gives it."""
    return skew_name(value) if key == "skew" else str(value)


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Rows of dicts as an aligned text table; ``columns`` is [(key, header)].

    A column no row has a value for (e.g. TFLOP/s and memory on CPU) is left out.
    """
    columns = [(key, header) for key, header in columns if any(row.get(key) is not None for row in rows)]
    cells = [[header for _, header in columns]]
    for row in rows:
        cells.append(["" if row.get(key) is None else _cell(key, row[key]) for key, _ in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
