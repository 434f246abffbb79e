"""The launcher form of the train entry: torchrun options first, start-up errors once, exit 2."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from torchtitan_ext import train
from torchtitan_ext.launch import (
    ALLOCATOR_DEFAULT,
    ALLOCATOR_ENV,
    ERROR_FOLDER_ENV,
    INTERRUPTED_EXIT_CODE,
    allocator_description,
    allocator_settings,
    first_startup_error,
    report_startup_error,
    set_allocator_default,
    split_launcher_args,
    training_allocator_settings,
)


def test_leading_torchrun_options_are_split_from_training_arguments():
    launcher, rest = split_launcher_args(
        ["--nproc_per_node=2", "--nnodes", "1", "--standalone", "--flavor", "tiny-moe-grouped-mm", "--nnodes", "3"]
    )
    assert launcher == ["--nproc_per_node=2", "--nnodes", "1", "--standalone"]
    assert rest == ["--flavor", "tiny-moe-grouped-mm", "--nnodes", "3"]
    assert split_launcher_args(["--flavor", "x", "--nproc_per_node=2"]) == ([], ["--flavor", "x", "--nproc_per_node=2"])


@pytest.mark.parametrize(
    ("environ", "settings"),
    [
        ({}, ALLOCATOR_DEFAULT),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, "expandable_segments:False"),
        ({"PYTORCH_ALLOC_CONF": ""}, ""),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "max_split_size_mb:512"),
        ({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8", "PYTORCH_CUDA_ALLOC_CONF": "x"}, None),
    ],
    ids=["unset", "set", "set to nothing", "older name", "both names"],
)
def test_the_allocator_default_applies_only_where_the_environment_names_no_settings(environ, settings):
    given = dict(environ)
    set_allocator_default(environ)
    if settings is None:  # torch reads PYTORCH_ALLOC_CONF first
        assert environ == given and allocator_settings(environ) == "garbage_collection_threshold:0.8"
        return
    assert allocator_settings(environ) == settings
    assert environ == (given or {"PYTORCH_ALLOC_CONF": ALLOCATOR_DEFAULT})


def test_a_training_process_runs_with_the_environments_allocator_settings_else_the_default():
    assert training_allocator_settings({}) == ALLOCATOR_DEFAULT
    assert training_allocator_settings({"PYTORCH_ALLOC_CONF": ""}) == ""
    assert training_allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == "max_split_size_mb:512"


def test_the_start_up_line_says_where_the_allocator_settings_come_from():
    assert allocator_description({}) == "torch's defaults (PYTORCH_ALLOC_CONF is empty or unset)"
    assert (
        allocator_description({"PYTORCH_ALLOC_CONF": ""}) == "torch's defaults (PYTORCH_ALLOC_CONF is empty or unset)"
    )
    default = {"PYTORCH_ALLOC_CONF": ALLOCATOR_DEFAULT}
    assert allocator_description(default) == (
        "expandable_segments:True (the train entry's default; PYTORCH_ALLOC_CONF replaces it)"
    )
    given = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert allocator_description(given) == "max_split_size_mb:512 (from the environment)"


@pytest.mark.parametrize("launcher", [[], ["--nproc_per_node=2"]], ids=["one process", "torchrun"])
def test_the_train_entry_sets_the_allocator_default_before_it_trains_or_launches(monkeypatch, launcher):
    """Both ways the train entry trains start with the default in the environment torch and the
    processes torchrun starts read."""
    for name in ALLOCATOR_ENV:
        monkeypatch.setenv(name, "")  # recorded, so that the end of the test restores the variables
        monkeypatch.delenv(name)
    seen = []

    def record(args):
        seen.append(allocator_settings())
        return 0

    monkeypatch.setattr(train, "launch", record)
    monkeypatch.setattr("torchtitan_ext.run_training.run", record)
    assert train.main([*launcher, "--flavor", "tiny-moe-grouped-mm"]) == 0
    assert seen == [ALLOCATOR_DEFAULT]


cpu_runs = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo runs: two processes need two GPUs")


def launched(tmp_path, nproc: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The train entry as a launcher of ``nproc`` processes of the tiny flavor, dumping into ``tmp_path``."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_ext.train",
            f"--nproc_per_node={nproc}",
            "--flavor",
            "tiny-moe-grouped-mm",
            "--dump_folder",
            str(tmp_path / "outputs"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def assert_one_startup_error(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit code 2, ``message`` once and as the last line, no traceback of torchrun or a worker."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: {message}"), lines[-5:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert "closing signal" not in result.stderr and "exitcode" not in result.stderr, lines[-5:]
    assert sum(message in line for line in lines) == 1


@pytest.mark.slow
@cpu_runs
@pytest.mark.parametrize("nproc", [1, 2])
def test_startup_error_of_the_workers_is_the_last_line_and_exit_code_2(tmp_path, nproc):
    result = launched(tmp_path, nproc, "--parallelism.expert_parallel_degree", "4")
    assert_one_startup_error(result, "command line: parallelism.expert_parallel_degree = 4: needs at least 4 processes")
    assert "--nproc_per_node=4" in result.stderr


RANK_1_REFUSES = """
import os

