"""CPU runs drop the torchtitan log lines and Python warnings that mean nothing there,
triggered from their real sources where that is cheap, and keep every other message."""

import contextlib
import logging
import types
import warnings

import pytest
import torch
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import get_peak_flops

from torchtitan_ext.compat import quiet_cpu
from torchtitan_ext.compat.quiet_cpu import quiet_cpu_warnings


@contextlib.contextmanager
def quieted(monkeypatch, caplog, *, on_cpu: bool):
    """``quiet_cpu_warnings()`` (called twice: idempotent) on a machine with or without CUDA;
    yields the Python warnings recorded after it."""
    monkeypatch.setattr(quiet_cpu, "cpu_training", lambda: on_cpu)
    monkeypatch.setattr(logger, "filters", [])
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        quiet_cpu_warnings()
        quiet_cpu_warnings()
        yield recorded


@pytest.fixture
def quiet(monkeypatch, caplog):
    """As on a CPU machine; every other warning recorded."""
    with quieted(monkeypatch, caplog, on_cpu=True) as recorded:
        yield recorded


def test_torchtitan_log_lines_are_dropped(quiet, caplog):
    from torchtitan.components.checkpoint import CheckpointManager

    CheckpointManager.Config()  # initial_load_model_only=True without an initial_load_path
    get_peak_flops("x86_64")  # lspci, then the A100 fallback
    logger.info("Peak FLOPS used for computing MFU: 3.120e+14")
    logger.warning("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config")
    logger.warning("model.safetensors.index.json not found at hf_assets_path: /x/model.safetensors.index.json.")
    logger.info("CPU memory usage for model: 0.55GiB(2.36%)")
    logger.warning("Warmup steps (5) exceed total steps (2). Adjusting warmup steps to 2.")
    assert [record.getMessage() for record in caplog.records] == [
        "Warmup steps (5) exceed total steps (2). Adjusting warmup steps to 2."
    ]
    assert sum(isinstance(f, quiet_cpu._DropMessages) for f in logger.filters) == 1


def test_python_warnings_are_ignored(quiet):
    from torch.distributed.tensor._random import is_rng_supported_mesh

    # pyrefly: ignore[missing-attribute]  # torch's stubs lack set_vital, which it has at run time
    torch.set_vital("Dataloader", "enabled", "True")
    with torch.autocast(device_type="cpu", dtype=torch.float32):
        pass
    # pyrefly: ignore[bad-argument-type]  # a stand-in: the check reads only the mesh's device type
    is_rng_supported_mesh(types.SimpleNamespace(device_type="cpu"))
    warnings.warn("DTensor manual_seed() may not have complete support on cpu device mesh", UserWarning, stacklevel=1)
    warnings.warn("a warning that matters", UserWarning, stacklevel=1)
    assert [str(w.message) for w in quiet] == ["a warning that matters"]


def test_nothing_is_silenced_with_cuda(monkeypatch, caplog):
    with quieted(monkeypatch, caplog, on_cpu=False) as recorded:
        # pyrefly: ignore[missing-attribute]  # torch's stubs lack set_vital, which it has at run time
        torch.set_vital("Dataloader", "enabled", "True")
        logger.info("Peak FLOPS used for computing MFU: 9.890e+14")
    assert len(recorded) == 1 and len(caplog.records) == 1
