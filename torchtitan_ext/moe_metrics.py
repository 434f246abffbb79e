"""MoE routing metrics logged through torchtitan's ``MetricsProcessor``.

``MoEMetricsProcessor`` is torchtitan's processor plus, at torchtitan's log
frequency, per-MoE-layer and whole-model routing statistics (key reference:
docs/metrics.md). Scalars travel with torchtitan's own metrics to every enabled
logger (wandb, TensorBoard); the tokens-per-expert histograms and the
layers x experts heatmap go to each logger in its own format.

Console: each log step prints torchtitan's ``step:`` line, then one ``moe:`` line;
on CPU the step line has no TFLOP/s or MFU columns (they are measured against a GPU's
peak); colour codes only go to a terminal; ``close`` prints a run summary (steps,
first and last loss, wall time, output, checkpoint and wandb folders).

Cost: forward hooks add device-side counters only; the host reads them (one
all-reduce, one device-to-host copy) on logging steps, never on the others.

Reading contract with the MoE modules (``torchtitan.models.common.moe.MoE`` and
its subclasses): each training forward adds its routed counts to the module's
``tokens_per_expert_E`` buffer ``(E,)``; ``router.gate`` outputs the logits
``(..., E)`` that ``router.score_func`` turns into scores; ``expert_bias_E`` is
present when aux-loss-free balancing is on. A layer may publish, after its forward,
a ``RouterStatistics`` as ``last_router_statistics`` (losses, dropped slots, padding
rows; None fields are skipped). Forwards in eval mode and
activation-checkpoint recomputations are not counted.
"""

import functools
import io
import logging
import math
import netrc
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import _disable_current_modes

from torchtitan.components.metrics import (
    BaseLogger,
    MetricsProcessor,
    TensorBoardLogger,
    WandBLogger,
)
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import NoColor

import torchtitan_ext.metrics_toml_keys  # noqa: F401  (registers the TOML keys)
from torchtitan_ext.compat.cpu import cpu_training
from torchtitan_ext.experiments.moe_backends.experts import DEFAULT_BACKEND, BackendGroupedExperts
from torchtitan_ext.experiments.moe_backends.moe import RouterStatistics
from torchtitan_ext.overrides import load_toml

KEY_PREFIX = "moe"
MODEL_SCOPE = "model"

# Statistics averaged per forward (losses); the others are summed and reported per step.
AVERAGED_STATS = ("aux_loss", "z_loss")


# ---------------------------------------------------------------------------
# Run metadata and wandb environment


_run_metadata: dict[str, Any] = {}


def record_run_metadata(*, flavor: str, toml_files: list[str], cli_args: list[str], config) -> None:
    """Remember what identifies this run; added to the wandb config as ``run_metadata``.

    ``config`` is the resolved ``Trainer.Config``; the TOML files are stored as paths
    and as their ``{dotted_key: value}`` overrides.
    """
    backends = []
    if config.model_spec is not None:
        backends = sorted({
            experts.compute_backend if isinstance(experts, BackendGroupedExperts.Config) else DEFAULT_BACKEND
            for _, experts, _, _ in config.model_spec.model.traverse(GroupedExperts.Config)
        })
    _run_metadata.clear()
    _run_metadata.update(
        flavor=flavor,
        compute_backend=backends[0] if len(backends) == 1 else backends,
        expert_parallel_degree=config.parallelism.expert_parallel_degree,
        toml_files=list(toml_files),
        toml_overrides={path: load_toml(path) for path in toml_files},
        cli_args=list(cli_args),
    )


def run_metadata() -> dict[str, Any]:
    return dict(_run_metadata)


