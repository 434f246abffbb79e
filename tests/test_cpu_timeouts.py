"""A frozen rank ends a CPU job after the CPU default of ``comm.train_timeout_seconds``."""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from helpers import free_port

from torchtitan_ext.compat.cpu import adapt_config_for_cpu
from torchtitan_ext.registry import get_flavor

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="gloo timeouts of CPU training (compat.cpu); CUDA runs keep torchtitan's"
)


def test_cpu_train_timeout_replaces_torchtitan_default_only():
    config = get_flavor("tiny-moe-grouped-mm").build()
    assert config.comm.train_timeout_seconds == 100
    adapt_config_for_cpu(config)
    assert config.comm.train_timeout_seconds == 30
    config.comm.train_timeout_seconds = 7
    adapt_config_for_cpu(config)
    assert config.comm.train_timeout_seconds == 7


@pytest.mark.slow
def test_stopped_rank_ends_the_job_at_the_train_timeout(tmp_path):
    """Two ranks without torchrun; rank 1 gets SIGSTOP after step 2; rank 0 fails on gloo's timeout.

    Step 2 is the first under ``comm.train_timeout_seconds`` on both ranks (torchtitan sets it
    after a barrier at the end of step 1).
    """
    port = str(free_port())
    rank0_log = tmp_path / "rank0.log"
    ranks = []
    with open(rank0_log, "w") as rank0_output:  # each process keeps its own copy of the descriptor
        for rank in (0, 1):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            output = rank0_output if rank == 0 else subprocess.PIPE
            ranks.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "torchtitan_ext.train",
                        "--flavor",
                        "tiny-moe-grouped-mm",
                        "--training.steps",
                        "200",
                        "--comm.train_timeout_seconds",
                        "5",
                        "--dump_folder",
                        str(tmp_path / f"rank{rank}"),
                        "--metrics.disable_color_printing",
                    ],
                    env=env,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    rank0, rank1 = ranks
    try:
        assert rank1.stdout is not None
        for line in rank1.stdout:
            if re.search(r"step:\s+2\s+loss", line):
                rank1.send_signal(signal.SIGSTOP)
                break
        rank0.wait(timeout=300)
        text = rank0_log.read_text()
        assert rank0.returncode != 0, text[-4000:]
        assert "Timed out waiting 5000ms" in text, text[-4000:]
    finally:
        for process in ranks:
            process.kill()
            process.wait()
