"""Where a profiled step's time went, read from a ``torch.profiler`` Chrome trace.

torchtitan writes one trace per rank when training runs with ``--profiler.enable_profiling``
(``<dump_folder>/profiling/traces/iteration_N/rankR_trace.json.gz``). The summary answers the
first question of a slow run: is the GPU busy (then the kernels decide) or waiting for the host
(then launches, Python and host syncs decide)?

- ``wall_ms``: the profiled steps (torch.profiler's ``ProfilerStep#N`` events: the host's count as
  steps, the copies it marks on each GPU stream only widen the window; the whole trace when it
  has none).
- ``gpu_busy_ms``: the union over streams of the kernels, copies and fills inside those steps;
  ``gpu_busy_outside_communication_ms`` the same without communication kernels. Those (NCCL,
  symmetric-memory barriers) are busy while they wait for a peer, so a rank waiting for a slower
  one looks busy: read every rank's trace (a step paced by one rank's host shows that rank's GPU
  idle and the others' time in communication kernels).
- ``kinds``: kernel time by kind (communication, matmul, attention, this project's Triton
  kernels, optimizer, index/sort/scatter, copy/fill, elementwise/reduce, other); kernels on
  different streams overlap, so the kinds can add up to more than ``gpu_busy_ms``.
- ``host``: host syncs (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, blocking
  ``cudaMemcpy``: the host waits there for the GPU) and kernel launches; ``syncs_by_operator``: the
  host operators the syncs ran in (the innermost one on the syncing thread: ``aten::_local_scalar_dense``
  for ``item()`` and for ``tolist()`` under compile, which reads each element on its own), most first.
- ``gpu_idle_gaps``: the longest spans (``IDLE_GAP_MIN_MS`` or more) in which no stream of the GPU
  ran anything, each with the host operator or annotation that overlapped it most (what the GPU
  waited for: a data loader's ``__next__``, an optimizer's launches, ...).
- ``top_kernels`` (GPU traces) or ``top_operators`` (CPU traces: operators by inclusive time).
"""

import gzip
import importlib
import json
import pkgutil
from collections import Counter

from torchtitan_ext import kernels

