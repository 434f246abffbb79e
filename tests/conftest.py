# --- kernels: Triton interpreter on machines without CUDA -------------------------------
# Must run before any test module imports triton: with no CUDA, the fused MoE kernel tests
# run through Triton's CPU interpreter. A value already set in the environment wins.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end kernels -------------------------------------------------------------------------
