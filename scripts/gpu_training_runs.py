"""Training runs on the GPUs of one host through the train entry, recorded as JSON.

    python scripts/gpu_training_runs.py tiny --out train_tiny.json   # every tiny flavor, EP 1 and 2
    python scripts/gpu_training_runs.py full --out train_full.json   # olmoe-1b-7b compiled: stock, grouped_mm, triton
    python scripts/gpu_training_runs.py plot --from train_full.json ... --out train.png

``tiny``: each tiny flavor (fp32) for 30 steps on one GPU (EP 1; two runs side by side, one per
GPU) and on two GPUs with EP 2 over each EP transport; tiny-moe-triton once more on one GPU with
the Triton cache the first run filled (warm start). Every backend's losses must equal for_loop's
of the same layout to rel 1e-4.
``full``: olmoe-1b-7b on two GPUs (FSDP 2, EP 2, bf16), 20 steps of ``--local-batch-size`` x 2048
tokens per GPU (default 4: an H100's 80 GB; an H200 takes 8): torchtitan's own MoE layers compiled
(``--compile.enable``, the baseline) and eager, and the project's layers compiled with grouped_mm,
triton over each EP transport, and triton over symm_mem with static received rows under CUDA
graphs; triton over symm_mem eager for reference. Every loss must be within 2% of the baseline's
at the same step. Printed per run: the median tokens/s over steps 5-20 (after warm-up and the first
compilations), its ratio to the baseline, peak memory and the seconds to the first step.
Per run: losses, tokens/s, MFU, peak memory (rank 0's log) and the seconds from launch to the
first step's log line. The JSON carries the device, torch, triton and NCCL versions and the commit
(``SOURCE_COMMIT`` where the tree has no git metadata).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import date

import torch
import triton

from torchtitan_ext.bench.common import source_commit
from torchtitan_ext.experiments.moe_backends.experts import backend_names
from torchtitan_ext.experiments.moe_backends.flavors import tiny_flavor_name

TINY_BACKENDS = backend_names()
STEP_LINE = re.compile(
    r"step:\s+(?P<step>\d+)\s+loss:\s+(?P<loss>[0-9.]+).*?memory:\s+(?P<memory>[0-9.]+)GiB"
    r".*?tps:\s+(?P<tps>[0-9,]+)(?:.*?mfu:\s+(?P<mfu>[0-9.]+)%)?"
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Run:
    """One training launch and what its rank 0 logged."""

    name: str
    flavor: str
    gpus: int
    args: list[str]
    returncode: int | None = None
    seconds_to_first_step: float | None = None
    wall_seconds: float | None = None
    losses: dict[int, float] = field(default_factory=dict)
    tokens_per_second: dict[int, int] = field(default_factory=dict)
    mfu_percent: dict[int, float] = field(default_factory=dict)
    peak_memory_gib: float | None = None
    error_tail: str | None = None


def launch(run: Run, device_ids: str, port: int, env: dict[str, str]) -> Run:
    """Train ``run`` on ``device_ids`` under torchrun; fill in what rank 0 logged."""
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
    )
    assert process.stdout is not None
    lines = []
    for raw_line in process.stdout:
        line = ANSI.sub("", raw_line)
        lines.append(line)
        match = STEP_LINE.search(line)
        if match:
            step = int(match["step"])
            if run.seconds_to_first_step is None:
                run.seconds_to_first_step = round(time.monotonic() - started, 1)
            run.losses[step] = float(match["loss"])
            run.tokens_per_second[step] = int(match["tps"].replace(",", ""))
            if match["mfu"] is not None:
                run.mfu_percent[step] = float(match["mfu"])
            run.peak_memory_gib = max(run.peak_memory_gib or 0.0, float(match["memory"]))
    run.returncode = process.wait()
    run.wall_seconds = round(time.monotonic() - started, 1)
    if run.returncode != 0 or not run.losses:
        run.error_tail = "".join(lines[-60:])
    print(
        f"{run.name}: rc {run.returncode}, first step after {run.seconds_to_first_step} s, "
        f"{len(run.losses)} steps, last loss {run.losses.get(max(run.losses, default=0))}, "
        f"median tokens/s {median_tokens_per_second(run.tokens_per_second)}",
        flush=True,
    )
    return run


def median_tokens_per_second(tokens_per_second: dict, first_step: int = 5) -> float | None:
    """Median tokens/s (per GPU, as torchtitan logs it) over the steps from ``first_step`` on;
    ``tokens_per_second`` maps each step (int, or str as read from JSON) to its tokens/s."""
    values = [tps for step, tps in tokens_per_second.items() if int(step) >= first_step]
    return float(statistics.median(values)) if values else None


def local_batch_size(run_args: list[str]) -> str:
    """The ``--training.local_batch_size`` a run was launched with ("flavor's" when not given)."""
    flag = "--training.local_batch_size"
    return run_args[run_args.index(flag) + 1] if flag in run_args else "flavor's"


def tiny_runs() -> list[list[Run]]:
    """Batches of runs that share the host: EP 1 pairs side by side, then each EP 2 run alone."""
    steps = ["--training.steps", "30"]
    ep1 = [Run(f"{b} ep1 1gpu", tiny_flavor_name(b), 1, steps) for b in TINY_BACKENDS]
    batches = [ep1[i : i + 2] for i in range(0, len(ep1), 2)]
    batches.append([Run("triton ep1 1gpu warm cache", "tiny-moe-triton", 1, steps)])
    for transport in ("all_to_all", "symm_mem"):
        for backend in TINY_BACKENDS:
            batches.append(
                [
                    Run(
                        f"{backend} ep2 {transport}",
                        tiny_flavor_name(backend),
                        2,
                        [
                            *steps,
                            "--parallelism.expert_parallel_degree",
                            "2",
                            *(["--toml", "examples/ep_symm_mem.toml"] if transport == "symm_mem" else []),
                        ],
                    )
                ]
            )
    return batches


COMPILE = ["--compile.enable"]
TRITON = ["--toml", "examples/triton.toml"]
SYMM_MEM = ["--toml", "examples/ep_symm_mem.toml"]
CUDA_GRAPHS = ["--moe.ep_receive_rows", "static", "--training.no-disable-cuda-graphs"]
STOCK_COMPILED = "olmoe torchtitan-moe compiled"
"""The run every other run's throughput is compared with: torchtitan's own MoE layers, compiled."""


def full_runs(local_batch_size: int) -> list[list[Run]]:
    args = [
        "--training.steps",
        "20",
        "--training.local_batch_size",
        str(local_batch_size),
        "--training.seq_len",
        "2048",
        "--parallelism.expert_parallel_degree",
        "2",
        "--metrics.log_freq",
        "1",
    ]
    runs = [
        Run(STOCK_COMPILED, "olmoe-1b-7b-torchtitan-moe", 2, [*args, *COMPILE]),
        Run("olmoe grouped_mm compiled", "olmoe-1b-7b", 2, [*args, *COMPILE]),
        Run("olmoe triton compiled", "olmoe-1b-7b", 2, [*args, *TRITON, *COMPILE]),
        Run("olmoe triton compiled symm_mem", "olmoe-1b-7b", 2, [*args, *TRITON, *SYMM_MEM, *COMPILE]),
        Run(
            "olmoe triton compiled symm_mem cuda_graphs",
            "olmoe-1b-7b",
            2,
            [*args, *TRITON, *SYMM_MEM, *COMPILE, *CUDA_GRAPHS],
        ),
        Run("olmoe torchtitan-moe eager", "olmoe-1b-7b-torchtitan-moe", 2, args),
        Run("olmoe triton eager symm_mem", "olmoe-1b-7b", 2, [*args, *TRITON, *SYMM_MEM]),
    ]
    return [[run] for run in runs]


def print_throughput_ratios(runs: list[Run]) -> None:
    """Each run's median tokens/s over torchtitan's MoE layers compiled (``STOCK_COMPILED``), with its
    peak memory and the seconds to its first step (compilation included)."""
    stock = next((run for run in runs if run.name == STOCK_COMPILED), None)
    stock_tps = median_tokens_per_second(stock.tokens_per_second) if stock else None
    for run in runs:
        tps = median_tokens_per_second(run.tokens_per_second)
        ratio = f"{tps / stock_tps:.2f}x torchtitan's MoE compiled" if tps and stock_tps else "no ratio"
        print(
            f"  {run.name}: median {tps} tokens/s per GPU, {ratio}, peak {run.peak_memory_gib} GiB, "
            f"first step after {run.seconds_to_first_step} s"
        )


def compare_losses(runs: list[Run], reference_of, rel: float) -> list[str]:
    """Runs whose losses differ from ``reference_of(run)``'s (None: not compared) by more than ``rel``."""
    problems = []
    for run in runs:
        reference = reference_of(run)
        if reference is None or reference is run:
            continue
        if run.losses.keys() != reference.losses.keys() or not run.losses:
            problems.append(f"{run.name}: steps {sorted(run.losses)} vs {reference.name}'s {sorted(reference.losses)}")
            continue
        worst = max(abs(run.losses[s] - reference.losses[s]) / abs(reference.losses[s]) for s in run.losses)
        if worst > rel:
            problems.append(f"{run.name}: loss differs from {reference.name}'s by rel {worst:.2e} > {rel}")
    return problems