KINDS = (
    ("communication", ("nccl", "symmetric_memory")),
    ("matmul", ("gemm", "cutlass", "nvjet", "cublas", "xmma")),
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("index/sort/scatter", ("index", "scatter", "gather", "sort", "radix")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
    ("elementwise/reduce", ("elementwise", "reduce")),
)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
IDLE_GAP_MIN_MS = 1.0
IDLE_GAPS_LISTED = 5
SYNC_SOURCES_LISTED = 5
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def project_kernel_names() -> frozenset[str]:
    """Names of this project's Triton kernels (as they appear in traces): every module of ``kernels``."""
    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for value in vars(module).values():
            function = getattr(value, "fn", value)  # autotuned kernels wrap the JIT function
            function = getattr(function, "fn", function)
            name = getattr(function, "__name__", "")
            if name.startswith("_") and name.endswith("_kernel"):
                names.add(name)
    return frozenset(names)


def kernel_kind(name: str, project_kernels: frozenset[str]) -> str:
    if name in project_kernels:
        return "project Triton"
    lowered = name.lower()
    return next((kind for kind, fragments in KINDS if any(f in lowered for f in fragments)), "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


def uncovered_spans(intervals: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of ``(start, end)`` that no ``(start, end)`` interval covers, in time order."""
    spans, covered_to = [], start
    for interval_start, interval_end in sorted(intervals):
        if interval_start > covered_to:
            spans.append((covered_to, min(interval_start, end)))
        covered_to = max(covered_to, interval_end)
    if covered_to < end:
        spans.append((covered_to, end))
    return [(a, b) for a, b in spans if b > a]


def longest_overlap(span: tuple[float, float], events: list[dict]) -> tuple[str, float] | None:
    """``(name, overlap)`` of the event overlapping ``span`` most (the shorter one on a tie: the more
    specific of nested ones); None when none overlaps it."""
    best = None
    for e in events:
        overlap = min(span[1], e["ts"] + e["dur"]) - max(span[0], e["ts"])
        if overlap > 0 and (best is None or (overlap, -e["dur"]) > (best[1], -best[2])):
            best = (e["name"], overlap, e["dur"])
    return None if best is None else (best[0], best[1])


def idle_gaps(gpu: list[dict], host: list[dict], start: float, end: float) -> list[dict]:
    """The ``IDLE_GAPS_LISTED`` longest spans of at least ``IDLE_GAP_MIN_MS`` with no GPU work, longest
    first: where they start (ms from ``start``), how long, and the host event that overlapped each most."""
    spans = uncovered_spans([(e["ts"], e["ts"] + e["dur"]) for e in gpu], start, end)
    long_spans = sorted((s for s in spans if s[1] - s[0] >= IDLE_GAP_MIN_MS * 1e3), key=lambda s: s[0] - s[1])
    gaps = []
    for span in long_spans[:IDLE_GAPS_LISTED]:
        gap: dict[str, float | str] = {
            "at_ms": round((span[0] - start) / 1e3, 3),
            "ms": round((span[1] - span[0]) / 1e3, 3),
        }
        if (busiest := longest_overlap(span, host)) is not None:
            gap["host"], gap["host_ms"] = busiest[0], round(busiest[1] / 1e3, 3)
        gaps.append(gap)
    return gaps


def syncs_by_operator(syncs: list[dict], host: list[dict]) -> list[dict]:
    """``[{"operator", "syncs", "ms"}]``, most syncs first (``SYNC_SOURCES_LISTED``): the innermost host
    operator around each sync on its thread ("no host operator" where none encloses it). One sweep per
    thread: its operators nest, and its syncs follow one another."""
    counts, ms = Counter(), Counter()
    for thread in {sync.get("tid") for sync in syncs}:
        operators = sorted((e for e in host if e.get("tid") == thread), key=lambda e: (e["ts"], -e["dur"]))
        open_operators: list[dict] = []
        next_operator = 0
        for sync in sorted((e for e in syncs if e.get("tid") == thread), key=lambda e: e["ts"]):
            while next_operator < len(operators) and operators[next_operator]["ts"] <= sync["ts"]:
                open_operators.append(operators[next_operator])
                next_operator += 1
            sync_end = sync["ts"] + sync["dur"]
            enclosing = [e for e in open_operators if e["ts"] + e["dur"] >= sync_end]
            open_operators = enclosing  # the rest ended before this sync did, so before every later one
            name = min(enclosing, key=lambda e: e["dur"])["name"] if enclosing else "no host operator"
            counts[name] += 1
            ms[name] += sync["dur"] / 1e3
    return [
        {"operator": name, "syncs": count, "ms": round(ms[name], 3)}
        for name, count in counts.most_common(SYNC_SOURCES_LISTED)
    ]


def load_events(path: str) -> list[dict]:
    """The complete ("X") events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def summarize(path: str, top: int = 15) -> dict:
    """The summary of one trace file (see the module docstring); durations in ms."""
    events = load_events(path)
    if not events:
        raise ValueError("no timed events in the trace")
    step_marks = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    steps = [e for e in step_marks if e.get("cat") != "gpu_user_annotation"]
    window = step_marks or events
    start = min(e["ts"] for e in window)
    end = max(e["ts"] + e["dur"] for e in window)
    inside = [e for e in events if start <= e["ts"] < end]

    gpu = [e for e in inside if e.get("cat") in GPU_CATEGORIES]
    project_kernels = project_kernel_names()
    kinds, kernel_ms, kernel_calls = Counter(), Counter(), Counter()
    working = []
    for e in gpu:
        kind = kernel_kind(e["name"], project_kernels)
        kinds[kind] += e["dur"] / 1e3
        if kind != "communication":
            working.append((e["ts"], e["ts"] + e["dur"]))
        kernel_ms[e["name"]] += e["dur"] / 1e3
        kernel_calls[e["name"]] += 1
    runtime = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    syncs = [e for e in runtime if e["name"] in SYNC_CALLS]
    host = [
        e for e in inside if e.get("cat") in HOST_CATEGORIES and not str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    summary = {
        "trace": path,
        "steps": len(steps),
        "wall_ms": round((end - start) / 1e3, 3),
        "gpu_busy_ms": round(union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) / 1e3, 3),
        "gpu_busy_outside_communication_ms": round(union_length(working) / 1e3, 3),
        "kinds": {kind: round(ms, 3) for kind, ms in kinds.most_common()},
        "host": {
            "sync_calls": len(syncs),
            "sync_ms": round(sum(e["dur"] for e in syncs) / 1e3, 3),
            "kernel_launches": sum(e["name"] in LAUNCH_CALLS for e in runtime),
            "syncs_by_operator": syncs_by_operator(syncs, [e for e in host if e.get("cat") == "cpu_op"]),
        },
    }
    if gpu:
        summary["gpu_idle_gaps"] = idle_gaps(gpu, host, start, end)
        summary["top_kernels"] = [
            {"name": name, "ms": round(ms, 3), "calls": kernel_calls[name]} for name, ms in kernel_ms.most_common(top)
        ]
    else:
        operators, calls = Counter(), Counter()
        for e in inside:
            if e.get("cat") == "cpu_op":
                operators[e["name"]] += e["dur"] / 1e3
                calls[e["name"]] += 1
        summary["top_operators"] = [
            {"name": name, "ms": round(ms, 3), "calls": calls[name]} for name, ms in operators.most_common(top)
        ]
    return summary


def print_summary(summary: dict) -> None:
    steps = f"{summary['steps']} profiled step(s)" if summary["steps"] else "the whole trace (no profiler steps)"
    print(f"{summary['trace']}: {steps}, {summary['wall_ms']:.1f} ms")
    wall, busy = summary["wall_ms"], summary["gpu_busy_ms"]
    if "top_kernels" in summary:
        working = summary["gpu_busy_outside_communication_ms"]
        print(
            f"GPU busy {busy:.1f} ms ({busy / wall:.0%} of the time), {working:.1f} ms ({working / wall:.0%}) outside "
            "communication kernels (which also wait for peers); the GPU waited for the host the rest"
        )
        print("kernel time by kind (ms): " + ", ".join(f"{kind} {ms:.1f}" for kind, ms in summary["kinds"].items()))
        host = summary["host"]
        print(
            f"host: {host['sync_calls']} syncs ({host['sync_ms']:.1f} ms waiting for the GPU), "
            f"{host['kernel_launches']:,} kernel launches"
        )
        if host["syncs_by_operator"]:
            print(
                "host syncs by operator: "
                + ", ".join(f"{row['operator'][:60]} {row['syncs']}" for row in host["syncs_by_operator"])
            )
        print_idle_gaps(summary["gpu_idle_gaps"])
        rows, heading = summary["top_kernels"], "slowest kernels (total ms, calls)"
    else:
        print("no GPU kernels in this trace (a CPU run): operators by inclusive time instead")
        rows, heading = summary["top_operators"], "operators (inclusive ms, calls)"
    print(f"{heading}:")
    for row in rows:
        print(f"  {row['ms']:9.2f} {row['calls']:6d}  {row['name'][:100]}")


def print_idle_gaps(gaps: list[dict]) -> None:
    if not gaps:
        print(f"no span of {IDLE_GAP_MIN_MS:g} ms or more without GPU work")
        return
    print(f"longest spans without GPU work (from {IDLE_GAP_MIN_MS:g} ms; start ms, length ms, the host then):")
    for gap in gaps:
        host = f"{gap['host'][:90]} ({gap['host_ms']:.1f} ms of it)" if "host" in gap else "no host event"
        print(f"  {gap['at_ms']:9.1f} {gap['ms']:7.1f}  {host}")