if os.environ.get("RANK") == "1":
    from torchtitan_ext.config import ConfigError
    from torchtitan_ext.config.checks import register_config_check

    @register_config_check
    def refuse_on_rank_1(config):
        raise ConfigError("rank 1 refuses this configuration")
"""
"""A ``sitecustomize`` that makes rank 1 alone refuse the configuration, at start-up."""


@pytest.mark.slow
@cpu_runs
def test_the_first_failing_rank_is_reported_whichever_rank_it_is(tmp_path):
    """Rank 1 fails; rank 0 waits for it in the rendezvous and is stopped by torchrun, writing nothing."""
    (tmp_path / "sitecustomize.py").write_text(RANK_1_REFUSES)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    result = launched(tmp_path, 2, "--training.steps", "2", env={**os.environ, "PYTHONPATH": path})
    assert_one_startup_error(result, "rank 1 refuses this configuration")


def test_the_launcher_prints_the_error_written_first(tmp_path, monkeypatch):
    monkeypatch.setenv(ERROR_FOLDER_ENV, str(tmp_path))
    assert first_startup_error(str(tmp_path)) is None
    for rank, message in (("1", "written first"), ("0", "written second")):
        monkeypatch.setenv("RANK", rank)
        assert report_startup_error(message)
        time.sleep(0.01)
    assert first_startup_error(str(tmp_path)) == "written first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.txt", "rank-1.txt"]


def interrupted(tmp_path, *launcher: str) -> subprocess.CompletedProcess:
    """A tiny run interrupted as Ctrl-C does, once its second step is logged: SIGINT to its process group."""
    # SIGINT handled here (not ignored, as under a background test runner): the child starts with the default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        command = subprocess.Popen(
            [
                *(sys.executable, "-m", "torchtitan_ext.train", *launcher, "--flavor", "tiny-moe-grouped-mm"),
                *("--training.steps", "500", "--dump_folder", str(tmp_path / "outputs")),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            process_group=0,  # a group of its own, as a terminal's job
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert command.stdout is not None
    stdout = []
    for line in command.stdout:
        stdout.append(line)
        if re.search(r"step:\s+2\s", line):
            os.killpg(command.pid, signal.SIGINT)
            break
    out, err = command.communicate(timeout=120)
    return subprocess.CompletedProcess(command.args, command.returncode, "".join(stdout) + out, err)


@pytest.mark.slow
@cpu_runs
@pytest.mark.parametrize("launcher", [[], ["--nproc_per_node=2"]], ids=["one process", "two processes"])
def test_ctrl_c_ends_a_run_with_one_line_and_its_summary(tmp_path, launcher):
    result = interrupted(tmp_path, *launcher)
    assert result.returncode == INTERRUPTED_EXIT_CODE, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.strip()][-1].startswith("interrupted (Ctrl-C)")
    assert result.stderr.count("interrupted (Ctrl-C)") == 1, result.stderr
    assert re.search(r"run summary \(interrupted\): \d+ steps run", result.stdout), result.stdout[-3000:]
    assert "OMP_NUM_THREADS environment variable" not in result.stderr  # torchrun's notice
