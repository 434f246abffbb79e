"""Grouped bar charts (PNG) of benchmark results, from the result dicts or their JSON files.

- expert block / MoE layer: forward+backward TFLOP/s per backend (GPU results) or
  forward+backward ms (CPU results, which carry no FLOP rates), grouped by shape, one panel
  per routing skew;
- train step: model TFLOP/s (GPU) or step ms (CPU) per backend, grouped by layers and tokens;
- EP dispatch: GB/s of dispatch+combine per transport next to the raw all-to-all (one row per
  routed slot, and one per token and destination rank), all as the routed rows' bytes over the
  time, and, where measured, the same with the host ahead of the GPU (as in training); grouped
  by tokens per rank x dim, one panel per world size and routing.

Every bar carries its value; one y-axis label and one legend serve all panels, outside them. A
compiled variant's bar has its eager twin's colour, hatched.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass

from torchtitan_ext.bench.common import variant_name


@dataclass(frozen=True)
class Bar:
    panel: str
    group: str
    series: str
    value: float
    compiled: bool = False

    @property
    def label(self) -> str:
        """The legend's name of the bar's series: ``series``, or its compiled variant's name."""
        return variant_name(self.series, self.compiled)


@dataclass(frozen=True)
class Chart:
    bars: list[Bar]
    value_label: str
    """The y-axis label: what the bars measure and which way is better."""
    title: str


def _skew_panel(row: dict) -> str:
    return "balanced routing" if not row["skew"] else f"skewed routing (skew {row['skew']})"


def _shape_group(row: dict) -> str:
    return f"{row['shape']}\n(max/mean load {row['max_over_mean']})"


def _ep_rows(results: dict) -> list[dict]:
    """EP rows of a single run (``bench``) or of runs stored per world size (``world_N``)."""
    rows = list(results.get("bench", []))
    for key, value in results.items():
        if key.startswith("world_") and isinstance(value, dict):
            rows += value.get("bench", [])
    return rows


def _rate_or_time(rows: list[dict], rate_key: str, rate_label: str, time_key: str, time_label: str) -> tuple[str, str]:
    """(row key, axis label): the FLOP rate where the rows have one (GPU), else the time (CPU)."""
    if any(row.get(rate_key) is not None for row in rows):
        return rate_key, f"{rate_label} (higher is better)"
    return time_key, f"{time_label} (lower is better)"


def _same_bytes_GBps(row: dict, name: str, ms: float) -> float:
    """GB/s of an EP row's ``name`` call's bytes (``{name}_GBps`` over ``ms[name]``) moved in ``ms`` instead."""
    return row[f"{name}_GBps"] * row["ms"][name] / ms


def _ep_variant(row: dict) -> str:
    """How an EP row moved its rows: the transport, the permute backend (``all_to_all``), and static
    received rows and a CUDA graph's replay where the row has them."""
    transport = row.get("transport", "all_to_all")
    parts = [transport]
    if transport == "all_to_all":
        parts.append(f"{row['permute_backend']} permute")
    if row.get("receive_rows") == "static":
        parts.append("static rows")
    if row.get("launch") == "cuda_graph":
        parts.append("CUDA graph")
    return ", ".join(parts)


def _compile_note(meta: dict) -> str:
    """The title's note of the compiled variants' torch.compile backend, where a run has them."""
    return f", compiled: {meta['compile_backend']}" if meta.get("compile_backend") else ""


