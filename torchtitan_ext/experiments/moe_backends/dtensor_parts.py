"""This rank's part of a tensor that may be a DTensor (tensor or expert parallelism), and a local result
handed on laid out as a DTensor again."""

import torch
from torch.distributed.tensor import DTensor, Partial, Shard


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor under tensor or expert parallelism), ``tensor`` itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def laid_out_like(local: torch.Tensor, reference: torch.Tensor, *, sum_over_tokens: bool = False) -> torch.Tensor:
    """``local`` as this rank's part of a tensor laid out like ``reference`` (itself where ``reference`` is no
    DTensor). ``sum_over_tokens``: ``local`` sums over ``reference``'s tokens, so it is Partial on every mesh
    axis that shards them (and keeps no token dims)."""
    if not isinstance(reference, DTensor):
        return local
    if sum_over_tokens:
        placements = [Partial() if isinstance(p, Shard) else p for p in reference.placements]
        return DTensor.from_local(local, reference.device_mesh, placements, run_check=False)
    return DTensor.from_local(
        local,
        reference.device_mesh,
        reference.placements,
        run_check=False,
        shape=reference.shape,
        stride=reference.stride(),
    )