def wandb_has_credentials() -> bool:
    """True if an API key is set in the environment or in netrc for the wandb host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    netrc_path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        return netrc.netrc(netrc_path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def configure_wandb_environment(*, project: str | None, entity: str | None,
                                run_name: str | None) -> None:
    """Set the variables torchtitan's ``WandBLogger`` reads; go offline without credentials.

    Config values win over the environment; ``WANDB_MODE`` set by the user is kept.
    """
    for variable, value in (("WANDB_PROJECT", project), ("WANDB_TEAM", entity),
                            ("WANDB_RUN_NAME", run_name)):
        if value is not None:
            os.environ[variable] = value
    if "WANDB_MODE" not in os.environ and not wandb_has_credentials():
        os.environ["WANDB_MODE"] = "offline"
        logger.info("wandb: no credentials configured, logging offline")


@dataclass(kw_only=True, slots=True)
class WandbRunLocation:
    """Where a wandb run went: its local folder, and its URL when it is online."""

    folder: str
    url: str | None

    @property
    def sync_command(self) -> str | None:
        """The command that uploads an offline run (None for an online run)."""
        return None if self.url else f"wandb sync {shlex.quote(self.folder)}"

    def describe(self) -> str:
        if self.url:
            return f"{self.url} (local files: {self.folder})"
        return f"{self.folder} (offline; upload it with: {self.sync_command})"


def wandb_run_location(run) -> WandbRunLocation:
    """Folder and URL of a live ``wandb.Run`` (read before ``wandb.finish``)."""
    offline = bool(getattr(run, "offline", False))
    return WandbRunLocation(folder=os.path.abspath(run.settings.sync_dir), url=None if offline else run.url)


# ---------------------------------------------------------------------------
# Routing statistics from counts (pure functions, numpy)


def routing_scalars(tokens_per_expert_E: np.ndarray) -> dict[str, float]:
    """Load imbalance (max/mean), coefficient of variation (std/mean), dead-expert fraction.

    An all-zero vector (no routed tokens) gives imbalance 1, cv 0, dead fraction 1.
    """
    counts = np.asarray(tokens_per_expert_E, dtype=np.float64)
    mean = counts.mean()
    if mean == 0:
        return {"load_imbalance": 1.0, "load_cv": 0.0, "dead_expert_fraction": 1.0}
    return {
        "load_imbalance": float(counts.max() / mean),
        "load_cv": float(counts.std() / mean),
        "dead_expert_fraction": float((counts == 0).mean()),
    }


HEATMAP_SCALE_MAX = 4.0
"""Top of the heatmap's fixed colour scale: load / layer mean; larger cells take the top colour."""