def chart_of(results: dict, only: Iterable[str] | None = None) -> Chart:
    """The bars, axis label and title for any result dict the benchmarks write."""
    only = set(only or ())
    rows = results.get("rows", [])
    meta = results.get("meta", results)
    device = meta.get("device") or meta.get("machine", "")
    if rows and ("impl" in rows[0] or "layer" in rows[0]):
        series_key = "impl" if "impl" in rows[0] else "layer"
        key, label = _rate_or_time(rows, "fwdbwd_tflops", "fwd+bwd TFLOP/s", "fwdbwd_ms", "fwd+bwd ms")
        bars = [Bar(_skew_panel(r), _shape_group(r), r[series_key], r.get(key), r.get("compiled", False)) for r in rows]
        what = (
            "Expert block per implementation" if series_key == "impl" else "MoE layer per backend vs stock torchtitan"
        )
        title = f"{what}, {device}, {meta.get('dtype')}{_compile_note(meta)}"
    elif rows and "tokens_per_s" in rows[0]:
        key, label = _rate_or_time(rows, "tflops", "model TFLOP/s", "step_ms", "training step ms")
        bars = [
            Bar("", f"{r['layers']} layers, {r['tokens']} tokens", r["backend"], r.get(key), r.get("compiled", False))
            for r in rows
        ]
        flavors = ", ".join(dict.fromkeys(r["flavor"] for r in rows))
        title = f"Training step per backend, {flavors}, {device}{_compile_note(meta)}"
    elif _ep_rows(results):
        bars, with_raw = [], set()
        for r in _ep_rows(results):
            panel, group = f"{r['world']} ranks, {r['routing']} routing", f"T{r['tokens_per_rank']} D{r['dim']}"
            if (panel, group) not in with_raw:
                with_raw.add((panel, group))
                bars.append(Bar(panel, group, "raw all-to-all", r["raw_a2a_GBps"]))
                if "raw_a2a_unique" in r["ms"]:
                    bars.append(
                        Bar(
                            panel,
                            group,
                            "raw all-to-all, each token once per rank",
                            _same_bytes_GBps(r, "raw_a2a", r["ms"]["raw_a2a_unique"]),
                        )
                    )
                if "ms_host_ahead" in r:
                    bars.append(
                        Bar(
                            panel,
                            group,
                            "raw all-to-all, host ahead",
                            _same_bytes_GBps(r, "raw_a2a", r["ms_host_ahead"]["raw_a2a"]),
                        )
                    )
            how = _ep_variant(r)
            bars.append(Bar(panel, group, f"dispatch+combine ({how})", r["dispatch_combine_GBps"]))
            if "ms_host_ahead" in r:
                bars.append(
                    Bar(
                        panel,
                        group,
                        f"dispatch+combine ({how}), host ahead",
                        _same_bytes_GBps(r, "dispatch_combine", r["ms_host_ahead"]["dispatch_combine"]),
                    )
                )
        label = "GB/s per rank: routed rows' remote bytes / time (higher is better)"
        title = f"EP dispatch + combine, {device}"
    else:
        raise ValueError("not a result file of python -m torchtitan_ext.bench (no rows to plot)")
    bars = [bar for bar in bars if bar.value is not None]
    if only:
        bars = [bar for bar in bars if bar.series in only or bar.label in only]
        if not bars:
            raise ValueError(f"--only {' '.join(sorted(only))}: no such series in these results")
    if not any(bar.value for bar in bars):
        raise ValueError("every value in these results is zero or missing: nothing to plot")
    return Chart(bars, label, title)


def series_colours(series: list[str]) -> dict[str, str]:
    """A colour per series name that every chart shares: each compute backend (table order), the stock
    torchtitan layer and the routed references keep theirs from chart to chart; other series take the
    colours after them, in order."""
    from torchtitan_ext.bench.expert_block import ROUTED_IMPLS
    from torchtitan_ext.bench.moe_layer import STOCK
    from torchtitan_ext.experiments.moe_backends.experts import backend_names

    fixed = [*backend_names(), STOCK, *ROUTED_IMPLS]
    others = [name for name in series if name not in fixed]
    return {name: f"C{(fixed + others).index(name) % 10}" for name in series}


def _value_text(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def plot(results: dict, path: str, only: Iterable[str] | None = None) -> None:
    """Write a PNG of ``results`` (grouped bars, one panel per routing / world) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chart = chart_of(results, only)
    panels = list(dict.fromkeys(bar.panel for bar in chart.bars))
    order = {name: index for index, name in enumerate(dict.fromkeys(bar.series for bar in chart.bars))}
    bar_of = {bar.label: bar for bar in chart.bars}  # a bar of each legend entry: its series, compiled or not
    series = sorted(bar_of, key=lambda label: (order[bar_of[label].series], bar_of[label].compiled))
    legend_rows = -(-len(series) // 3)
    figure, axes = plt.subplots(
        len(panels), 1, figsize=(11, 3.4 * len(panels) + 0.3 * legend_rows + 0.6), squeeze=False, layout="constrained"
    )
    colours = series_colours(list(order))  # compiled bars share their series' colour, hatched
    width = 0.8 / len(series)
    rotation = 90 if len(series) > 3 else 0
    for axis, panel in zip(axes[:, 0], panels):
        groups = list(dict.fromkeys(bar.group for bar in chart.bars if bar.panel == panel))
        values = {(bar.group, bar.label): bar.value for bar in chart.bars if bar.panel == panel}
        for index, name in enumerate(series):
            present = [(g, values[group, name]) for g, group in enumerate(groups) if (group, name) in values]
            positions = [g + (index - (len(series) - 1) / 2) * width for g, _ in present]
            heights = [value for _, value in present]
            hatch = {"hatch": "//", "edgecolor": "white"} if bar_of[name].compiled else {}
            colour = colours[bar_of[name].series]
            bars = axis.bar(positions, heights, width, label=name, color=colour, **hatch)
            axis.bar_label(bars, labels=[_value_text(h) for h in heights], fontsize=7, padding=2, rotation=rotation)
        axis.set_xticks(range(len(groups)), groups)
        axis.margins(y=0.18 if rotation else 0.1)
        if panel:
            axis.set_title(panel, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    for axis in axes[1:, 0]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    figure.legend(handles, labels, loc="outside lower center", ncol=min(len(series), 3), fontsize=8, frameon=False)
    figure.supylabel(chart.value_label, fontsize=10)
    figure.suptitle(chart.title, fontsize=11)
    figure.savefig(path, dpi=80, bbox_inches="tight")  # the legend of long series names whole
    plt.close(figure)


def plot_file(json_path: str, png_path: str, only: Iterable[str] | None = None) -> None:
    with open(json_path) as f:
        plot(json.load(f), png_path, only)