def same_layout_for_loop(runs: list[Run]):
    """The for_loop run of a run's layout (the name after the backend); warm-cache reruns excluded."""
    by_name = {run.name: run for run in runs}

    def reference_of(run: Run) -> Run | None:
        layout = run.name.partition(" ")[2]
        return None if "warm" in layout else by_name.get(f"for_loop {layout}")

    return reference_of


def environment() -> dict:
    return {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "commit": source_commit(),
        "date": date.today().isoformat(),
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
            loss_axis.plot(
                [int(s) for s in steps],
                [run["losses"][s] for s in steps],
                label=run["name"],
                linestyle="--" if "repeat" in run["name"] else "-",
            )
            names.append(run["name"])
            speeds.append(round(median_tokens_per_second(run["tokens_per_second"]) or 0))
        loss_axis.set(title=f"loss per step ({title})", xlabel="step", ylabel="loss")
        loss_axis.legend(fontsize=7)
        bars = speed_axis.barh(names, speeds, color="tab:blue")
        speed_axis.bar_label(bars, labels=[f"{v:,}" for v in speeds], fontsize=7, padding=2)
        speed_axis.set(title="tokens/s per GPU (median of steps >= 5)", xlabel="tokens/s")
        speed_axis.tick_params(axis="y", labelsize=7)
        speed_axis.invert_yaxis()
        speed_axis.set_xlim(0, max(speeds, default=1) * 1.2)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def main() -> int:
    if sys.argv[1:2] == ["plot"]:
        parser = argparse.ArgumentParser(prog="gpu_training_runs.py plot")
        parser.add_argument("--from", dest="sources", nargs="+", required=True, help="result JSON files")
        parser.add_argument("--out", required=True, help="PNG file to write")
        args = parser.parse_args(sys.argv[2:])
        plot(args.sources, args.out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=("tiny", "full"))
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--only", nargs="+", metavar="REGEX", help="run only the runs whose name matches one of these")
    parser.add_argument(
        "--local-batch-size",
        type=int,
        default=4,
        metavar="N",
        help="full suite: sequences of 2048 tokens per GPU per step (default 4)",
    )
    args = parser.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.suite == "tiny":
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    if args.local_batch_size < 1:
        parser.error(f"--local-batch-size must be >= 1, got {args.local_batch_size}")
    batches = tiny_runs() if args.suite == "tiny" else full_runs(args.local_batch_size)
    if args.only:
        batches = [[r for r in batch if any(re.search(p, r.name) for p in args.only)] for batch in batches]
        batches = [batch for batch in batches if batch]
    runs = []
    port = 29600
    for batch in batches:
        with ThreadPoolExecutor(len(batch)) as pool:
            futures = []
            for slot, run in enumerate(batch):
                devices = str(slot) if run.gpus == 1 else ",".join(map(str, range(run.gpus)))
                futures.append(pool.submit(launch, run, devices, port, env))
                port += 1
            runs += [future.result() for future in futures]
    if args.suite == "tiny":
        problems = compare_losses(runs, same_layout_for_loop(runs), 1e-4)
    else:
        problems = compare_losses(runs, lambda run: runs[0], 0.02)
    problems += [f"{run.name}: exit code {run.returncode}" for run in runs if run.returncode != 0]
    if args.suite == "full":
        print_throughput_ratios(runs)
    result = {
        "environment": environment(),
        "suite": args.suite,
        "runs": [asdict(r) for r in runs],
        "problems": problems,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("problems:" if problems else "all runs agree", *problems, sep="\n  ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
