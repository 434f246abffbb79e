"""Routing metrics from routed counts: pure functions of host arrays (numpy), no torch, no torchtitan.

Counts are ``tokens_per_expert_E`` vectors (routed (token, expert) slots per expert); a
``LayerSummary`` is one layer's counts and per-step statistics after the reduction across ranks.
"""

import io
from dataclasses import dataclass

import numpy as np

AVERAGED_STATS = ("aux_loss", "z_loss")
"""Router statistics averaged per forward (losses); the others are summed and reported per step."""


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

HEATMAP_INCHES = ((5.0, 12.0), (3.0, 8.0))
"""(smallest, largest) width and height of the heatmap at 100 dpi: 1200 x 800 px at most (a Qwen3-sized
48 x 128 map included), so that its labels stay readable where wandb and TensorBoard show it."""

HEATMAP_MAX_LAYER_LABELS = 24
"""At most this many layer names on the y axis (every second, third, ... layer beyond)."""


def _clamp(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


def routing_heatmap_png(tokens_per_layer_expert: np.ndarray, layer_names: list[str], step: int) -> bytes:
    """PNG of the layers x experts load, each cell relative to its layer's mean.

    The colour scale is the same at every step: 0 (no token) to ``HEATMAP_SCALE_MAX``,
    centred on 1 (balanced), so images of different steps compare directly. The image grows with
    the map up to ``HEATMAP_INCHES``; text keeps one size (9 pt and up), and the layer axis names
    at most ``HEATMAP_MAX_LAYER_LABELS`` layers.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    counts = np.asarray(tokens_per_layer_expert, dtype=np.float64)
    relative = counts / np.maximum(counts.mean(axis=1, keepdims=True), 1e-12)
    num_layers, num_experts = counts.shape
    (width_bounds, height_bounds) = HEATMAP_INCHES
    figure = Figure(
        figsize=(_clamp(0.1 * num_experts + 3.5, width_bounds), _clamp(0.2 * num_layers + 1.8, height_bounds))
    )
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=HEATMAP_SCALE_MAX)
    image = axes.imshow(relative, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
    axes.set_xlabel("expert", fontsize=10)
    axes.set_ylabel("MoE layer", fontsize=10)
    every = -(-num_layers // HEATMAP_MAX_LAYER_LABELS)
    shown = range(0, num_layers, every)
    axes.set_yticks(shown, [layer_names[i] for i in shown])
    axes.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    axes.tick_params(labelsize=9)
    axes.set_title(f"tokens per expert / layer mean, step {step}", fontsize=11)
    colorbar = figure.colorbar(image, ax=axes, extend="max")
    colorbar.set_label("1 = balanced", fontsize=10)
    colorbar.ax.tick_params(labelsize=9)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


@dataclass(kw_only=True, slots=True)
class LayerSummary:
    """One layer's statistics over all routing ranks, on the host."""

    name: str
    tokens_per_expert_E: np.ndarray
    router_entropy: float
    num_tokens: int
    optional_per_step: dict[str, float]
    expert_bias_norm: float | None


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
