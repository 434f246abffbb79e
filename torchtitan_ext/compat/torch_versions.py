"""Fixes torchtitan 0.3.0 needs on the torch it runs on, applied on every device.

torchtitan 0.3.0 was written against a torch newer than 2.13 in two places. Each fix
is applied only where the running torch lacks what torchtitan calls, on CPU and GPU
alike, names the torchtitan code it answers, and is covered by ``tests/test_compat.py``
(which fails loudly when a torch or torchtitan upgrade makes a fix unneeded or wrong).

- ``distributed/utils.py`` ``set_pg_timeouts`` calls ``torch.distributed.set_timeout``
  (torch >= 2.14) after the first step; on torch 2.13 every run died there. The fix sets
  each group's timeout through c10d's per-group setter, after the same barrier.
- ``models/common/token_dispatcher.py`` reads ``torch.compiler._is_non_strict_tracing``
  (torch >= 2.13); the benchmarks also run on older torch builds (2.11 on the GPU image).
"""

from datetime import timedelta

import torch
import torch.distributed as dist
import torchtitan.distributed.utils as titan_dist_utils

original_set_pg_timeouts = titan_dist_utils.set_pg_timeouts


def set_pg_timeouts_per_group(timeout: timedelta, parallel_dims) -> None:
    """torchtitan's ``set_pg_timeouts`` through ``_set_pg_timeout`` (torch without ``set_timeout``).

    Barrier first (on the current GPU under NCCL), so no rank issues a collective under the
    new timeout while a slower one still runs under the old.
    """
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    else:
        dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def needs_set_timeout_fix() -> bool:
    return not hasattr(dist, "set_timeout")


def needs_non_strict_tracing_fix() -> bool:
    return not hasattr(torch.compiler, "_is_non_strict_tracing")


def apply_torch_version_fixes() -> list[str]:
    """Apply the fixes this torch needs (idempotent); returns the names of those applied."""
    applied = []
    if needs_set_timeout_fix():
        titan_dist_utils.set_pg_timeouts = set_pg_timeouts_per_group
        applied.append("set_pg_timeouts")
    if needs_non_strict_tracing_fix():
        torch.compiler._is_non_strict_tracing = lambda: False
        applied.append("_is_non_strict_tracing")
    return applied
