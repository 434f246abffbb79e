"""How a run's ranks lay out over its parallel degrees (torchtitan's ``ParallelismConfig``).

The world (every rank of the launch) is dp_replicate x dp_shard x cp x tp x pp ranks; expert
parallelism borrows its ranks from dp_shard x cp x tp. ``data_parallel_shard_degree = -1``
takes the ranks the other degrees leave.
"""

import shlex
import sys
from collections.abc import Callable, Iterable


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


DEGREE_FIELDS = (
    ("ep", "expert_parallel_degree"),
    ("tp", "tensor_parallel_degree"),
    ("cp", "context_parallel_degree"),
    ("pp", "pipeline_parallel_degree"),
    ("dp_replicate", "data_parallel_replicate_degree"),
    ("dp_shard", "data_parallel_shard_degree"),
)
"""(short name, ``ParallelismConfig`` field) of every degree."""


def _degrees(p) -> tuple[int, int, int, int, int, int]:
    """(ep, tp, cp, pp, dp_replicate, dp_shard) as configured (dp_shard may be -1)."""
    ep, tp, cp, pp, dp_replicate, dp_shard = (getattr(p, field) for _, field in DEGREE_FIELDS)
    return ep, tp, cp, pp, dp_replicate, dp_shard


def _set_degrees(p, key: Callable[[str], str], *names: str) -> str:
    """``"(key = value, ...)"`` of the degrees among ``names`` that are not 1 or were set (``key`` names
    them with where their value came from): how a message says which settings made a product."""
    fields = dict(DEGREE_FIELDS)
    settings = []
    for name in names:
        dotted, value = f"parallelism.{fields[name]}", getattr(p, fields[name])
        if value != 1 or key(dotted) != dotted:
            settings.append(f"{key(dotted)} = {value}")
    return f" ({', '.join(settings)})" if settings else ""


def degree_errors(parallelism, world: int, key: Callable[[str], str] = str) -> list[str]:
    """Why the degrees resolve to no layout at all: a degree below 1 (dp_shard may be -1), or
    dp_shard = -1 with a world the other degrees do not divide (empty list: they resolve).
    ``key(dotted key)`` is how a message names a degree (with where its value came from)."""
    p = parallelism
    errors = [
        f"{key(f'parallelism.{field}')} = {getattr(p, field)}: must be >= 1"
        + (" (or -1: the ranks the other degrees leave)" if name == "dp_shard" else "")
        for name, field in DEGREE_FIELDS
        if getattr(p, field) < 1 and not (name == "dp_shard" and getattr(p, field) == -1)
    ]
    if errors:
        return errors
    _, tp, cp, pp, dp_replicate, dp_shard = _degrees(p)
    if dp_shard == -1 and world % (dp_replicate * cp * tp * pp):
        return [
            f"parallelism: world size {world} is not divisible by dp_replicate*cp*tp*pp = "
            f"{dp_replicate * cp * tp * pp}{_set_degrees(p, key, 'dp_replicate', 'cp', 'tp', 'pp')}"
        ]
    return []


def layout_errors(
    parallelism, world: int, key: Callable[[str], str] = str, *, suggest_launch: bool = True
) -> list[str]:
    """Why the degrees do not lay out ``world`` ranks (empty list: they do): ``degree_errors``, else
    the product of the degrees against the world, and the expert-parallel ranks against the world
    and against the ranks they borrow. ``suggest_launch``: a message about too few processes gives
    the command that launches enough (leave it off where the degree is refused for another reason)."""
    if errors := degree_errors(parallelism, world, key):
        return errors
    ep, tp, cp, pp, dp_replicate, _ = _degrees(parallelism)
    dp_shard = data_parallel_shard_degree(parallelism, world)
    ep_key = f"{key('parallelism.expert_parallel_degree')} = {ep}"
    errors = []
    if dp_replicate * dp_shard * cp * tp * pp != world:
        errors.append(
            f"parallelism: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}) * tp({tp}) * pp({pp}) "
            f"!= world size {world}"
            f"{_set_degrees(parallelism, key, 'dp_replicate', 'dp_shard', 'cp', 'tp', 'pp')}"
        )
    if ep > world:
        launch = f"; launch one process per rank: {launch_command(ep)}" if suggest_launch else ""
        errors.append(f"{ep_key}: needs at least {ep} processes but this run has {world}{launch}")
    elif world % ep:
        errors.append(f"{ep_key}: does not divide the world size ({world})")
    elif (dp_shard * cp * tp) % ep:
        errors.append(
            f"{ep_key}: must divide dp_shard*cp*tp = {dp_shard * cp * tp} "
            "(EP borrows ranks from data-shard, context and tensor parallelism)"
        )
    return errors


def expert_share_errors(
    expert_parallel_degree: int, num_experts: Iterable[int], key: Callable[[str], str] = str
) -> list[str]:
    """Why the EP ranks cannot hold equal shares of the experts (empty list: they can): one line per
    number of experts (of a MoE layer) that ``expert_parallel_degree`` does not divide."""
    ep = expert_parallel_degree
    return [
        f"{key('parallelism.expert_parallel_degree')} = {ep}: does not divide the number of experts ({experts})"
        for experts in sorted(set(num_experts))
        if experts % ep
    ]
