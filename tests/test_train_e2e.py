"""End-to-end training through the real entry point: torchrun, gloo, EP=2, checkpoints."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import free_port

from torchtitan_ext.experiments.moe_backends.experts import backend_names
from torchtitan_ext.experiments.moe_backends.flavors import tiny_flavor_name

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="CPU/gloo end-to-end runs (GPU runs: scripts/measure_on_gpu.sh train-tiny)"
    ),
]

STEP_LOSS = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")


def train(args: list[str], dump_folder, nproc: int = 1, subcommands: tuple[str, ...] = ()) -> dict[int, float]:
    """Run the train entry (under torchrun when ``nproc`` > 1); return {step: loss} of rank 0.

    ``subcommands`` (torchtitan's choices such as ``activation-checkpoint:full``) go last.
    """
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        "--local-ranks-filter=0",
        "-m",
    ]
    command = launcher if nproc > 1 else [sys.executable, "-m"]
    result = subprocess.run(
        [
            *command,
            "torchtitan_ext.train",
            *args,
            "--dump_folder",
            str(dump_folder),
            "--metrics.disable_color_printing",
            *subcommands,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    losses = {int(step): float(loss) for step, loss in STEP_LOSS.findall(output)}
    assert losses, output[-4000:]
    return losses


# The fused Triton backend runs through Triton's (slow) interpreter on CPU: it gets a
# smaller run of its own below.
TORCH_BACKENDS = [b for b in backend_names() if b != "triton"]
SMALL_BATCH = ["--training.local_batch_size", "2", "--training.seq_len", "32"]


@pytest.fixture(scope="module")
def ep2_runs(tmp_path_factory):
    """Six steps of each backend's tiny flavor, 2 processes, expert parallel degree 2."""
    return {
        backend: train(
            [
                "--flavor",
                tiny_flavor_name(backend),
                "--training.steps",
                "6",
                "--parallelism.expert_parallel_degree",
                "2",
            ],
            tmp_path_factory.mktemp(backend),
            nproc=2,
        )
        for backend in TORCH_BACKENDS
    }


def test_loss_decreases_under_torchrun_with_ep2(ep2_runs):
    for backend, losses in ep2_runs.items():
        assert sorted(losses) == list(range(1, 7)), backend
        assert losses[6] < losses[1] - 0.3, (backend, losses)


def test_backends_give_the_same_first_step_loss(ep2_runs):
    reference = ep2_runs["for_loop"][1]
    for backend, losses in ep2_runs.items():
        assert losses[1] == pytest.approx(reference, rel=1e-4), backend


def test_two_pipeline_stages_train_and_rank_0_shows_the_loss(tmp_path):
    """``--parallelism.pp 2``: the loss, computed on the last stage, is in rank 0's log (torchtitan logs -1
    there, which the step pattern would not match)."""
    args = ["--flavor", "tiny-moe-grouped-mm", "--training.steps", "4", "--parallelism.pp", "2", *SMALL_BATCH]
    losses = train(args, tmp_path, nproc=2)
    assert sorted(losses) == [1, 2, 3, 4]
    assert losses[4] < losses[1] - 0.1, losses


def test_triton_backend_trains_like_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    losses = {
        backend: train(
            ["--flavor", tiny_flavor_name(backend), "--training.steps", "2", *SMALL_BATCH], tmp_path / backend
        )
        for backend in ("for_loop", "triton")
    }
    for step in (1, 2):
        assert losses["triton"][step] == pytest.approx(losses["for_loop"][step], rel=1e-4), step


def test_checkpoint_continues_with_another_backend(tmp_path):
    """A grouped_mm checkpoint resumes under for_loop exactly as under grouped_mm."""
    checkpointing = ["--checkpoint.enable", "--checkpoint.interval", "3"]
    saved = tmp_path / "saved"
    first_part = train(["--flavor", "tiny-moe-grouped-mm", "--training.steps", "3", *checkpointing], saved)
    assert sorted(first_part) == [1, 2, 3]

    resumed = {}
    for backend in ("grouped_mm", "for_loop"):
        folder = tmp_path / backend
        shutil.copytree(saved, folder)
        resumed[backend] = train(
            ["--flavor", tiny_flavor_name(backend), "--training.steps", "5", *checkpointing], folder
        )
        assert sorted(resumed[backend]) == [4, 5], backend
    for step in (4, 5):
        assert resumed["for_loop"][step] == pytest.approx(resumed["grouped_mm"][step], rel=1e-4)


def test_activation_checkpointing_modes_train_like_no_checkpointing(tmp_path):
    """EP=2 training with selective or full checkpointing gives the losses of no checkpointing.

    (symm_mem with the flavors' default selective checkpointing is compared with EP=1 in
    tests/test_ep_equivalence.py.)
    """
    args = [
        "--flavor",
        "tiny-moe-grouped-mm",
        "--training.steps",
        "2",
        *SMALL_BATCH,
        "--parallelism.expert_parallel_degree",
        "2",
    ]
    losses = {
        mode: train(args, tmp_path / mode, nproc=2, subcommands=(f"activation-checkpoint:{mode}",))
        for mode in ("none", "selective", "full")
    }
    assert sorted(losses["none"]) == [1, 2]
    for mode in ("selective", "full"):
        for step, loss in losses["none"].items():
            assert losses[mode][step] == pytest.approx(loss, rel=1e-5), (mode, step)


NOISE = (
    "Sleeping 2 seconds",  # the wait for other ranks, in a run of one
    "torchtitan version:",  # before the config was read
    "Warmup",  # torchtitan shortening the flavor's schedule to a short run
    "memory usage for model",  # on CPU, the whole process's peak
    "UserWarning",  # the lr scheduler's get_lr() on resume
    "Traceback",
)


def test_a_short_single_process_run_and_its_resume_say_only_what_matters(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    outputs = []
    for steps in ("3", "5"):  # the second run resumes from the first's step-3 checkpoint
        result = subprocess.run(
            [
                *(sys.executable, "-m", "torchtitan_ext.train", "--flavor", "tiny-moe-grouped-mm"),
                *("--training.steps", steps, "--checkpoint.enable", "--checkpoint.interval", "3"),
                *("--dump_folder", str(tmp_path)),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        outputs.append(output)
    assert "Training starts at step 4" in outputs[1]
    for output in outputs:
        assert output.count("CPU: 1 thread(s) per process, OMP_NUM_THREADS=1") == 1, output[-4000:]
        assert [noise for noise in NOISE if noise in output] == [], output[-4000:]
    assert not (tmp_path / "comm_traces").exists()
