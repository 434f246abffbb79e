"""Training runs on the GPUs of one host through the train entry, recorded as JSON.

    python scripts/gpu_training_runs.py tiny --out train_tiny.json   # every tiny flavor, EP 1 and 2
    python scripts/gpu_training_runs.py full --out train_full.json   # olmoe-1b-7b compiled: stock, grouped_mm, triton
    python scripts/gpu_training_runs.py numerics --out numerics.json   # 300 steps: FP8 experts against bf16
    python scripts/gpu_training_runs.py scale8 --out train_scale8.json   # 8 GPUs: qwen3-30b-a3b, deepseek-v3-16b
    python scripts/gpu_training_runs.py plot --from train_full.json ... --out train.png

``tiny``: each tiny flavor (fp32) for 30 steps on one GPU (EP 1; two runs side by side, one per
GPU) and on two GPUs with EP 2 over each EP transport, eager and compiled; tiny-moe-triton once
more on one GPU with the Triton cache the first run filled (warm start). Every backend's losses,
eager and compiled, must equal for_loop's eager losses of the same layout to rel 1e-4.
``full``: olmoe-1b-7b on two GPUs (FSDP 2, EP 2, bf16), 20 steps of ``--local-batch-size`` x 2048
tokens per GPU (default 4: an H100's 80 GB; an H200 takes 8): torchtitan's own MoE layers compiled
(``--compile.enable``, the baseline) and eager (``--compile.no-enable``), and the project's layers
compiled with grouped_mm (bf16 and FP8 rowwise experts, each over each EP transport), FP8 triton
over symm_mem, triton over each EP transport, triton over all_to_all with static received rows
(no host sync) without and with CUDA graphs, and triton and grouped_mm over symm_mem with static
received rows under CUDA graphs; triton over symm_mem eager for reference. Every full-size run names
its compute backend and whether it compiles, whatever the flavor's defaults. Every loss of the first
10 steps must be within 2% of the baseline's at the same step (``FULL_SIZE_COMPARED_STEPS``), 4% with
FP8 experts (``FP8_LOSS_REL``).
Printed per run: the median tokens/s over steps 5-20 (after warm-up and the first compilations), its
ratio to the baseline, peak memory and the seconds to the first step. Single runs of the same code
spread by up to 5% on the 2-GPU machines, so ``--rounds N`` (``full`` and the scale suites) launches
the chosen runs N times, round after round, each round with its own stock run, and gives each run the
median over its rounds (each round's ratio taken against that round's stock run).
``numerics``: olmoe-1b-7b as ``full`` (FSDP 2, EP 2, compiled, ``--local-batch-size`` default 2) for
300 steps with each bf16 implementation (torchtitan's own MoE, grouped_mm, triton) and FP8 rowwise
experts, same data and seed, on the endless synthetic corpus (``markov_text``: no document repeats, so
no run memorises the data): where the FP8 loss lies against the band [min, max] of the bf16 losses,
step by step and averaged over windows of ``NUMERICS_WINDOW`` steps.
``scale4`` / ``scale8``: every run on all 4 / 8 GPUs of the host. First the tiny-moe-triton and
tiny-deepseek-v3 flavors (fp32, 30 steps, ``triton`` experts) at EP 1 and at EP 4 (and 8) over each EP
transport and under the CUDA-graph preset (compiled): the same global batch, so every loss must equal
EP 1's to rel 1e-4. Then qwen3-30b-a3b and deepseek-v3-16b, FSDP 4 x EP 4 (``scale4``) or
FSDP 8 x EP 8 and FSDP 8 x EP 4 (``scale8``), bf16, 20 steps of ``--local-batch-size`` x 2048 tokens
per GPU (default 1: qwen3-30b-a3b's weights, gradients and AdamW state alone take 57 GiB of each of
8 GPUs), compiled: torchtitan's own MoE layers (``<model>-torchtitan-moe``, the baseline of its model
and layout), grouped_mm, triton over each EP transport and triton under CUDA graphs
(``examples/cuda_graphs.toml``); losses of the first 10 steps (deepseek-v3-16b: 2,
``COMPARED_STEPS_BY_MODEL``) within 2% of the baseline's. A run
whose weights, gradients and optimizer state alone do not fit its GPUs' memory is skipped, and said so.
Per run: losses, tokens/s, MFU, peak memory (rank 0's log: reserved by the allocator, and allocated)
and the seconds from launch to the first step's log line; each run names the run it is compared with
(``reference``). The JSON carries
the device, torch, triton and NCCL versions, the commit (``SOURCE_COMMIT`` where the tree has no
git metadata) and, for every suite but ``tiny``, a summary row per run: median tokens/s and MFU of
steps 5-20, the ratio to the stock compiled baseline, peak memory and seconds to the first step.
"""

import argparse
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import date

import torch
import triton

from torchtitan_ext.bench.common import source_commit
from torchtitan_ext.data import MARKOV_TEXT
from torchtitan_ext.experiments.moe_backends.experts import backend_names
from torchtitan_ext.experiments.moe_backends.flavors import tiny_flavor_name
from torchtitan_ext.launch import training_allocator_settings
from torchtitan_ext.model_size import gibibytes, training_state_bytes
from torchtitan_ext.registry import get_flavor

