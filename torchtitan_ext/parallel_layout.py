"""How a run's ranks lay out over its parallel degrees (torchtitan's ``ParallelismConfig``).

The world (every rank of the launch) is dp_replicate x dp_shard x cp x tp x pp ranks; expert
parallelism borrows its ranks from dp_shard x cp x tp. ``data_parallel_shard_degree = -1``
takes the ranks the other degrees leave.
"""

import shlex
import sys
from collections.abc import Iterable


def launch_command(nproc_per_node: int) -> str:
    """The train entry's launcher command running this command line's training arguments on
    ``nproc_per_node`` processes."""
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    return f"python -m torchtitan_ext.train --nproc_per_node={nproc_per_node} {args}".rstrip()


def data_parallel_shard_degree(parallelism, world: int) -> int:
    """``data_parallel_shard_degree`` with -1 resolved as torchtitan does: the ranks of ``world`` left
    over by dp_replicate x cp x tp x pp (rounded down; 0 when that product is not positive)."""
    p = parallelism
    if p.data_parallel_shard_degree != -1:
        return p.data_parallel_shard_degree
    others = (
        p.data_parallel_replicate_degree
        * p.context_parallel_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
    )
    return world // others if others > 0 else 0


def _degrees(p) -> tuple[int, int, int, int, int, int]:
    """(ep, tp, cp, pp, dp_replicate, dp_shard) as configured (dp_shard may be -1)."""
    return (
        p.expert_parallel_degree,
        p.tensor_parallel_degree,
        p.context_parallel_degree,
        p.pipeline_parallel_degree,
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
    )


def degree_errors(parallelism, world: int) -> list[str]:
    """Why the degrees resolve to no layout at all: a degree below 1 (dp_shard may be -1), or
    dp_shard = -1 with a world the other degrees do not divide (empty list: they resolve)."""
    ep, tp, cp, pp, dp_replicate, dp_shard = _degrees(parallelism)
    if min(ep, tp, cp, pp, dp_replicate) < 1 or (dp_shard < 1 and dp_shard != -1):
        return [
            "parallelism: degrees must be >= 1 (data_parallel_shard_degree may be -1); "
            f"got ep={ep}, tp={tp}, cp={cp}, pp={pp}, dp_replicate={dp_replicate}, dp_shard={dp_shard}"
        ]
    if dp_shard == -1 and world % (dp_replicate * cp * tp * pp):
        return [
            f"parallelism: world size {world} is not divisible by dp_replicate*cp*tp*pp = {dp_replicate * cp * tp * pp}"
        ]
    return []


def layout_errors(parallelism, world: int) -> list[str]:
    """Why the degrees do not lay out ``world`` ranks (empty list: they do): ``degree_errors``, else
    the product of the degrees against the world, and the expert-parallel ranks against the world
    and against the ranks they borrow."""
    if errors := degree_errors(parallelism, world):
        return errors
    ep, tp, cp, pp, dp_replicate, _ = _degrees(parallelism)
    dp_shard = data_parallel_shard_degree(parallelism, world)
    errors = []
    if dp_replicate * dp_shard * cp * tp * pp != world:
        errors.append(
            f"parallelism: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}) * tp({tp}) * pp({pp}) "
            f"!= world size {world}"
        )
    if ep > world:
        errors.append(
            f"parallelism.expert_parallel_degree ({ep}) needs at least {ep} processes but this run has "
            f"{world}; launch one process per rank: {launch_command(ep)}"
        )
    elif world % ep:
        errors.append(f"parallelism.expert_parallel_degree ({ep}) does not divide the world size ({world})")
    elif (dp_shard * cp * tp) % ep:
        errors.append(
            f"parallelism.expert_parallel_degree ({ep}) must divide dp_shard*cp*tp = {dp_shard * cp * tp} "
            "(EP borrows ranks from data-shard, context and tensor parallelism)"
        )
    return errors


def expert_share_errors(expert_parallel_degree: int, num_experts: Iterable[int]) -> list[str]:
    """Why the EP ranks cannot hold equal shares of the experts (empty list: they can): one line per
    number of experts (of a MoE layer) that ``expert_parallel_degree`` does not divide."""
    ep = expert_parallel_degree
    return [
        f"parallelism.expert_parallel_degree ({ep}) does not divide the number of experts ({experts})"
        for experts in sorted(set(num_experts))
        if experts % ep
    ]
