"""MoE routing metrics logged through torchtitan's ``MetricsProcessor``.

``MoEMetricsProcessor`` is torchtitan's processor plus, at torchtitan's log
frequency, per-MoE-layer and whole-model routing statistics (key reference:
docs/metrics.md). Scalars travel with torchtitan's own metrics to every enabled
logger (wandb, TensorBoard); the tokens-per-expert histograms and the
layers x experts heatmap go to each logger in its own format.

Cost: forward hooks add device-side counters only; the host reads them (one
all-reduce, one device-to-host copy) on logging steps, never on the others.

Reading contract with the MoE modules (``torchtitan.models.common.moe.MoE`` and
its subclasses): each training forward adds its routed counts to the module's
``tokens_per_expert_E`` buffer ``(E,)``; ``router.gate`` outputs the logits
``(..., E)`` that ``router.score_func`` turns into scores; ``expert_bias_E`` is
present when aux-loss-free balancing is on. Any module inside a MoE layer may
expose, after its forward, the detached statistics named in
``OPTIONAL_LAYER_STATS`` (absent ones are skipped). Forwards in eval mode and
activation-checkpoint recomputations are not counted.
"""

import io
import math
import netrc
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from torchtitan.components.metrics import (
    BaseLogger,
    MetricsProcessor,
    TensorBoardLogger,
    WandBLogger,
)
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.tools.logging import logger

import torchtitan_ext.metrics_toml_keys  # noqa: F401  (registers the TOML keys)
from torchtitan_ext.overrides import load_toml

KEY_PREFIX = "moe"
MODEL_SCOPE = "model"

# Statistic name -> attribute names looked up (also with a ``last_`` prefix) on a MoE
# module and its submodules after each training forward; value: a 0-d tensor or a number.
OPTIONAL_LAYER_STATS: dict[str, tuple[str, ...]] = {
    "aux_loss": ("aux_loss",),
    "z_loss": ("z_loss",),
    "dropped_tokens": ("num_dropped_slots", "num_dropped_tokens"),
    "padding_rows": ("num_padding_rows",),
    "a2a_bytes": ("all_to_all_bytes", "num_all_to_all_bytes"),
}
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
            getattr(experts, "compute_backend", "grouped_mm")
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
        logger.info("wandb: no credentials configured, logging offline (sync later: wandb sync DIR)")
    os.environ.setdefault("WANDB_SILENT", "true")


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


