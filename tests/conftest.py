# --- kernels: Triton interpreter on machines without CUDA -------------------------------
# Must run before any test module imports triton: with no CUDA, the fused MoE kernel tests
# run through Triton's CPU interpreter. A value already set in the environment wins.
import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end kernels -------------------------------------------------------------------------

# --- torchvision built for another torch --------------------------------------------------
# transformers imports torchvision when it finds one (for image models only); a torchvision
# built for another torch fails on import ("operator torchvision::nms does not exist"), and
# every model class of transformers then fails to import. The MoE language models these tests
# build need no torchvision: one that cannot be imported is hidden, so transformers sees none.
if importlib.util.find_spec("torchvision") is not None:
    try:
        importlib.import_module("torchvision")
    except Exception:
        sys.modules["torchvision"] = None  # type: ignore[assignment]
# --- end torchvision ---------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="session")
def private_project_cache(tmp_path_factory):
    """The flavor listing and the "auto" backend choices are cached in a per-session folder,
    never in the user's ``~/.cache/torchtitan_ext`` (subprocesses inherit it)."""
    os.environ["TORCHTITAN_EXT_CACHE"] = str(tmp_path_factory.mktemp("torchtitan_ext_cache"))


LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torchrun's variables, which the train entry run in this process sets for a world of one."""


@pytest.fixture(autouse=True)
def launch_variables_stay_in_their_test():
    """A test that runs the train entry in this process leaves torchrun's variables set; a later test's
    subprocess would inherit them and take itself for a rank of a launch. Each test's values are
    undone after it."""
    before = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