def routing_heatmap_png(tokens_per_layer_expert: np.ndarray, layer_names: list[str], step: int) -> bytes:
    """PNG of the layers x experts load, each cell relative to its layer's mean.

    The colour scale is the same at every step: 0 (no token) to ``HEATMAP_SCALE_MAX``,
    centred on 1 (balanced), so images of different steps compare directly.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    counts = np.asarray(tokens_per_layer_expert, dtype=np.float64)
    relative = counts / np.maximum(counts.mean(axis=1, keepdims=True), 1e-12)
    num_layers, num_experts = counts.shape
    figure = Figure(figsize=(max(4.0, 0.25 * num_experts + 2), max(2.5, 0.3 * num_layers + 1.5)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=HEATMAP_SCALE_MAX)
    image = axes.imshow(relative, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
    axes.set_xlabel("expert")
    axes.set_ylabel("MoE layer")
    axes.set_yticks(range(num_layers), layer_names, fontsize=7)
    axes.set_title(f"tokens per expert / layer mean, step {step}")
    colorbar = figure.colorbar(image, ax=axes, extend="max")
    colorbar.set_label("1 = balanced", fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


# ---------------------------------------------------------------------------
# Device-side accumulation


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _outside_dispatch_modes(hook: Callable) -> Callable:
    """``hook`` run with the active torch dispatch modes switched off.

    The hooks run tensor ops in a forward but skip them in an activation-checkpoint
    recomputation. Selective checkpointing matches saved op outputs to the recomputation by
    each op's call count, so ops it could see in one pass and not the other would shift that
    match (a saved device-to-host copy of split sizes would come back as another op's output).
    Hidden from the modes, the hooks leave the call counts of the layer's own ops unchanged.
    """

    @functools.wraps(hook)
    def run(*args):
        with _disable_current_modes():
            return hook(*args)

    return run


def _in_backward_recompute() -> bool:
    """True while autograd runs a backward (activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(kw_only=True, slots=True)
class ExpertParallelPlacement:
    """Which experts this rank owns: ``[rank * per_rank, (rank + 1) * per_rank)``."""

    rank: int
    degree: int


@dataclass(kw_only=True, slots=True)
class LayerAccumulator:
    """One MoE layer's statistics since the last log, on the layer's device.

    ``tokens_per_expert_E`` counts routed (token, expert) pairs of this rank's tokens;
    ``entropy_sum`` sums the per-token router entropy (nats).
    """

    name: str
    moe: torch.nn.Module
    num_experts: int
    tokens_per_expert_E: torch.Tensor
    entropy_sum: torch.Tensor
    num_tokens: int = 0
    padding_rows: torch.Tensor
    computed_a2a_bytes: torch.Tensor
    optional_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    optional_counts: dict[str, int] = field(default_factory=dict)
    sharded_tokens: bool = False

    def reset(self) -> None:
        for t in (self.tokens_per_expert_E, self.entropy_sum, self.padding_rows,
                  self.computed_a2a_bytes, *self.optional_sums.values()):
            t.zero_()
        self.num_tokens = 0
        self.optional_counts = dict.fromkeys(self.optional_counts, 0)


def _is_moe(module: torch.nn.Module) -> bool:
    return hasattr(module, "router") and hasattr(module, "tokens_per_expert_E")


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
        num_experts = moe.tokens_per_expert_E.shape[0]
        device = _local(moe.tokens_per_expert_E).device
        layer = LayerAccumulator(
            name=name,
            moe=moe,
            num_experts=num_experts,
            tokens_per_expert_E=torch.zeros(num_experts, dtype=torch.float64, device=device),
            entropy_sum=torch.zeros((), dtype=torch.float64, device=device),
            padding_rows=torch.zeros((), dtype=torch.float64, device=device),
            computed_a2a_bytes=torch.zeros((), dtype=torch.float64, device=device),
        )
        self.layers.append(layer)
        counts_before: list[torch.Tensor] = []
        self._handles += [
            moe.register_forward_pre_hook(_outside_dispatch_modes(self._moe_pre_hook(layer, counts_before))),
            moe.register_forward_hook(_outside_dispatch_modes(self._moe_hook(layer, counts_before))),
            moe.router.gate.register_forward_hook(
                _outside_dispatch_modes(self._gate_hook(layer, moe.router.score_func))
            ),
        ]
        for module in moe.modules():
            if isinstance(module, BackendGroupedExperts) and module.backend.pads_rows:
                self._handles.append(
                    module.register_forward_pre_hook(_outside_dispatch_modes(self._padded_experts_hook(layer)))
                )

    def _moe_pre_hook(self, layer: LayerAccumulator, counts_before: list) -> Callable:
        def hook(moe, args) -> None:
            if moe.training and not _in_backward_recompute():
                counts_before.append(_local(moe.tokens_per_expert_E).detach().clone())

        return hook

    def _moe_hook(self, layer: LayerAccumulator, counts_before: list) -> Callable:
        """Routed counts of this forward (growth of the MoE's ``tokens_per_expert_E``), optional stats."""

        def hook(moe, args, output) -> None:
            if not moe.training or _in_backward_recompute():
                return
            with torch.no_grad():
                counts_E = _local(moe.tokens_per_expert_E).double() - counts_before.pop().double()
                layer.tokens_per_expert_E += counts_E
                if self.expert_parallel is not None:
                    self._add_a2a_bytes(layer, counts_E, _local(args[0]))
                for stat, value in _router_statistics(moe).items():
                    total = layer.optional_sums.get(stat)
                    if total is None:
                        total = layer.optional_sums[stat] = torch.zeros_like(layer.entropy_sum)
                        layer.optional_counts[stat] = 0
                    total += value.detach().double() if torch.is_tensor(value) else float(value)
                    layer.optional_counts[stat] += 1

        return hook

    def _gate_hook(self, layer: LayerAccumulator, score_func: str) -> Callable:
        """Router entropy from the gate logits ``(..., E)``, scored like the router does."""

        def hook(gate, args, logits) -> None:
            if not gate.training or _in_backward_recompute():
                return
            with torch.no_grad():
                logits_TE = _local(logits).reshape(-1, layer.num_experts).double()
                if score_func == "softmax":
                    probs_TE = torch.softmax(logits_TE, dim=-1)
                else:
                    scores_TE = torch.sigmoid(logits_TE)
                    probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-30)
                layer.entropy_sum -= torch.special.xlogy(probs_TE, probs_TE).sum()
                layer.num_tokens += logits_TE.shape[0]
            layer.sharded_tokens = isinstance(logits, DTensor) and any(
                isinstance(p, Shard) for p in logits.placements
            )

        return hook

    def _add_a2a_bytes(self, layer: LayerAccumulator, counts_E: torch.Tensor, x: torch.Tensor) -> None:
        """Dispatch + combine bytes of the rows routed to experts owned by other EP ranks."""
        per_rank = layer.num_experts // self.expert_parallel.degree
        first = self.expert_parallel.rank * per_rank
        remote_rows = counts_E.sum() - counts_E[first:first + per_rank].sum()
        layer.computed_a2a_bytes += 2 * remote_rows * x.shape[-1] * x.element_size()

    def _padded_experts_hook(self, layer: LayerAccumulator) -> Callable:
        """Rows a backend with ``pads_rows`` adds: every expert padded to the largest one."""

        def hook(experts, args) -> None:
            if not experts.training or _in_backward_recompute():
                return
            counts_E = args[1]
            layer.padding_rows += counts_E.numel() * counts_E.max() - counts_E.sum()

        return hook

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _router_statistics(moe: torch.nn.Module) -> dict[str, Any]:
    """Per-forward statistics of ``moe``'s ``RouterStatistics`` by metric name (None fields left out).

    A layer that publishes no ``last_router_statistics`` gives none.
    """
    statistics = getattr(moe, "last_router_statistics", None)
    if not isinstance(statistics, RouterStatistics):
        return {}
    found = {
        "aux_loss": statistics.aux_loss,
        "z_loss": statistics.z_loss,
        "dropped_tokens": statistics.num_dropped_slots,
        "padding_rows": statistics.num_padding_rows,
    }
    return {stat: _local(value) for stat, value in found.items() if value is not None}


# ---------------------------------------------------------------------------
# Reduction across ranks and metric computation


@dataclass(kw_only=True, slots=True)
class LayerSummary:
    """One layer's statistics over all routing ranks, on the host."""

    name: str
    tokens_per_expert_E: np.ndarray
    router_entropy: float
    num_tokens: int
    optional_per_step: dict[str, float]
    expert_bias_norm: float | None


def summarize(observer: MoERoutingObserver, *, num_steps: int, reduce_groups: list) -> list[LayerSummary]:
    """Reduce every layer's accumulators over ``reduce_groups`` (sum), read them once, reset."""
    optional_names = sorted({s for layer in observer.layers for s in layer.optional_sums})
    rows = []
    for layer in observer.layers:
        device = layer.entropy_sum.device
        sums = [layer.optional_sums.get(s, torch.zeros((), dtype=torch.float64, device=device))
                for s in optional_names]
        counts = [float(layer.optional_counts.get(s, 0)) for s in optional_names]
        rows.append(torch.cat([
            layer.tokens_per_expert_E,
            torch.stack([layer.entropy_sum, layer.padding_rows, layer.computed_a2a_bytes, *sums]),
            torch.tensor([float(layer.num_tokens), *counts], dtype=torch.float64, device=device),
        ]))
    if not rows:
        return []
    packed = torch.cat(rows)
    for group in reduce_groups:
        dist.all_reduce(packed, group=group)
    bias_norms = [
        torch.linalg.vector_norm(_local(layer.moe.expert_bias_E).double()).reshape(1)
        if getattr(layer.moe, "expert_bias_E", None) is not None
        else torch.full((1,), math.nan, dtype=torch.float64, device=packed.device)
        for layer in observer.layers
    ]
    values = torch.cat([packed, *(b.to(packed.device) for b in bias_norms)]).cpu().numpy()
    observer.reset()

    summaries, offset = [], 0
    for index, layer in enumerate(observer.layers):
        num_experts, num_optional = layer.num_experts, len(optional_names)
        tokens_per_expert = values[offset:offset + num_experts]
        offset += num_experts
        entropy_sum, padding_rows, computed_a2a = values[offset:offset + 3]
        optional_sums = values[offset + 3:offset + 3 + num_optional]
        offset += 3 + num_optional
        num_tokens = values[offset]
        optional_counts = values[offset + 1:offset + 1 + num_optional]
        offset += 1 + num_optional
        per_step = {}
        for name, total, count in zip(optional_names, optional_sums, optional_counts):
            if count > 0:
                per_step[name] = total / count if name in AVERAGED_STATS else total / num_steps
        if padding_rows > 0:
            per_step["padding_rows"] = per_step.get("padding_rows", 0.0) + padding_rows / num_steps
        if computed_a2a > 0 and "a2a_bytes" not in per_step:
            per_step["a2a_bytes"] = computed_a2a / num_steps
        bias_norm = values[len(packed) + index]
        summaries.append(LayerSummary(
            name=layer.name,
            tokens_per_expert_E=tokens_per_expert,
            router_entropy=entropy_sum / num_tokens if num_tokens else 0.0,
            num_tokens=int(num_tokens),
            optional_per_step={k: float(v) for k, v in per_step.items()},
            expert_bias_norm=None if math.isnan(bias_norm) else float(bias_norm),
        ))
    return summaries


_PER_STEP_KEYS = {
    "aux_loss": "aux_loss",
    "z_loss": "z_loss",
    "dropped_tokens": "dropped_tokens_per_step",
    "padding_rows": "padding_rows_per_step",
    "a2a_bytes": "a2a_bytes_per_step",
}


def layer_scalars(summary: LayerSummary) -> dict[str, float]:
    """Scalar metrics of one layer (keys without the ``moe/<layer>/`` prefix)."""
    scalars = routing_scalars(summary.tokens_per_expert_E)
    scalars["router_entropy"] = summary.router_entropy
    scalars["routed_tokens"] = float(summary.tokens_per_expert_E.sum())
    if summary.expert_bias_norm is not None:
        scalars["expert_bias_norm"] = summary.expert_bias_norm
    for stat, value in summary.optional_per_step.items():
        scalars[_PER_STEP_KEYS[stat]] = value
    return scalars


def model_scalars(per_layer: list[dict[str, float]], summaries: list[LayerSummary]) -> dict[str, float]:
    """Whole-model metrics: layer means and maxima, totals of counts, losses and bytes."""
    scalars = {}
    for key in ("load_imbalance", "load_cv", "router_entropy"):
        values = [s[key] for s in per_layer]
        scalars[key] = float(np.mean(values))
        scalars[f"{key}_max"] = float(np.max(values))
    all_counts = np.concatenate([s.tokens_per_expert_E for s in summaries])
    scalars["dead_expert_fraction"] = float((all_counts == 0).mean())
    scalars["routed_tokens"] = float(all_counts.sum())
    norms = [s.expert_bias_norm for s in summaries if s.expert_bias_norm is not None]
    if norms:
        scalars["expert_bias_norm"] = float(np.sqrt(np.sum(np.square(norms))))
    for key in _PER_STEP_KEYS.values():
        values = [s[key] for s in per_layer if key in s]
        if values:
            scalars[key] = float(np.sum(values))
    return scalars


# ---------------------------------------------------------------------------
# The metrics processor


GPU_ONLY_METRICS = ("tflops", "mfu(%)")
"""torchtitan metrics that are rates against a GPU's peak FLOP/s: meaningless on CPU."""

_GPU_ONLY_COLUMNS = re.compile(r"\s*(?:\x1b\[[0-9;]*m)?tflops: .*?mfu: [^\s\x1b]*")
"""The ``tflops: X  mfu: Y%`` columns of torchtitan's console step line (with their colour codes)."""


class _WithoutGpuOnlyColumns(logging.Filter):
    """Cuts the TFLOP/s and MFU columns out of torchtitan's console step line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "tflops: " in record.msg:
            record.msg = _GPU_ONLY_COLUMNS.sub("", record.msg)
        return True


class _WithoutGpuOnlyMetrics(BaseLogger):
    """Forwards metrics to ``inner`` without ``GPU_ONLY_METRICS``."""

    def __init__(self, inner: BaseLogger):
        self.inner = inner

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.inner.log({k: v for k, v in metrics.items() if k not in GPU_ONLY_METRICS}, step)

    def close(self) -> None:
        self.inner.close()


@dataclass(kw_only=True, slots=True)
class RunProgress:
    """What the closing summary reports: steps run, first and last logged loss, start time."""

    started: float = field(default_factory=time.perf_counter)
    steps_run: int = 0
    last_step: int | None = None
    first_loss: tuple[int, float] | None = None
    last_loss: tuple[int, float] | None = None

    def record_loss(self, step: int, loss: float) -> None:
        if self.first_loss is None:
            self.first_loss = (step, loss)
        self.last_loss = (step, loss)


def run_summary_lines(progress: RunProgress, *, output_folder: str, checkpoint_folder: str | None,
                      wandb_run: WandbRunLocation | None, wall_seconds: float) -> list[str]:
    """Closing summary: steps, loss, wall time, and where outputs, checkpoints and wandb went.

    ``checkpoint_folder`` is None when checkpointing is off.
    """
    steps = f"{progress.steps_run} steps run"
    if progress.last_step is not None:
        steps += f" (last step {progress.last_step})"
    if progress.first_loss is None:
        loss = "no loss logged"
    else:
        (first_step, first), (last_step, last) = progress.first_loss, progress.last_loss
        loss = f"loss {first:.4f} (step {first_step}) -> {last:.4f} (step {last_step})"
    lines = [
        f"run summary: {steps}, {loss}, wall time {wall_seconds:.1f} s",
        f"  output folder:     {os.path.abspath(output_folder)}",
        "  checkpoint folder: "
        + (os.path.abspath(checkpoint_folder) if checkpoint_folder else "none (checkpoint.enable is false)"),
    ]
    if wandb_run is not None:
        lines.append(f"  wandb run:         {wandb_run.describe()}")
    return lines


class MoEMetricsProcessor(MetricsProcessor):
    """torchtitan's ``MetricsProcessor`` that also logs MoE routing metrics.

    Hooks are installed when the trainer assigns ``model_parts``; steps are counted
    by an optimizer post-step hook installed when it assigns ``optimizers``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        moe_metrics: bool = True
        """Log MoE routing metrics (per layer and whole model) at ``log_freq``."""

        heatmap_every: int = 50
        """Layers x experts heatmap at the first log step, then at the first log step at or
        after each multiple of this many steps (0: never)."""

        wandb_project: str | None = None
        """wandb project (default: env WANDB_PROJECT, else "torchtitan")."""

        wandb_entity: str | None = None
        """wandb entity/team (default: env WANDB_TEAM, else WANDB_ENTITY / your default)."""

        wandb_run_name: str | None = None
        """wandb run name (default: env WANDB_RUN_NAME, else a generated name)."""

        def __post_init__(self):
            if self.heatmap_every < 0:
                raise ValueError(f"metrics.heatmap_every must be >= 0, got {self.heatmap_every}")

    def __init__(self, config: Config, *, dump_folder: str = "./outputs", config_dict=None, **kwargs):
        self._observer: MoERoutingObserver | None = None
        self._model_parts = None
        self._optimizers = None
        self._steps_since_log = 0
        self._last_heatmap_step: int | None = None
        self._rich_loggers: list[BaseLogger] = []
        self._wandb_run: WandbRunLocation | None = None
        self._progress = RunProgress()
        self._output_folder = dump_folder
        self._checkpoint_folder = _checkpoint_folder(dump_folder, config_dict)
        self._on_cpu = cpu_training()
        super().__init__(config, dump_folder=dump_folder, config_dict=config_dict, **kwargs)
        if not sys.stdout.isatty():
            self.color = NoColor()

    def _build_metric_logger(self, *, config: Config, config_dict=None, **kwargs) -> BaseLogger:
        if config.enable_wandb:
            configure_wandb_environment(
                project=config.wandb_project, entity=config.wandb_entity, run_name=config.wandb_run_name
            )
        config_dict = {**(config_dict or {}), "run_metadata": run_metadata()}
        built = super()._build_metric_logger(config=config, config_dict=config_dict, **kwargs)
        children = getattr(built, "_loggers", [built])
        self._rich_loggers = [child for child in children if isinstance(child, (WandBLogger, TensorBoardLogger))]
        for child in children:
            if isinstance(child, WandBLogger) and child.wandb.run is not None:
                self._wandb_run = wandb_run_location(child.wandb.run)
                logger.info(f"wandb: run folder {self._wandb_run.describe()}")
        return _WithoutGpuOnlyMetrics(built) if self._on_cpu else built

    @property
    def model_parts(self):
        return self._model_parts

    @model_parts.setter
    def model_parts(self, model_parts) -> None:
        self._model_parts = model_parts
        if self._observer is not None:
            self._observer.remove()
            self._observer = None
        if model_parts is not None and self.config.moe_metrics:
            self._observer = MoERoutingObserver(model_parts, self._expert_parallel_placement())
            if not self._observer.layers:
                self._observer = None

    @property
    def optimizers(self):
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers) -> None:
        self._optimizers = optimizers
        if optimizers is not None:
            optimizers.register_step_post_hook(self._count_step)

    def _count_step(self, *args, **kwargs) -> None:
        self._steps_since_log += 1
        self._progress.steps_run += 1

    def _expert_parallel_placement(self) -> ExpertParallelPlacement | None:
        if not self.parallel_dims.ep_enabled:
            return None
        ep_mesh = self.parallel_dims.get_mesh("ep")
        return ExpertParallelPlacement(rank=ep_mesh.get_local_rank(), degree=self.parallel_dims.ep)

    def _reduce_groups(self) -> list:
        """Groups whose ranks route different tokens: the loss mesh, and TP when it shards tokens."""
        groups = []
        loss_mesh = self.parallel_dims.get_optional_mesh("loss")
        if loss_mesh is not None:
            groups.append(loss_mesh.get_group())
        if self.parallel_dims.tp_enabled and any(layer.sharded_tokens for layer in self._observer.layers):
            groups.append(self.parallel_dims.get_mesh("tp").get_group())
        return groups

    def collect_moe_metrics(self, step: int) -> tuple[dict[str, float], dict[str, Any]]:
        """(scalars by full key, rich payload) for ``step``; resets the accumulators."""
        summaries = summarize(
            self._observer, num_steps=max(self._steps_since_log, 1), reduce_groups=self._reduce_groups()
        )
        self._steps_since_log = 0
        per_layer = [layer_scalars(s) for s in summaries]
        scalars = {
            f"{KEY_PREFIX}/{s.name}/{key}": value
            for s, layer in zip(summaries, per_layer)
            for key, value in layer.items()
        }
        whole_model = model_scalars(per_layer, summaries)
        scalars.update({f"{KEY_PREFIX}/{MODEL_SCOPE}/{k}": v for k, v in whole_model.items()})
        histograms = {f"{KEY_PREFIX}/{s.name}/tokens_per_expert": s.tokens_per_expert_E for s in summaries}
        counts_per_layer_expert = np.stack([s.tokens_per_expert_E for s in summaries])
        histograms[f"{KEY_PREFIX}/{MODEL_SCOPE}/tokens_per_expert"] = counts_per_layer_expert.sum(axis=0)
        rich = {"histograms": histograms}
        if self._heatmap_due(step):
            self._last_heatmap_step = step
            rich["heatmap"] = (counts_per_layer_expert, [s.name for s in summaries])
        return scalars, rich

    def _heatmap_due(self, step: int) -> bool:
        return bool(self._rich_loggers) and heatmap_due(step, self._last_heatmap_step, self.config.heatmap_every)

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None):
        """torchtitan's metrics and step line, then the MoE metrics' ``moe:`` line."""
        moe_line = None
        if self._observer is not None:
            scalars, rich = self.collect_moe_metrics(step)
            extra_metrics = {**(extra_metrics or {}), **scalars}
            self._log_rich(rich, step)
            moe_line = moe_console_line(scalars)
        self._progress.last_step = step
        self._progress.record_loss(step, global_avg_loss)
        with self._gpu_only_columns_hidden():
            super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        if moe_line is not None:
            logger.info(moe_line)

    @contextmanager
    def _gpu_only_columns_hidden(self) -> Iterator[None]:
        """On CPU, the console step line printed inside this block has no TFLOP/s and MFU columns."""
        if not self._on_cpu:
            yield
            return
        column_filter = _WithoutGpuOnlyColumns()
        logger.addFilter(column_filter)
        try:
            yield
        finally:
            logger.removeFilter(column_filter)

    def close(self) -> None:
        """Close the loggers, then print the run summary (rank 0, and the rank holding the wandb run)."""
        super().close()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank != 0 and self._wandb_run is None:
            return
        for line in run_summary_lines(
            self._progress, output_folder=self._output_folder, checkpoint_folder=self._checkpoint_folder,
            wandb_run=self._wandb_run, wall_seconds=time.perf_counter() - self._progress.started,
        ):
            logger.info(line)

    def _log_rich(self, rich: dict[str, Any], step: int) -> None:
        """Histograms and the heatmap, in each logger's own format."""
        heatmap_png = routing_heatmap_png(*rich["heatmap"], step=step) if "heatmap" in rich else None
        for rich_logger in self._rich_loggers:
            if isinstance(rich_logger, WandBLogger):
                _log_rich_wandb(rich_logger, rich["histograms"], heatmap_png, step)
            else:
                _log_rich_tensorboard(rich_logger, rich["histograms"], heatmap_png, step)


