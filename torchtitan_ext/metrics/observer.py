"""Per-layer observer: forward hooks on every MoE layer accumulate routing statistics on device.

Reading contract with the MoE modules (``torchtitan.models.common.moe.MoE`` and
its subclasses): each training forward adds its routed counts to the module's
``tokens_per_expert_E`` buffer ``(E,)``; ``router.gate`` outputs the logits
``(..., E)`` that ``router.score_func`` turns into scores; ``expert_bias_E`` is
present when aux-loss-free balancing is on. A layer may publish, after its forward,
an object with the fields of ``PublishedRouterStatistics`` as ``last_router_statistics``
(losses, dropped slots, padding rows; None fields are skipped). An experts module
(torchtitan's ``GroupedExperts`` or a subclass) whose ``backend.pads_rows`` is true pads
every expert to the largest one. Forwards in eval mode and activation-checkpoint
recomputations are not counted. Layers are recognized by these attributes, not by class:
the metrics import no experiment.

Cost: the hooks add device-side counters only; ``summarize`` reads them (one
all-reduce per group, one device-to-host copy) when the processor logs.

Compiled and captured: every accumulator is a tensor allocated when a layer is watched and updated
in place, the hooks read nothing on the host and keep no Python state that changes per forward,
so ``torch.compile(fullgraph=True)`` traces them into the layer's graph and a CUDA graph replays
them. Under compile, activation-checkpoint recomputation does not replay forward side effects
(torchtitan sets ``skip_fwd_side_effects_in_bwd_under_checkpoint``), so the recomputation test
and the dispatch-mode shield are eager-only.
"""

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import _disable_current_modes
from torchtitan.models.common.moe import GroupedExperts

from torchtitan_ext.metrics.statistics import AVERAGED_STATS, LayerSummary


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _training_forward_hook(hook: Callable) -> Callable:
    """``hook(module, ...)`` run on training forwards only (not in eval, not in the activation-checkpoint
    recomputation of a backward), without autograd and with the active torch dispatch modes switched off.

    The hooks run tensor ops in a forward but skip them in an activation-checkpoint
    recomputation. Selective checkpointing matches saved op outputs to the recomputation by
    each op's call count, so ops it could see in one pass and not the other would shift that
    match (a saved device-to-host copy of split sizes would come back as another op's output).
    Hidden from the modes, the hooks leave the call counts of the layer's own ops unchanged.
    """

    @functools.wraps(hook)
    def run(module, *args) -> None:
        if not module.training:
            return
        if torch.compiler.is_compiling():
            with torch.no_grad():
                hook(module, *args)
            return
        if _in_backward_recompute():
            return
        with _disable_current_modes(), torch.no_grad():
            hook(module, *args)

    return run


def _in_backward_recompute() -> bool:
    """True while autograd runs a backward (an eager activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(kw_only=True, slots=True)
class ExpertParallelPlacement:
    """Which experts this rank owns: ``[rank * per_rank, (rank + 1) * per_rank)``."""

    rank: int
    degree: int


OPTIONAL_STATS = ("aux_loss", "z_loss", "dropped_tokens", "padding_rows")
"""Per-forward statistics a layer may publish (``PublishedRouterStatistics``), in accumulator order."""


@dataclass(kw_only=True)
class LayerAccumulator:
    """One MoE layer's statistics since the last log, as tensors on the layer's device.

    ``tokens_per_expert_E`` counts routed (token, expert) pairs of this rank's tokens;
    ``entropy_sum`` sums the per-token router entropy (nats) over ``num_tokens`` tokens;
    ``optional_sums`` / ``optional_counts`` sum each of ``OPTIONAL_STATS`` and count the forwards
    that published it; ``counts_before_E`` holds the layer's routed counts as a forward starts.
    """

    name: str
    moe: torch.nn.Module
    num_experts: int
    tokens_per_expert_E: torch.Tensor
    counts_before_E: torch.Tensor
    entropy_sum: torch.Tensor
    num_tokens: torch.Tensor
    padding_rows: torch.Tensor
    computed_a2a_bytes: torch.Tensor
    optional_sums: torch.Tensor
    optional_counts: torch.Tensor
    sharded_tokens: bool = False

    def reset(self) -> None:
        for t in (
            self.tokens_per_expert_E,
            self.entropy_sum,
            self.num_tokens,
            self.padding_rows,
            self.computed_a2a_bytes,
            self.optional_sums,
            self.optional_counts,
        ):
            t.zero_()


class PublishedRouterStatistics(Protocol):
    """What the observer reads from a layer's ``last_router_statistics`` (0-d tensors; None: not computed)."""

    num_dropped_slots: torch.Tensor | None
    num_padding_rows: torch.Tensor | None
    aux_loss: torch.Tensor | None
    z_loss: torch.Tensor | None


