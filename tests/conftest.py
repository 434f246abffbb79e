# --- kernels: Triton interpreter on machines without CUDA -------------------------------
# Must run before any test module imports triton: with no CUDA, the fused MoE kernel tests
# run through Triton's CPU interpreter. A value already set in the environment wins.
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end kernels -------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="session")
def private_project_cache(tmp_path_factory):
    """The flavor listing and the "auto" backend choices are cached in a per-session folder,
    never in the user's ``~/.cache/torchtitan_ext`` (subprocesses inherit it)."""
    os.environ["TORCHTITAN_EXT_CACHE"] = str(tmp_path_factory.mktemp("torchtitan_ext_cache"))