def heatmap_due(step: int, last_heatmap_step: int | None, every: int) -> bool:
    """True at the first log step, then at the first log step at or after each multiple of ``every``.

    ``every`` 0: never. With log steps 1, 10, 20, ... and ``every`` 50: steps 1, 50, 100, ...
    """
    if every == 0:
        return False
    return last_heatmap_step is None or step // every > last_heatmap_step // every


def moe_console_line(scalars: dict[str, float]) -> str:
    """The ``moe:`` console line from the whole-model scalars of one log step."""
    def model(key: str) -> float:
        return scalars[f"{KEY_PREFIX}/{MODEL_SCOPE}/{key}"]

    return (
        f"moe: imbalance {model('load_imbalance'):.3f} (max {model('load_imbalance_max'):.3f})  "
        f"cv {model('load_cv'):.3f}  dead {model('dead_expert_fraction'):.3f}  "
        f"entropy {model('router_entropy'):.3f}"
    )


def _checkpoint_folder(dump_folder: str, config_dict: dict[str, Any] | None) -> str | None:
    """torchtitan's checkpoint folder (``dump_folder/checkpoint.folder``), None when checkpointing is off."""
    checkpoint = (config_dict or {}).get("checkpoint") or {}
    if not checkpoint.get("enable"):
        return None
    return os.path.join(dump_folder, checkpoint.get("folder", "checkpoint"))