def _is_moe(module: torch.nn.Module) -> bool:
    return hasattr(module, "router") and hasattr(module, "tokens_per_expert_E")


def _pads_rows(module: torch.nn.Module) -> bool:
    """An experts module whose compute backend pads every expert's rows to the largest expert's."""
    return isinstance(module, GroupedExperts) and bool(getattr(getattr(module, "backend", None), "pads_rows", False))


def _layer_name(qualified_name: str) -> str:
    match = re.search(r"layers\.(\w+)", qualified_name)
    return f"layer_{match.group(1)}" if match else qualified_name.replace(".", "_")


class MoERoutingObserver:
    """Hooks every MoE layer of ``model_parts`` and accumulates routing statistics on device."""

    def __init__(self, model_parts: list[torch.nn.Module], expert_parallel: ExpertParallelPlacement | None):
        self.expert_parallel = expert_parallel
        self.layers: list[LayerAccumulator] = []
        self._handles = []
        for part in model_parts:
            for qualified_name, module in part.named_modules():
                if _is_moe(module):
                    self._watch(_layer_name(qualified_name), module)

    def _watch(self, name: str, moe: torch.nn.Module) -> None:
        counts_E = moe.get_buffer("tokens_per_expert_E")
        num_experts = counts_E.shape[0]
        device = _local(counts_E).device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=device)

        layer = LayerAccumulator(
            name=name,
            moe=moe,
            num_experts=num_experts,
            tokens_per_expert_E=zeros(num_experts),
            counts_before_E=torch.zeros_like(_local(counts_E)),
            entropy_sum=zeros(),
            num_tokens=zeros(),
            padding_rows=zeros(),
            computed_a2a_bytes=zeros(),
            optional_sums=zeros(len(OPTIONAL_STATS)),
            optional_counts=zeros(len(OPTIONAL_STATS)),
        )
        self.layers.append(layer)
        self._handles += [
            moe.register_forward_pre_hook(_training_forward_hook(self._moe_pre_hook(layer))),
            moe.register_forward_hook(_training_forward_hook(self._moe_hook(layer))),
            moe.get_submodule("router.gate").register_forward_hook(
                # pyrefly: ignore[missing-attribute]  # torch types a module's attributes as Tensor | Module
                _training_forward_hook(self._gate_hook(layer, moe.router.score_func))
            ),
        ]
        for module in moe.modules():
            if _pads_rows(module):
                self._handles.append(
                    module.register_forward_pre_hook(_training_forward_hook(self._padded_experts_hook(layer)))
                )

    def _moe_pre_hook(self, layer: LayerAccumulator) -> Callable:
        def hook(moe, args) -> None:
            layer.counts_before_E.copy_(_local(moe.tokens_per_expert_E))

        return hook

    def _moe_hook(self, layer: LayerAccumulator) -> Callable:
        """Routed counts of this forward (growth of the MoE's ``tokens_per_expert_E``), optional stats."""

        def hook(moe, args, output) -> None:
            counts_E = _local(moe.tokens_per_expert_E).double() - layer.counts_before_E.double()
            layer.tokens_per_expert_E.add_(counts_E)
            if self.expert_parallel is not None:
                _add_a2a_bytes(layer, counts_E, _local(args[0]), self.expert_parallel)
            for index, value in _router_statistics(moe).items():
                layer.optional_sums[index] += value.detach().double()
                layer.optional_counts[index] += 1

        return hook

    def _gate_hook(self, layer: LayerAccumulator, score_func: str) -> Callable:
        """Router entropy from the gate logits ``(..., E)``, scored like the router does."""

        def hook(gate, args, logits) -> None:
            logits_TE = _local(logits).reshape(-1, layer.num_experts).double()
            if score_func == "softmax":
                probs_TE = torch.softmax(logits_TE, dim=-1)
            else:
                scores_TE = torch.sigmoid(logits_TE)
                probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            layer.entropy_sum -= torch.special.xlogy(probs_TE, probs_TE).sum()
            layer.num_tokens += logits_TE.shape[0]
            if isinstance(logits, DTensor) and any(isinstance(p, Shard) for p in logits.placements):
                layer.sharded_tokens = True

        return hook

    def _padded_experts_hook(self, layer: LayerAccumulator) -> Callable:
        """Rows a backend with ``pads_rows`` adds: every expert padded to the largest one."""

        def hook(experts, args) -> None:
            counts_E = args[1]
            layer.padding_rows += counts_E.numel() * counts_E.max() - counts_E.sum()

        return hook

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