TINY_BACKENDS = backend_names()
STEP_LINE = re.compile(
    r"step:\s+(?P<step>\d+)\s+loss:\s+(?P<loss>[0-9.]+).*?memory:\s+(?P<memory>[0-9.]+)GiB"
    r".*?tps:\s+(?P<tps>[0-9,]+)(?:.*?mfu:\s+(?P<mfu>[0-9.]+)%)?"
)
PEAK_MEMORY_LINE = re.compile(r"peak GPU memory:\s+(?P<allocated>[0-9.]+) GiB allocated")
"""The run summary's line of rank 0's GPU memory peaks (``metrics.processor.run_summary_lines``)."""
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Run:
    """One training launch and what its rank 0 logged."""

    name: str
    flavor: str
    gpus: int
    args: list[str]
    reference: str | None = None
    """The run whose losses this one must match (and, when that run is stock, whose tokens/s it is
    compared with); None: compared with none."""
    returncode: int | None = None
    seconds_to_first_step: float | None = None
    wall_seconds: float | None = None
    losses: dict[int, float] = field(default_factory=dict)
    tokens_per_second: dict[int, int] = field(default_factory=dict)
    mfu_percent: dict[int, float] = field(default_factory=dict)
    memory_gib: dict[int, float] = field(default_factory=dict)
    """Each step's ``memory``: the most the caching allocator reserved since the last step line."""
    peak_memory_gib: float | None = None
    """The largest ``memory`` of the step lines: what the caching allocator reserved (torchtitan's column)."""
    peak_allocated_gib: float | None = None
    """The most memory rank 0's tensors held at once (the run summary's line; None: not logged)."""
    error_tail: str | None = None
    round: int = 1
    """Which round of the suite (``--rounds``) launched it: a run is compared with its reference's
    launch of the same round."""

    def label(self) -> str:
        """The name, with the round after the first."""
        return self.name if self.round == 1 else f"{self.name} (round {self.round})"

    def in_round(self, number: int) -> "Run":
        """A fresh launch of this run (nothing logged yet) in round ``number``."""
        return Run(self.name, self.flavor, self.gpus, list(self.args), self.reference, round=number)


def record_log_line(run: Run, line: str, seconds_since_launch: float) -> None:
    """Take what one line of rank 0's log tells into ``run``: a step's loss, tokens/s, MFU and reserved
    memory (and, at the first step, the seconds since the launch), or the run's allocated peak."""
    if match := STEP_LINE.search(line):
        step = int(match["step"])
        if run.seconds_to_first_step is None:
            run.seconds_to_first_step = round(seconds_since_launch, 1)
        run.losses[step] = float(match["loss"])
        run.tokens_per_second[step] = int(match["tps"].replace(",", ""))
        if match["mfu"] is not None:
            run.mfu_percent[step] = float(match["mfu"])
        run.memory_gib[step] = float(match["memory"])
        run.peak_memory_gib = max(run.memory_gib.values())
    elif match := PEAK_MEMORY_LINE.search(line):
        run.peak_allocated_gib = float(match["allocated"])