def _log_rich_wandb(wandb_logger: WandBLogger, histograms: dict[str, np.ndarray],
                    heatmap_png: bytes | None, step: int) -> None:
    wandb = wandb_logger.wandb
    payload: dict[str, Any] = {
        key: wandb.Histogram(np_histogram=(counts, np.arange(len(counts) + 1)))
        for key, counts in histograms.items()
    }
    if heatmap_png is not None:
        from PIL import Image

        payload[f"{KEY_PREFIX}/{MODEL_SCOPE}/tokens_per_expert_heatmap"] = wandb.Image(
            Image.open(io.BytesIO(heatmap_png)), caption=f"step {step}"
        )
    wandb.log(payload, step=step)


def _log_rich_tensorboard(tb_logger: TensorBoardLogger, histograms: dict[str, np.ndarray],
                          heatmap_png: bytes | None, step: int) -> None:
    writer = tb_logger.writer
    for key, counts in histograms.items():
        experts = np.arange(len(counts), dtype=np.float64)
        writer.add_histogram_raw(
            key, min=0.0, max=float(len(counts)), num=float(counts.sum()),
            sum=float((experts * counts).sum()), sum_squares=float((experts**2 * counts).sum()),
            bucket_limits=(experts + 1).tolist(), bucket_counts=counts.tolist(), global_step=step,
        )
    if heatmap_png is not None:
        from PIL import Image

        image = np.asarray(Image.open(io.BytesIO(heatmap_png)).convert("RGB"))
        writer.add_image(f"{KEY_PREFIX}/{MODEL_SCOPE}/tokens_per_expert_heatmap", image, step,
                         dataformats="HWC")