_PUBLISHED_FIELDS = ("aux_loss", "z_loss", "num_dropped_slots", "num_padding_rows")
"""The ``PublishedRouterStatistics`` field of each of ``OPTIONAL_STATS``."""


def _add_a2a_bytes(
    layer: LayerAccumulator, counts_E: torch.Tensor, x: torch.Tensor, expert_parallel: ExpertParallelPlacement
) -> None:
    """Dispatch + combine bytes of the rows routed to experts owned by other EP ranks."""
    per_rank = layer.num_experts // expert_parallel.degree
    first = expert_parallel.rank * per_rank
    remote_rows = counts_E.sum() - counts_E[first : first + per_rank].sum()
    layer.computed_a2a_bytes += 2 * remote_rows * x.shape[-1] * x.element_size()


def _router_statistics(moe: torch.nn.Module) -> dict[int, torch.Tensor]:
    """This forward's published statistics by index in ``OPTIONAL_STATS`` (None fields left out).

    A layer that publishes no ``PublishedRouterStatistics`` gives none.
    """
    statistics = getattr(moe, "last_router_statistics", None)
    if statistics is None:
        return {}
    found = {index: getattr(statistics, field, None) for index, field in enumerate(_PUBLISHED_FIELDS)}
    return {index: _local(value) for index, value in found.items() if value is not None}


def summarize(observer: MoERoutingObserver, *, num_steps: int, reduce_groups: list) -> list[LayerSummary]:
    """Reduce every layer's accumulators over ``reduce_groups`` (sum), read them once, reset."""
    num_optional = len(OPTIONAL_STATS)
    rows = [
        torch.cat([
            layer.tokens_per_expert_E,
            torch.stack([layer.entropy_sum, layer.padding_rows, layer.computed_a2a_bytes, layer.num_tokens]),
            layer.optional_sums,
            layer.optional_counts,
        ])
        for layer in observer.layers
    ]  # fmt: skip
    if not rows:
        return []
    packed = torch.cat(rows)
    for group in reduce_groups:
        dist.all_reduce(packed, group=group)
    bias_norms = [
        torch.linalg.vector_norm(_local(layer.moe.get_buffer("expert_bias_E")).double()).reshape(1)
        if getattr(layer.moe, "expert_bias_E", None) is not None
        else torch.full((1,), math.nan, dtype=torch.float64, device=packed.device)
        for layer in observer.layers
    ]
    values = torch.cat([packed, *(b.to(packed.device) for b in bias_norms)]).cpu().numpy()
    observer.reset()

    summaries, offset = [], 0
    for index, layer in enumerate(observer.layers):
        num_experts = layer.num_experts
        tokens_per_expert = values[offset : offset + num_experts]
        offset += num_experts
        entropy_sum, padding_rows, computed_a2a, num_tokens = values[offset : offset + 4]
        offset += 4
        optional_sums = values[offset : offset + num_optional]
        optional_counts = values[offset + num_optional : offset + 2 * num_optional]
        offset += 2 * num_optional
        per_step = {}
        for name, total, count in zip(OPTIONAL_STATS, optional_sums, optional_counts):
            if count > 0:
                per_step[name] = total / count if name in AVERAGED_STATS else total / num_steps
        if padding_rows > 0:
            per_step["padding_rows"] = per_step.get("padding_rows", 0.0) + padding_rows / num_steps
        if computed_a2a > 0:
            per_step["a2a_bytes"] = computed_a2a / num_steps
        bias_norm = values[len(packed) + index]
        summaries.append(
            LayerSummary(
                name=layer.name,
                tokens_per_expert_E=tokens_per_expert,
                router_entropy=entropy_sum / num_tokens if num_tokens else 0.0,
                num_tokens=int(num_tokens),
                optional_per_step={k: float(v) for k, v in per_step.items()},
                expert_bias_norm=None if math.isnan(bias_norm) else float(bias_norm),
            )
        )
    return summaries