def launch(run: Run, device_ids: str, port: int, env: dict[str, str], timeout_s: float) -> Run:
    """Train ``run`` on ``device_ids`` under torchrun; fill in what rank 0 logged. A run still going
    after ``timeout_s`` seconds is killed with its processes (return code -9, its log's tail kept)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={run.gpus}",
        f"--master_port={port}",
        "--local-ranks-filter=0",
        "-m",
        "torchtitan_ext.train",
        "--flavor",
        run.flavor,
        *run.args,
    ]
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "CUDA_VISIBLE_DEVICES": device_ids},
        start_new_session=True,
    )
    watchdog = threading.Timer(timeout_s, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    assert process.stdout is not None
    lines = []
    for raw_line in process.stdout:
        line = ANSI.sub("", raw_line)
        lines.append(line)
        record_log_line(run, line, time.monotonic() - started)
    run.returncode = process.wait()
    watchdog.cancel()
    run.wall_seconds = round(time.monotonic() - started, 1)
    if run.returncode != 0 or not run.losses:
        run.error_tail = error_tail(lines, run.returncode, timeout_s, len(run.losses))
    print(
        f"{run.label()}: rc {run.returncode}, first step after {run.seconds_to_first_step} s, "
        f"{len(run.losses)} steps, last loss {run.losses.get(max(run.losses, default=0))}, "
        f"median tokens/s {median_tokens_per_second(run.tokens_per_second)}",
        flush=True,
    )
    return run


def error_tail(lines: list[str], returncode: int, timeout_s: float, steps: int) -> str:
    """What a failed run's record keeps: its log's last 60 lines, or for a run the timeout killed after
    it logged "Training completed" (a slow teardown), one line that says so."""
    if returncode == -signal.SIGKILL and any("Training completed" in line for line in lines):
        return (
            f"killed (-9) by the suite's run timeout ({timeout_s:g} s, --run-timeout) after the run logged "
            f"'Training completed' and {steps} steps"
        )
    return "".join(lines[-60:])


FIRST_MEASURED_STEP = 5
"""Steps before it (compilation, warm-up, a CUDA graph's capture) are left out of the medians and the
steady memory peak."""


def median_tokens_per_second(tokens_per_second: dict, first_step: int = FIRST_MEASURED_STEP) -> float | None:
    """Median tokens/s (per GPU, as torchtitan logs it) over the steps from ``first_step`` on;
    ``tokens_per_second`` maps each step (int, or str as read from JSON) to its tokens/s."""
    values = [tps for step, tps in tokens_per_second.items() if int(step) >= first_step]
    return float(statistics.median(values)) if values else None


def local_batch_size(run_args: list[str]) -> str:
    """The ``--training.local_batch_size`` a run was launched with ("flavor's" when not given)."""
    flag = "--training.local_batch_size"
    return run_args[run_args.index(flag) + 1] if flag in run_args else "flavor's"


COMPILE = ["--compile.enable"]
EAGER = ["--compile.no-enable"]
"""Full-size flavors compile by default; every full-size run says which it does."""
GROUPED_MM = ["--moe.compute_backend", "grouped_mm"]
TRITON = ["--toml", "examples/triton.toml"]
"""Every run of the project's full-size layers names its backend (triton is their default)."""
SYMM_MEM = ["--toml", "examples/ep_symm_mem.toml"]
ALL_TO_ALL = ["--moe.ep_transport", "all_to_all"]
"""Every EP run of the project's layers names its transport (the default, "auto", picks symm_mem on one host)."""
FP8 = ["--moe.expert_precision", "fp8_rowwise"]
STATIC_ROWS = ["--moe.ep_receive_rows", "static"]
EXACT_ROWS = ["--moe.ep_receive_rows", "exact"]
"""The received rows counted on the host, no CUDA graphs: what a run over ``symm_mem`` is without the
default ``"auto"``, which turns on static rows and CUDA graphs where a compiled step replays."""
CUDA_GRAPHS = [*STATIC_ROWS, "--training.no-disable-cuda-graphs"]
EXPERTS_APPLY_SCORES = ["--moe.experts_apply_scores", "true"]
CUDA_GRAPHS_PRESET = ["--toml", "examples/cuda_graphs.toml"]
"""symm_mem, static received rows, CUDA graphs and experts_apply_scores: the fastest EP configuration measured."""
RECOMPUTE_PREACTIVATIONS = ["--moe.recompute_preactivations", "true"]
LOAD_IN_THE_STEP = ["--data.workers", "0"]
"""The batch loaded by the training process when its step starts, as before the full-size flavors' worker."""
EXPERTS_IN_FSDP = ["--moe.experts_fsdp", "always"]
"""The routed experts sharded by FSDP on their one-rank axis as torchtitan does, as before ``"auto"``."""
EP_TRANSPORT_ARGS = {"all_to_all": ALL_TO_ALL, "symm_mem": SYMM_MEM}
TINY_STEPS = ["--training.steps", "30"]
TINY_LOSS_REL = 1e-4
"""Tiny flavors train in fp32: every layout and backend computes the same function up to rounding."""
FULL_SIZE_LOSS_REL = 0.02
"""Full-size flavors train in bf16: losses agree with the baseline's to a few bf16 roundings."""
FP8_LOSS_REL = 0.04
"""Full-size runs with FP8 experts: e4m3 rounding on top of bf16's. On 2x H100 (olmoe-1b-7b, batch 4,
steps 1-10) FP8 was 1.2% from bf16 grouped_mm, and stock compiled 1.0% from itself on another call
(our layers repeat their losses exactly), so FP8 against stock reached 2.25%; FP8's own check is the
numerics suite's 300 steps against the bf16 band."""
FULL_SIZE_COMPARED_STEPS = 10
"""Full-size losses are compared over the first steps only: bf16 training drifts apart later, and
from run to run of one implementation (stock torchtitan's olmoe-1b-7b loss at step 17 was 3.89,
11.32 and 12.39 on three loans), so later steps cannot tell a wrong layer from rounding."""
COMPARED_STEPS_BY_MODEL = {"deepseek-v3-16b": 2}
"""Models whose bf16 training from scratch amplifies rounding within a few steps are compared over fewer
steps: the forward at initialisation (step 1) and one update (step 2). deepseek-v3-16b at FSDP 4 x EP 4,
batch 1 x 2048 (4x H200, commit 260a320): triton over all_to_all and over symm_mem (the same kernels,
step-1 losses equal to 7 digits, step 2 within 0.08%) logged 7.16 and 10.73 at step 10; every run was
within 0.6% of stock's over steps 1-2 and up to 57% apart over steps 3-10. The tiny DeepSeek-V3 flavor
(fp32) checks the same layers exactly at every step."""


def expert_parallel(degree: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(degree)]


def tiny_runs() -> list[list[Run]]:
    """Batches of runs that share the host: EP 1 pairs side by side, then each EP 2 run alone; each
    backend's run, eager and compiled (``--compile.enable``: Inductor), is compared with for_loop's
    eager run of the same layout."""

    def tiny_run(backend: str, layout: str, gpus: int, args: list[str]) -> Run:
        reference = None if backend == "for_loop" else f"for_loop {layout}"
        return Run(f"{backend} {layout}", tiny_flavor_name(backend), gpus, args, reference)

    def compiled(run: Run) -> Run:
        reference = f"for_loop {run.name.partition(' ')[2]}"
        exact = EXACT_ROWS if run.gpus > 1 else []
        return Run(f"{run.name} compiled", run.flavor, run.gpus, [*run.args, *COMPILE, *exact], reference)

    ep1 = [tiny_run(b, "ep1 1gpu", 1, TINY_STEPS) for b in TINY_BACKENDS]
    ep1 += [compiled(run) for run in ep1]
    batches = [ep1[i : i + 2] for i in range(0, len(ep1), 2)]
    batches.append([Run("triton ep1 1gpu warm cache", "tiny-moe-triton", 1, TINY_STEPS)])
    for transport, transport_args in EP_TRANSPORT_ARGS.items():
        for backend in TINY_BACKENDS:
            run = tiny_run(backend, f"ep2 {transport}", 2, [*TINY_STEPS, *expert_parallel(2), *transport_args])
            batches += [[run], [compiled(run)]]
    batches += [[graphed] for graphed in tiny_cuda_graph_runs()]
    return batches


def tiny_cuda_graph_runs() -> list[Run]:
    """``triton`` compiled under CUDA graphs (the step's gradients in the graph's memory), on one GPU, over
    ``symm_mem`` with static received rows, and over ``symm_mem`` with the defaults (``ep_receive_rows =
    "auto"`` turns on static rows, CUDA graphs and ``experts_apply_scores``), each compared with
    ``for_loop``'s eager run of its layout."""
    one_gpu = [*TINY_STEPS, *COMPILE, "--training.no-disable-cuda-graphs"]
    ep2 = [*TINY_STEPS, *expert_parallel(2), *SYMM_MEM, *COMPILE]
    return [
        Run("triton ep1 1gpu compiled cuda_graphs", "tiny-moe-triton", 1, one_gpu, "for_loop ep1 1gpu"),
        Run(
            "triton ep2 symm_mem compiled cuda_graphs",
            "tiny-moe-triton",
            2,
            [*ep2, *CUDA_GRAPHS],
            "for_loop ep2 symm_mem",
        ),
        Run("triton ep2 symm_mem compiled defaults", "tiny-moe-triton", 2, ep2, "for_loop ep2 symm_mem"),
    ]


STOCK_COMPILED = "olmoe torchtitan-moe compiled"
"""The full suite's run every other run is compared with: torchtitan's own MoE layers, compiled."""


def full_size_args(local_batch_size: int, expert_parallel_degree: int, steps: int = 20) -> list[str]:
    """``steps`` steps of ``local_batch_size`` x 2048 tokens per GPU, metrics every step."""
    return [
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        str(local_batch_size),
        "--training.seq_len",
        "2048",
        *expert_parallel(expert_parallel_degree),
        "--metrics.log_freq",
        "1",
    ]


def full_runs(local_batch_size: int) -> list[list[Run]]:
    args = full_size_args(local_batch_size, 2)
    runs = [
        Run(STOCK_COMPILED, "olmoe-1b-7b-torchtitan-moe", 2, [*args, *COMPILE]),
        Run("olmoe grouped_mm compiled", "olmoe-1b-7b", 2, [*args, *GROUPED_MM, *ALL_TO_ALL, *COMPILE]),
        Run("olmoe triton compiled symm_mem defaults", "olmoe-1b-7b", 2, [*args, *TRITON, *SYMM_MEM, *COMPILE]),
        Run(
            "olmoe grouped_mm compiled symm_mem",
            "olmoe-1b-7b",
            2,
            [*args, *GROUPED_MM, *SYMM_MEM, *COMPILE, *EXACT_ROWS],
        ),
        Run("olmoe grouped_mm compiled symm_mem defaults", "olmoe-1b-7b", 2, [*args, *GROUPED_MM, *SYMM_MEM, *COMPILE]),
        Run("olmoe grouped_mm fp8 compiled", "olmoe-1b-7b", 2, [*args, *GROUPED_MM, *FP8, *ALL_TO_ALL, *COMPILE]),
        Run(
            "olmoe grouped_mm fp8 compiled symm_mem",
            "olmoe-1b-7b",
            2,
            [*args, *GROUPED_MM, *FP8, *SYMM_MEM, *COMPILE, *EXACT_ROWS],
        ),
        Run(
            "olmoe grouped_mm fp8 compiled symm_mem defaults",
            "olmoe-1b-7b",
            2,
            [*args, *GROUPED_MM, *FP8, *SYMM_MEM, *COMPILE],
        ),
        Run(
            "olmoe triton fp8 compiled symm_mem",
            "olmoe-1b-7b",
            2,
            [*args, *TRITON, *FP8, *SYMM_MEM, *COMPILE, *EXACT_ROWS],
        ),
        Run(
            "olmoe triton fp8 compiled symm_mem defaults", "olmoe-1b-7b", 2, [*args, *TRITON, *FP8, *SYMM_MEM, *COMPILE]
        ),
        Run("olmoe triton compiled", "olmoe-1b-7b", 2, [*args, *TRITON, *ALL_TO_ALL, *COMPILE]),
        Run("olmoe triton compiled symm_mem", "olmoe-1b-7b", 2, [*args, *TRITON, *SYMM_MEM, *COMPILE, *EXACT_ROWS]),
        Run(
            "olmoe triton compiled static_rows", "olmoe-1b-7b", 2, [*args, *TRITON, *ALL_TO_ALL, *COMPILE, *STATIC_ROWS]
        ),
        Run(
            "olmoe triton compiled cuda_graphs", "olmoe-1b-7b", 2, [*args, *TRITON, *ALL_TO_ALL, *COMPILE, *CUDA_GRAPHS]
        ),
        Run(
            "olmoe triton compiled symm_mem cuda_graphs",
            "olmoe-1b-7b",
            2,
            [*args, *TRITON, *SYMM_MEM, *COMPILE, *CUDA_GRAPHS],
        ),
        Run(
            "olmoe triton compiled symm_mem apply_scores",
            "olmoe-1b-7b",
            2,
            [*args, *TRITON, *SYMM_MEM, *COMPILE, *EXACT_ROWS, *EXPERTS_APPLY_SCORES],
        ),
        Run(
            "olmoe triton compiled symm_mem cuda_graphs apply_scores",
            "olmoe-1b-7b",
            2,
            [*args, *TRITON, *COMPILE, *CUDA_GRAPHS_PRESET],
        ),
        *(
            Run(
                f"olmoe triton compiled symm_mem defaults recompute_first_{layers}",
                "olmoe-1b-7b",
                2,
                [*args, *TRITON, *SYMM_MEM, *COMPILE, "--moe.recompute_preactivations_layers", str(layers)],
            )
            for layers in (2, 4)
        ),
        Run(
            "olmoe triton compiled symm_mem cuda_graphs apply_scores recompute",
            "olmoe-1b-7b",
            2,
            [*args, *TRITON, *COMPILE, *CUDA_GRAPHS_PRESET, *RECOMPUTE_PREACTIVATIONS],
        ),
        Run(
            "olmoe grouped_mm compiled symm_mem cuda_graphs",
            "olmoe-1b-7b",
            2,
            [*args, *GROUPED_MM, *SYMM_MEM, *COMPILE, *CUDA_GRAPHS],
        ),
        Run(
            "olmoe torchtitan-moe compiled data_workers_0",
            "olmoe-1b-7b-torchtitan-moe",
            2,
            [*args, *COMPILE, *LOAD_IN_THE_STEP],
        ),
        Run(
            "olmoe triton compiled symm_mem defaults data_workers_0",
            "olmoe-1b-7b",
            2,
            [*args, *TRITON, *SYMM_MEM, *COMPILE, *LOAD_IN_THE_STEP],
        ),
        *(
            Run(
                f"olmoe {backend} compiled symm_mem defaults experts_fsdp_always",
                "olmoe-1b-7b",
                2,
                [*args, *backend_args, *SYMM_MEM, *COMPILE, *EXPERTS_IN_FSDP],
            )
            for backend, backend_args in (
                ("triton", TRITON),
                ("grouped_mm", GROUPED_MM),
                ("triton fp8", [*TRITON, *FP8]),
            )
        ),
        Run("olmoe torchtitan-moe eager", "olmoe-1b-7b-torchtitan-moe", 2, [*args, *EAGER]),
        Run("olmoe triton eager symm_mem", "olmoe-1b-7b", 2, [*args, *TRITON, *SYMM_MEM, *EAGER]),
    ]
    for run in runs[1:]:
        run.reference = STOCK_COMPILED
    return [[run] for run in runs]


NUMERICS_STEPS = 300
NUMERICS_WINDOW = 20
"""Steps per window of the numerics suite's averaged comparison (step-to-step loss noise averages out)."""
NUMERICS_FP8 = ("olmoe grouped_mm fp8 compiled", "olmoe triton fp8 compiled")
"""The numerics suite's FP8 runs, each compared with the band of its bf16 runs."""


def numerics_runs(local_batch_size: int) -> list[list[Run]]:
    """The bf16 implementations and FP8 experts (``grouped_mm``'s and ``triton``'s), each alone on both
    GPUs, on ``markov_text``, compared by ``loss_band``."""
    args = [*full_size_args(local_batch_size, 2, NUMERICS_STEPS), "--data.dataset", MARKOV_TEXT]
    runs = [
        Run(STOCK_COMPILED, "olmoe-1b-7b-torchtitan-moe", 2, [*args, *COMPILE]),
        Run("olmoe grouped_mm compiled", "olmoe-1b-7b", 2, [*args, *GROUPED_MM, *ALL_TO_ALL, *COMPILE]),
        Run("olmoe triton compiled", "olmoe-1b-7b", 2, [*args, *TRITON, *ALL_TO_ALL, *COMPILE]),
        Run(NUMERICS_FP8[0], "olmoe-1b-7b", 2, [*args, *GROUPED_MM, *FP8, *ALL_TO_ALL, *COMPILE]),
        Run(NUMERICS_FP8[1], "olmoe-1b-7b", 2, [*args, *TRITON, *FP8, *ALL_TO_ALL, *COMPILE]),
    ]
    return [[run] for run in runs]


def loss_band(runs: list[Run], probe: str, window: int = NUMERICS_WINDOW) -> dict | None:
    """Where ``probe``'s losses lie against the band [min, max] of the other runs' (but the other FP8
    runs of ``NUMERICS_FP8``) at each step they all logged, and of their means over consecutive windows
    of ``window`` steps: the steps (windows) inside, and the largest distances above and below the band
    relative to its edge (above: a higher loss; 0: never on that side). None when ``probe`` or fewer
    than two band runs logged losses."""
    by_name = {run.name: run for run in runs if run.losses and (run.name == probe or run.name not in NUMERICS_FP8)}
    if probe not in by_name or len(by_name) < 3:
        return None
    probe_losses = {int(step): loss for step, loss in by_name.pop(probe).losses.items()}
    curves = [{int(step): loss for step, loss in run.losses.items()} for run in by_name.values()]
    steps = sorted(set(probe_losses).intersection(*curves))
    windows = [steps[i : i + window] for i in range(0, len(steps) - window + 1, window)]

    def compare(points: list[tuple[float, list[float]]]) -> dict:
        above = [max(value - max(band), 0.0) / max(band) for value, band in points]
        below = [max(min(band) - value, 0.0) / min(band) for value, band in points]
        return {
            "compared": len(points),
            "inside": sum(a == b == 0.0 for a, b in zip(above, below, strict=True)),
            "largest_rel_above": max(above, default=0.0),
            "largest_rel_below": max(below, default=0.0),
        }

    def mean(curve: dict[int, float], chunk: list[int]) -> float:
        return statistics.fmean(curve[step] for step in chunk)

    return {
        "probe": probe,
        "band_of": list(by_name),
        "steps": compare([(probe_losses[s], [c[s] for c in curves]) for s in steps]),
        f"windows_of_{window}": compare([(mean(probe_losses, w), [mean(c, w) for c in curves]) for w in windows]),
    }


def print_loss_band(probe: str, band: dict | None) -> None:
    if band is None:
        print(f"{probe}: not enough runs logged losses for its loss band")
        return
    print(f"{band['probe']} against the band of {', '.join(band['band_of'])}:")
    for scope, counts in band.items():
        if isinstance(counts, dict):
            print(
                f"  {scope}: inside at {counts['inside']} of {counts['compared']}, at most rel "
                f"{counts['largest_rel_above']:.2e} above it (higher loss), {counts['largest_rel_below']:.2e} below"
            )


SCALE_MODELS = ("qwen3-30b-a3b", "deepseek-v3-16b")
SCALE_TINY_FLAVORS = {"tiny-moe-triton": [], "tiny-deepseek-v3": TRITON}
"""The tiny flavors each scale suite trains at EP 1 and at each EP degree, with the arguments that make their
experts ``triton``'s: the generic one, and DeepSeek-V3's features (sigmoid routing with the expert bias,
normalised and scaled scores, shared experts, MLA, a dense first layer)."""
SCALE_EXPERT_PARALLEL = {4: (4,), 8: (8, 4)}
"""The EP degrees each scale suite trains its full-size models at, by the suite's GPU count."""
SCALE_TINY_EXPERT_PARALLEL = {4: (4,), 8: (4, 8)}
"""The EP degrees whose tiny-flavor losses each scale suite compares with EP 1's, by GPU count."""


def stock_name(model: str) -> str:
    """The flavor of ``model`` with torchtitan's own MoE layers."""
    return f"{model}-torchtitan-moe"


def scale_runs(gpus: int, local_batch_size: int) -> list[list[Run]]:
    """Every run on all ``gpus`` GPUs, one at a time: each tiny flavor at EP 1 and at each EP degree over
    each transport and under the CUDA-graph preset (compared with EP 1), then per model and EP degree its
    stock compiled baseline first and the project's layers compiled (compared with that baseline), the
    CUDA-graph preset last."""
    runs = []
    for flavor, backend_args in SCALE_TINY_FLAVORS.items():
        ep1 = f"{flavor} fsdp{gpus} ep1"
        runs.append(Run(ep1, flavor, gpus, [*TINY_STEPS, *backend_args]))
        for degree in SCALE_TINY_EXPERT_PARALLEL[gpus]:
            ep = [*TINY_STEPS, *backend_args, *expert_parallel(degree)]
            for transport, transport_args in EP_TRANSPORT_ARGS.items():
                runs.append(
                    Run(f"{flavor} fsdp{gpus} ep{degree} {transport}", flavor, gpus, [*ep, *transport_args], ep1)
                )
            graphed = [*ep, *COMPILE, *CUDA_GRAPHS_PRESET]
            runs.append(
                Run(
                    f"{flavor} fsdp{gpus} ep{degree} symm_mem compiled cuda_graphs apply_scores",
                    flavor,
                    gpus,
                    graphed,
                    ep1,
                )
            )
    for model in SCALE_MODELS:
        for degree in SCALE_EXPERT_PARALLEL[gpus]:
            layout = f"{model} fsdp{gpus} ep{degree}"
            args = full_size_args(local_batch_size, degree)
            baseline = f"{layout} torchtitan-moe compiled"
            runs += [
                Run(baseline, stock_name(model), gpus, [*args, *COMPILE]),
                Run(
                    f"{layout} grouped_mm compiled", model, gpus, [*args, *GROUPED_MM, *ALL_TO_ALL, *COMPILE], baseline
                ),
                Run(f"{layout} triton compiled", model, gpus, [*args, *TRITON, *ALL_TO_ALL, *COMPILE], baseline),
                Run(
                    f"{layout} triton compiled symm_mem",
                    model,
                    gpus,
                    [*args, *TRITON, *SYMM_MEM, *COMPILE, *EXACT_ROWS],
                    baseline,
                ),
                Run(
                    f"{layout} triton compiled symm_mem defaults",
                    model,
                    gpus,
                    [*args, *TRITON, *SYMM_MEM, *COMPILE],
                    baseline,
                ),
                Run(
                    f"{layout} triton compiled symm_mem cuda_graphs apply_scores",
                    model,
                    gpus,
                    [*args, *TRITON, *COMPILE, *CUDA_GRAPHS_PRESET],
                    baseline,
                ),
            ]
    return [[run] for run in runs]


@functools.cache
def training_state_gib(flavor: str) -> float:
    """The weights, gradients and AdamW state of ``flavor``'s model, in GiB over all GPUs."""
    _, state_bytes = training_state_bytes(get_flavor(flavor).build())
    return state_bytes / 2**30


def runs_that_do_not_fit(runs: list[Run], gpu_memory_bytes: int) -> dict[str, str]:
    """{run name: why} of the full-size runs whose training state alone exceeds a GPU's memory."""
    skipped = {}
    for run in runs:
        if run.flavor.startswith("tiny-"):
            continue
        needed = training_state_gib(run.flavor) / run.gpus  # FSDP shards it over all GPUs
        if needed * 2**30 > gpu_memory_bytes:
            skipped[run.name] = (
                f"{run.flavor}'s weights, gradients and AdamW state alone take {needed:.1f} GiB of each of "
                f"{run.gpus} GPUs, which have {gibibytes(gpu_memory_bytes)}"
            )
    return skipped


def loss_rel(run: Run) -> float:
    """How far ``run``'s losses may lie from its reference's, relative to them."""
    if run.flavor.startswith("tiny-"):
        return TINY_LOSS_REL
    return FP8_LOSS_REL if FP8[-1] in run.args else FULL_SIZE_LOSS_REL


def median_mfu_percent(run: Run, first_step: int = FIRST_MEASURED_STEP) -> float | None:
    values = [mfu for step, mfu in run.mfu_percent.items() if int(step) >= first_step]
    return round(float(statistics.median(values)), 2) if values else None


def is_stock(run: Run) -> bool:
    """Whether ``run`` trains torchtitan's own MoE layers."""
    return run.flavor.endswith("-torchtitan-moe")


def _round_summary(run: Run, by_key: dict[tuple[str, int], Run]) -> dict:
    """One launch's row of ``throughput_summary``."""
    tps = median_tokens_per_second(run.tokens_per_second)
    stock = by_key.get((run.reference, run.round)) if run.reference else run
    stock_tps = median_tokens_per_second(stock.tokens_per_second) if stock and is_stock(stock) else None
    return {
        "name": run.name,
        "median_tokens_per_second": tps,
        "median_mfu_percent": median_mfu_percent(run),
        "ratio_to_stock_compiled": round(tps / stock_tps, 3) if tps and stock_tps else None,
        "peak_memory_gib": run.peak_memory_gib,
        "peak_memory_from_step_5_gib": max(
            (gib for step, gib in run.memory_gib.items() if int(step) >= FIRST_MEASURED_STEP), default=None
        ),
        "peak_allocated_gib": run.peak_allocated_gib,
        "seconds_to_first_step": run.seconds_to_first_step,
    }


def _median_or_none(values: list) -> float | None:
    """The median of the values that are not None (3 decimals), None when there are none."""
    present = [value for value in values if value is not None]
    return round(float(statistics.median(present)), 3) if present else None


def throughput_summary(runs: list[Run]) -> list[dict]:
    """Per run: median tokens/s per GPU and MFU of steps 5 on, the tokens/s ratio to the stock run it
    is compared with (a stock run compared with none is a baseline: 1.0; no stock reference in
    ``runs``: None), peak memory (reserved: over the run, and from step 5 on, past the warm-up and a CUDA
    graph's capture; allocated where logged) and the seconds to the first step (compilation included).

    A run launched in several rounds (``--rounds``) gets one row: the median over its rounds of the
    tokens/s, the MFU and the ratio (each round's ratio against the stock launch of the same round), the
    largest memory peaks, the first round's seconds to the first step, and ``rounds``, each round's row."""
    by_key = {(run.name, run.round): run for run in runs}
    launches: dict[str, list[dict]] = {}
    for run in runs:
        launches.setdefault(run.name, []).append(_round_summary(run, by_key))
    rows = []
    for rounds in launches.values():
        if len(rounds) == 1:
            rows.append(rounds[0])
            continue
        row = dict(rounds[0])
        for key in ("median_tokens_per_second", "median_mfu_percent", "ratio_to_stock_compiled"):
            row[key] = _median_or_none([launch[key] for launch in rounds])
        for key in ("peak_memory_gib", "peak_memory_from_step_5_gib", "peak_allocated_gib"):
            row[key] = max((launch[key] for launch in rounds if launch[key] is not None), default=None)
        row["rounds"] = rounds
        rows.append(row)
    return rows


def print_throughput_summary(rows: list[dict]) -> None:
    for row in rows:
        ratio = row["ratio_to_stock_compiled"]
        versus_stock = f"{ratio:.2f}x torchtitan's MoE compiled" if ratio else "no ratio"
        if "rounds" in row:
            each = ", ".join(
                f"{launch['median_tokens_per_second']}"
                + (f" ({launch['ratio_to_stock_compiled']:.2f}x)" if launch["ratio_to_stock_compiled"] else "")
                for launch in row["rounds"]
            )
            versus_stock += f" (median of {len(row['rounds'])} rounds: {each})"
        print(
            f"  {row['name']}: median {row['median_tokens_per_second']} tokens/s per GPU, {versus_stock}, "
            f"MFU {row['median_mfu_percent']}%, peak {row['peak_memory_gib']} GiB reserved "
            f"({row['peak_memory_from_step_5_gib']} from step 5 on; {row['peak_allocated_gib']} allocated), "
            f"first step after {row['seconds_to_first_step']} s"
        )


def compared_steps(run: Run) -> int:
    """The last step at which a full-size run's loss is compared with its reference's."""
    return COMPARED_STEPS_BY_MODEL.get(run.flavor.removesuffix("-torchtitan-moe"), FULL_SIZE_COMPARED_STEPS)


def compare_losses(runs: list[Run]) -> list[str]:
    """Runs whose losses differ from their ``reference``'s by more than ``loss_rel(run)`` (tiny flavors:
    at every step; full-size: over the first ``compared_steps(run)``); runs that logged other
    steps than their reference; a run whose reference is not among ``runs`` is not compared. Each
    launch is compared with its reference's launch of the same round."""
    by_key = {(run.name, run.round): run for run in runs}
    problems = []
    for run in runs:
        reference = by_key.get((run.reference or "", run.round))
        if reference is None:
            continue
        rel = loss_rel(run)
        if run.losses.keys() != reference.losses.keys() or not run.losses:
            problems.append(
                f"{run.label()}: steps {sorted(run.losses)} vs {reference.label()}'s {sorted(reference.losses)}"
            )
            continue
        tiny = run.flavor.startswith("tiny-")
        last = compared_steps(run)
        steps = [s for s in run.losses if tiny or int(s) <= last]
        worst = max(abs(run.losses[s] - reference.losses[s]) / abs(reference.losses[s]) for s in steps)
        if worst > rel:
            where = "" if tiny else f" over steps 1-{last}"
            problems.append(f"{run.label()}: loss differs from {reference.label()}'s by rel {worst:.2e} > {rel}{where}")
    return problems


def environment() -> dict:
    """The machine and versions every run of the suite shares, with the CUDA caching allocator's settings
    every run trains with (``PYTORCH_ALLOC_CONF``, or its older name, else the train entry's default;
    None: torch's defaults)."""
    return {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "commit": source_commit(),
        "date": date.today().isoformat(),
        "allocator_settings": training_allocator_settings() or None,
    }


def plot(result_files: list[str], out: str) -> None:
    """Loss per step (left) and median tokens/s of steps 5 on (right) of every run, one row per file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = []
    for path in result_files:
        with open(path) as f:
            results.append(json.load(f))
    figure, axes = plt.subplots(
        len(results), 2, figsize=(13, 3.6 * len(results)), squeeze=False, gridspec_kw={"width_ratios": [3, 2]}
    )
    for (loss_axis, speed_axis), result in zip(axes, results):
        env = result["environment"]
        title = (
            f"{env['device']} x{env['gpus']}, torch {env['torch']}, triton {env['triton']}, "
            f"batch {local_batch_size(result['runs'][0]['args'])}"
        )
        names, speeds = [], []
        for run in result["runs"]:
            steps = sorted(run["losses"], key=int)
            label = run["name"] if run.get("round", 1) == 1 else f"{run['name']} (round {run['round']})"
            loss_axis.plot(
                [int(s) for s in steps],
                [run["losses"][s] for s in steps],
                label=label,
                linestyle="--" if "repeat" in run["name"] else "-",
            )
            names.append(label)
            speeds.append(round(median_tokens_per_second(run["tokens_per_second"]) or 0))
        loss_axis.set(title=f"loss per step ({title})", xlabel="step", ylabel="loss")
        loss_axis.legend(fontsize=7)
        bars = speed_axis.barh(names, speeds, color="tab:blue")
        speed_axis.bar_label(bars, labels=[f"{v:,}" for v in speeds], fontsize=7, padding=2)
        speed_axis.set(title=f"tokens/s per GPU (median of steps >= {FIRST_MEASURED_STEP})", xlabel="tokens/s")
        speed_axis.xaxis.set_major_formatter(lambda value, _: f"{value / 1000:g}k")
        speed_axis.tick_params(axis="y", labelsize=7)
        speed_axis.invert_yaxis()
        speed_axis.set_xlim(0, max(speeds, default=1) * 1.2)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def device_ids(slot: int, run: Run) -> list[str]:
    """The GPUs ``run`` trains on: its slot's GPU when it takes one (runs side by side), else GPUs 0 on."""
    return [str(slot)] if run.gpus == 1 else [str(gpu) for gpu in range(run.gpus)]


SUITES = ("tiny", "full", "numerics", "scale4", "scale8")
DEFAULT_LOCAL_BATCH_SIZE = {"full": 4, "numerics": 2, "scale4": 1, "scale8": 1}


def suite_runs(suite: str, local_batch_size: int | None = None) -> list[list[Run]]:
    """The batches of runs of ``suite`` (``SUITES``); ``local_batch_size`` None: the suite's default."""
    if suite == "tiny":
        return tiny_runs()
    sequences = local_batch_size or DEFAULT_LOCAL_BATCH_SIZE[suite]
    if suite == "full":
        return full_runs(sequences)
    if suite == "numerics":
        return numerics_runs(sequences)
    return scale_runs(int(suite.removeprefix("scale")), sequences)


def only_matching(batches: list[list[Run]], patterns: list[str]) -> list[list[Run]]:
    """The runs whose names match one of ``patterns`` (regular expressions), with the runs they are
    compared with (their references, transitively), in the suite's order."""
    runs = {run.name: run for batch in batches for run in batch}
    chosen = {name for name in runs if any(re.search(pattern, name) for pattern in patterns)}
    pending = list(chosen)
    while pending:
        reference = runs[pending.pop()].reference
        if reference in runs and reference not in chosen:
            chosen.add(reference)
            pending.append(reference)
    return [kept for batch in batches if (kept := [run for run in batch if run.name in chosen])]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        parser = argparse.ArgumentParser(prog="gpu_training_runs.py plot")
        parser.add_argument("--from", dest="sources", nargs="+", required=True, help="result JSON files")
        parser.add_argument("--out", required=True, help="PNG file to write")
        args = parser.parse_args(argv[1:])
        plot(args.sources, args.out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="REGEX",
        help="run only the runs whose name matches one of these, and the runs they are compared with",
    )
    parser.add_argument(
        "--local-batch-size",
        type=int,
        metavar="N",
        help="full, numerics and scale suites: sequences of 2048 tokens per GPU per step (default: full 4, "
        "numerics 2, scale 1)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="launch the chosen runs N times, round after round (each stock run beside its runs again), "
        "and summarise each run by the median of its rounds (default 1)",
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=540,
        metavar="S",
        help="kill a run still going after S seconds (default 540)",
    )
    args = parser.parse_args(argv)
    if args.local_batch_size is not None and args.local_batch_size < 1:
        parser.error(f"--local-batch-size must be >= 1, got {args.local_batch_size}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.rounds > 1 and args.suite in ("tiny", "numerics"):
        parser.error(f"--rounds times the speed suites (full, scale4, scale8), not {args.suite}")
    batches = suite_runs(args.suite, args.local_batch_size)
    if args.only:
        batches = only_matching(batches, args.only)
    if not batches:
        parser.error(f"no run of the {args.suite} suite matches --only {' '.join(args.only)}")
    needed = 1 + max(int(gpu) for batch in batches for slot, run in enumerate(batch) for gpu in device_ids(slot, run))
    if torch.cuda.device_count() < needed:
        parser.error(
            f"the {args.suite} suite runs on {needed} GPUs of one host; this host has {torch.cuda.device_count()}"
        )
    skipped = runs_that_do_not_fit(
        [run for batch in batches for run in batch], torch.cuda.get_device_properties(0).total_memory
    )
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", flush=True)
    batches = [[run for run in batch if run.name not in skipped] for batch in batches]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.suite == "tiny":
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    runs = []
    machine = environment()
    result, problems = write_results(args.suite, machine, runs, skipped, args.out)
    port = 29600
    for number in range(1, args.rounds + 1):
        for batch in filter(None, batches):
            with ThreadPoolExecutor(len(batch)) as pool:
                futures = []
                for slot, run in enumerate(batch):
                    launched = run.in_round(number)
                    ids = ",".join(device_ids(slot, launched))
                    futures.append(pool.submit(launch, launched, ids, port, env, args.run_timeout))
                    port += 1
                runs += [future.result() for future in futures]
            # After every batch: a suite killed on the way keeps what ran.
            result, problems = write_results(args.suite, machine, runs, skipped, args.out)
    if args.suite != "tiny":
        print_throughput_summary(result["summary"])
    if args.suite == "numerics":
        for probe, band in result["loss_bands"].items():
            print_loss_band(probe, band)
    print("problems:" if problems else "all runs agree", *problems, sep="\n  ")
    return 1 if problems else 0


def last_line(text: str | None) -> str:
    """The last non-blank line of ``text`` ("" for none)."""
    lines = (text or "").strip().splitlines()
    return lines[-1].strip() if lines else ""


def write_results(suite: str, machine: dict, runs: list[Run], skipped: dict, path: str) -> tuple[dict, list[str]]:
    """Write the suite's JSON to ``path``: ``machine`` (``environment()``, read once per suite), runs,
    skipped runs, problems (losses that disagree with each run's reference, runs that failed), but
    for ``tiny`` the throughput summary, and for ``numerics`` each FP8 run's loss band; return it and the
    problems."""
    problems = compare_losses(runs)
    problems += [
        f"{run.name}: exit code {run.returncode}: {last_line(run.error_tail)}" for run in runs if run.returncode != 0
    ]
    result: dict = {
        "environment": machine,
        "suite": suite,
        "runs": [asdict(r) for r in runs],
        "skipped": skipped,
        "problems": problems,
    }
    if suite != "tiny":
        result["summary"] = throughput_summary(runs)
    if suite == "numerics":
        result["loss_bands"] = {probe: loss_band(runs, probe) for probe in NUMERICS_FP8}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result, problems


if __name__ == "__main__":
    sys.exit(main())
