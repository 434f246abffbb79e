"""Grouped bar charts (PNG) of benchmark results, from the result dicts or their JSON files.

- expert block / MoE layer: forward+backward TFLOP/s per backend, grouped by shape, one panel
  per routing skew;
- train step: model TFLOP/s per backend, grouped by flavor;
- EP dispatch: GB/s of dispatch+combine per transport next to the raw all-to-all (one row per
  routed slot, and one per token and destination rank), all as the routed rows' bytes over the
  time; grouped by tokens per rank x dim, one panel per world size and routing.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Bar:
    panel: str
    group: str
    series: str
    value: float


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


def bars_of(results: dict, only: Iterable[str] | None = None) -> tuple[list[Bar], str, str]:
    """(bars, y-axis label, title) for any result dict the benchmarks write."""
    only = set(only or ())
    rows = results.get("rows", [])
    meta = results.get("meta", results)
    device = meta.get("device") or meta.get("machine", "")
    if rows and "impl" in rows[0]:
        bars = [Bar(_skew_panel(r), _shape_group(r), r["impl"], r["fwdbwd_tflops"]) for r in rows]
        label, title = "fwd+bwd TFLOP/s", f"Expert block per implementation, {device}, {meta.get('dtype')}"
    elif rows and "layer" in rows[0]:
        bars = [Bar(_skew_panel(r), _shape_group(r), r["layer"], r["fwdbwd_tflops"]) for r in rows]
        label, title = "fwd+bwd expert TFLOP/s", f"MoE layer per backend vs stock torchtitan, {device}, {meta.get('dtype')}"
    elif rows and "tokens_per_s" in rows[0]:
        bars = [Bar("", f"{r['flavor']} ({r['layers']} layers)", r["backend"], r["tflops"]) for r in rows]
        label, title = "model TFLOP/s", f"Training step per backend, {device}"
    elif _ep_rows(results):
        bars, with_raw = [], set()
        for r in _ep_rows(results):
            panel, group = f"{r['world']} ranks, {r['routing']} routing", f"T{r['tokens_per_rank']} D{r['dim']}"
            if (panel, group) not in with_raw:
                with_raw.add((panel, group))
                bars.append(Bar(panel, group, "raw all-to-all", r["raw_a2a_GBps"]))
                if "raw_a2a_unique" in r["ms"]:
                    unique_GBps = r["raw_a2a_GBps"] * r["ms"]["raw_a2a"] / r["ms"]["raw_a2a_unique"]
                    bars.append(Bar(panel, group, "raw all-to-all, each token once per rank", unique_GBps))
            transport = r.get("transport", "all_to_all")
            how = f"all_to_all, {r['permute_backend']} permute" if transport == "all_to_all" else transport
            bars.append(Bar(panel, group, f"dispatch+combine ({how})", r["dispatch_combine_GBps"]))
        label, title = "GB/s per rank (routed rows' remote bytes / time)", f"EP dispatch + combine, {device}"
    else:
        raise ValueError("not a result file of python -m torchtitan_ext.bench (no rows to plot)")
    if only:
        bars = [bar for bar in bars if bar.series in only]
        if not bars:
            raise ValueError(f"--only {' '.join(sorted(only))}: no such series in these results")
    return bars, label, title


def plot(results: dict, path: str, only: Iterable[str] | None = None) -> None:
    """Write a PNG of ``results`` (grouped bars, one panel per routing / world) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars, label, title = bars_of(results, only)
    panels = list(dict.fromkeys(bar.panel for bar in bars))
    series = list(dict.fromkeys(bar.series for bar in bars))
    figure, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False,
                                layout="constrained")
    width = 0.8 / len(series)
    for axis, panel in zip(axes[:, 0], panels):
        groups = list(dict.fromkeys(bar.group for bar in bars if bar.panel == panel))
        values = {(bar.group, bar.series): bar.value for bar in bars if bar.panel == panel}
        for index, name in enumerate(series):
            positions = [g + (index - (len(series) - 1) / 2) * width for g in range(len(groups))]
            heights = [values.get((group, name), 0.0) for group in groups]
            axis.bar(positions, heights, width, label=name)
        axis.set_xticks(range(len(groups)), groups)
        axis.set_ylabel(label)
        axis.set_title(panel, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=8, ncol=min(len(series), 3))
    figure.suptitle(title, fontsize=11)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_file(json_path: str, png_path: str, only: Iterable[str] | None = None) -> None:
    with open(json_path) as f:
        plot(json.load(f), png_path, only)
