"""A frozen rank ends a CPU job after the CPU default of ``comm.train_timeout_seconds``."""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch

from torchtitan_ext.compat.cpu import adapt_config_for_cpu
from torchtitan_ext.registry import get_flavor

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo adaptation")


def test_cpu_train_timeout_replaces_torchtitan_default_only():
    config = get_flavor("tiny-moe-grouped-mm").build()
    assert config.comm.train_timeout_seconds == 100
    adapt_config_for_cpu(config)
    assert config.comm.train_timeout_seconds == 30
    config.comm.train_timeout_seconds = 7
    adapt_config_for_cpu(config)
    assert config.comm.train_timeout_seconds == 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_stopped_rank_ends_the_job_at_the_cpu_train_timeout(tmp_path):
    """Two ranks without torchrun; rank 1 gets SIGSTOP after step 1; rank 0 fails on gloo's timeout."""
    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "torchtitan_ext.train", "--flavor", "tiny-moe-grouped-mm",
             "--training.steps", "200", "--dump_folder", str(tmp_path / f"rank{rank}"),
             "--metrics.disable_color_printing"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    rank0, rank1 = ranks
    try:
        output = []
        for line in rank0.stdout:
            output.append(line)
            if re.search(r"step:\s+1\s+loss", line):
                rank1.send_signal(signal.SIGSTOP)
                break
        output.append(rank0.communicate(timeout=300)[0])
        text = "".join(output)
        assert rank0.returncode != 0, text[-4000:]
        assert "Timed out waiting 30000ms" in text, text[-4000:]
    finally:
        for process in ranks:
            process.kill()
            process.wait()
