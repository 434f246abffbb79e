"""The launcher form of the train entry: torchrun options first, start-up errors once, exit 2."""

import subprocess
import sys

import pytest

from torchtitan_ext.launch import split_launcher_args


def test_leading_torchrun_options_are_split_from_training_arguments():
    launcher, rest = split_launcher_args(
        ["--nproc_per_node=2", "--nnodes", "1", "--standalone", "--flavor", "tiny-moe-grouped-mm", "--nnodes", "3"]
    )
    assert launcher == ["--nproc_per_node=2", "--nnodes", "1", "--standalone"]
    assert rest == ["--flavor", "tiny-moe-grouped-mm", "--nnodes", "3"]
    assert split_launcher_args(["--flavor", "x", "--nproc_per_node=2"]) == ([], ["--flavor", "x", "--nproc_per_node=2"])


@pytest.mark.slow
def test_startup_error_of_the_workers_is_the_last_line_and_exit_code_2(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_ext.train",
            "--nproc_per_node=1",
            "--flavor",
            "tiny-moe-grouped-mm",
            "--parallelism.expert_parallel_degree",
            "2",
            "--dump_folder",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: parallelism.expert_parallel_degree (2)"), lines[-5:]
    assert "--nproc_per_node=2" in lines[-1]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert sum("expert_parallel_degree (2)" in line for line in lines) == 1