def routing_heatmap_png(tokens_per_expert_LE: np.ndarray, layer_names: list[str], step: int) -> bytes:
    """PNG of the layers x experts load, each cell relative to its layer's mean."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = np.asarray(tokens_per_expert_LE, dtype=np.float64)
    relative = counts / np.maximum(counts.mean(axis=1, keepdims=True), 1e-12)
    num_layers, num_experts = counts.shape
    figure = Figure(figsize=(max(4.0, 0.25 * num_experts + 2), max(2.5, 0.3 * num_layers + 1.5)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(relative, aspect="auto", cmap="viridis", interpolation="nearest")
    axes.set_xlabel("expert")
    axes.set_ylabel("MoE layer")
    axes.set_yticks(range(num_layers), layer_names, fontsize=7)
    axes.set_title(f"tokens per expert / layer mean, step {step}")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


# ---------------------------------------------------------------------------
# Device-side accumulation


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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
            moe.register_forward_pre_hook(self._moe_pre_hook(layer, counts_before)),
            moe.register_forward_hook(self._moe_hook(layer, counts_before)),
            moe.router.gate.register_forward_hook(self._gate_hook(layer, moe.router.score_func)),
        ]
        for module in moe.modules():
            if getattr(module, "compute_backend", None) == "batched_mm_padded":
                self._handles.append(module.register_forward_pre_hook(self._padded_experts_hook(layer)))

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
                for stat, value in _optional_stats(moe).items():
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
        """Rows ``batched_mm_padded`` adds: every expert padded to the largest one."""

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


def _attribute_names(attributes: tuple[str, ...]) -> list[str]:
    return [name for attribute in attributes for name in (f"last_{attribute}", attribute)]


def _optional_stats(moe: torch.nn.Module) -> dict[str, Any]:
    """The ``OPTIONAL_LAYER_STATS`` found on ``moe`` or its submodules (first match wins)."""
    found: dict[str, Any] = {}
    for module in moe.modules():
        for stat, attributes in OPTIONAL_LAYER_STATS.items():
            if stat in found:
                continue
            for attribute in _attribute_names(attributes):
                value = getattr(module, attribute, None)
                if torch.is_tensor(value) and value.numel() == 1:
                    found[stat] = _local(value)
                    break
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    found[stat] = value
                    break
    return found


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
        """Steps between layers x experts heatmap images (0: never); drawn on log steps."""

        wandb_project: str | None = None
        """wandb project (default: env WANDB_PROJECT, else "torchtitan")."""

        wandb_entity: str | None = None
        """wandb entity/team (default: env WANDB_TEAM, else WANDB_ENTITY / your default)."""

        wandb_run_name: str | None = None
        """wandb run name (default: env WANDB_RUN_NAME, else a generated name)."""

        def __post_init__(self):
            if self.heatmap_every < 0:
                raise ValueError(f"metrics.heatmap_every must be >= 0, got {self.heatmap_every}")

    def __init__(self, config: Config, **kwargs):
        self._observer: MoERoutingObserver | None = None
        self._model_parts = None
        self._optimizers = None
        self._steps_since_log = 0
        self._last_heatmap_step: int | None = None
        self._rich_loggers: list[BaseLogger] = []
        super().__init__(config, **kwargs)

    def _build_metric_logger(self, *, config: Config, config_dict=None, **kwargs) -> BaseLogger:
        if config.enable_wandb:
            configure_wandb_environment(
                project=config.wandb_project, entity=config.wandb_entity, run_name=config.wandb_run_name
            )
        config_dict = {**(config_dict or {}), "run_metadata": run_metadata()}
        built = super()._build_metric_logger(config=config, config_dict=config_dict, **kwargs)
        self._rich_loggers = [
            child for child in getattr(built, "_loggers", [built])
            if isinstance(child, (WandBLogger, TensorBoardLogger))
        ]
        return built

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
        counts_LE = np.stack([s.tokens_per_expert_E for s in summaries])
        histograms[f"{KEY_PREFIX}/{MODEL_SCOPE}/tokens_per_expert"] = counts_LE.sum(axis=0)
        rich = {"histograms": histograms}
        if self._heatmap_due(step):
            self._last_heatmap_step = step
            rich["heatmap"] = (counts_LE, [s.name for s in summaries])
        logger.info(
            f"moe: imbalance {whole_model['load_imbalance']:.3f} (max {whole_model['load_imbalance_max']:.3f})  "
            f"cv {whole_model['load_cv']:.3f}  dead {whole_model['dead_expert_fraction']:.3f}  "
            f"entropy {whole_model['router_entropy']:.3f}"
        )
        return scalars, rich

    def _heatmap_due(self, step: int) -> bool:
        every = self.config.heatmap_every
        if every == 0 or not self._rich_loggers:
            return False
        return self._last_heatmap_step is None or step - self._last_heatmap_step >= every

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None):
        if self._observer is not None:
            scalars, rich = self.collect_moe_metrics(step)
            extra_metrics = {**(extra_metrics or {}), **scalars}
            self._log_rich(rich, step)
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    def _log_rich(self, rich: dict[str, Any], step: int) -> None:
        """Histograms and the heatmap, in each logger's own format."""
        heatmap_png = routing_heatmap_png(*rich["heatmap"], step=step) if "heatmap" in rich else None
        for rich_logger in self._rich_loggers:
            if isinstance(rich_logger, WandBLogger):
                _log_rich_wandb(rich_logger, rich["histograms"], heatmap_png, step)
            else:
                _log_rich_tensorboard(rich_logger, rich["histograms"], heatmap_png, step)


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
