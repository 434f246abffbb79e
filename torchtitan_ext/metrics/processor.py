"""``MoEMetricsProcessor``: torchtitan's ``MetricsProcessor`` that also logs MoE routing metrics.

At torchtitan's log frequency it adds per-MoE-layer and whole-model routing statistics
(key reference: docs/metrics.md). Scalars travel with torchtitan's own metrics to every
enabled logger (wandb, TensorBoard); the tokens-per-expert histograms and the layers x
experts heatmap go to each logger in its own format.

Console: each log step prints torchtitan's ``step:`` line, then one ``moe:`` line;
on CPU the step line has no TFLOP/s or MFU columns (they are measured against a GPU's
peak); colour codes only go to a terminal; ``close`` prints a run summary (steps,
first and last loss, wall time, output, checkpoint and wandb folders).
"""

import dataclasses
import io
import logging
import os
import re
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    TensorBoardLogger,
    WandBLogger,
)
from torchtitan.tools.logging import logger
from torchtitan.tools.profiler import MEMORY_DIR, PROFILE_DIR
from torchtitan.tools.utils import NoColor

import torchtitan_ext.metrics.toml_keys  # noqa: F401  (registers the TOML keys)
from torchtitan_ext.compat import cpu_training
from torchtitan_ext.metrics.metadata import run_metadata
from torchtitan_ext.metrics.observer import ExpertParallelPlacement, MoERoutingObserver, summarize
from torchtitan_ext.metrics.statistics import layer_scalars, model_scalars, routing_heatmap_png
from torchtitan_ext.metrics.wandb_setup import (
    WandbRunLocation,
    configure_wandb_environment,
    wandb_run_location,
)
from torchtitan_ext.place_in_launch import is_rank_zero

KEY_PREFIX = "moe"
MODEL_SCOPE = "model"


GPU_ONLY_METRICS = ("tflops", "mfu(%)", "memory/num_alloc_retries", "memory/num_ooms")
"""torchtitan metrics meaningless on CPU: rates against a GPU's peak FLOP/s, and the CUDA caching
allocator's retry and out-of-memory counts (a CPU run has neither: they are always 0)."""

WANDB_FOLDER = "wandb"
"""Where wandb runs go in the dump folder (torchtitan puts them under its TensorBoard folder)."""

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
    """What the closing summary reports: steps run, first and last logged loss, start time, and the
    seconds from the start (the trainer builds its metrics before the model) to the end of the first
    step: model build, parallelisation, checkpoint load, compilation and Triton autotuning included."""

    started: float = field(default_factory=time.perf_counter)
    interrupted: bool = False
    steps_run: int = 0
    first_step_seconds: float | None = None
    last_step: int | None = None
    first_loss: tuple[int, float] | None = None
    last_loss: tuple[int, float] | None = None
    peak_allocated_bytes: int | None = None
    """The most GPU memory this rank's tensors held at once (None: no GPU)."""
    peak_reserved_bytes: int | None = None
    """The most GPU memory this rank's caching allocator held at once, what torchtitan's step line
    reports as ``memory`` (allocated plus cached, fragmentation included)."""

    def record_loss(self, step: int, loss: float) -> None:
        if self.first_loss is None:
            self.first_loss = (step, loss)
        self.last_loss = (step, loss)

    def record_gpu_memory_peaks(self) -> None:
        """Fold the CUDA allocator's peaks since its last reset into the run's; torchtitan resets them at
        every logged step, so calling this before each reset and at the end covers the whole run."""
        stats = torch.cuda.memory_stats()
        allocated, reserved = stats.get("active_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)
        self.peak_allocated_bytes = max(self.peak_allocated_bytes or 0, allocated)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes or 0, reserved)


def run_summary_lines(
    progress: RunProgress,
    *,
    output_folder: str,
    checkpoint_folder: str | None,
    wandb_run: WandbRunLocation | None,
    wall_seconds: float,
    profiler_lines: Sequence[str] = (),
) -> list[str]:
    """Closing summary: steps, loss, wall time, the GPU memory peaks (when recorded), and where outputs,
    checkpoints, profiler outputs (``profiler_lines``, from ``profiler_output_lines``) and wandb went.

    ``checkpoint_folder`` is None when checkpointing is off.
    """
    steps = f"{progress.steps_run} steps run"
    if progress.last_step is not None:
        steps += f" (last step {progress.last_step})"
    if progress.first_loss is None or progress.last_loss is None:
        loss = "no loss logged"
    else:
        (first_step, first), (last_step, last) = progress.first_loss, progress.last_loss
        loss = f"loss {first:.4f} (step {first_step}) -> {last:.4f} (step {last_step})"
    ended = " (interrupted)" if progress.interrupted else ""
    first_step = (
        "" if progress.first_step_seconds is None else f", first step done after {progress.first_step_seconds:.1f} s"
    )
    lines = [
        f"run summary{ended}: {steps}, {loss}, wall time {wall_seconds:.1f} s{first_step}",
        f"  output folder:     {os.path.abspath(output_folder)}",
        "  checkpoint folder: "
        + (os.path.abspath(checkpoint_folder) if checkpoint_folder else "none (checkpoint.enable is false)"),
    ]
    if progress.peak_allocated_bytes is not None and progress.peak_reserved_bytes is not None:
        lines.append(
            f"  peak GPU memory:   {progress.peak_allocated_bytes / 2**30:.2f} GiB allocated, "
            f"{progress.peak_reserved_bytes / 2**30:.2f} GiB reserved by the caching allocator (this rank)"
        )
    lines += profiler_lines
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
        self._rich_loggers: list[WandBLogger | TensorBoardLogger] = []
        self._wandb_run: WandbRunLocation | None = None
        self._progress = RunProgress()
        self._output_folder = dump_folder
        self._checkpoint_folder = _checkpoint_folder(dump_folder, config_dict)
        self._profiler_output_lines = profiler_output_lines(dump_folder, config_dict)
        self._on_cpu = cpu_training()
        super().__init__(config, dump_folder=dump_folder, config_dict=config_dict, **kwargs)
        _open_processors.add(self)
        if not sys.stdout.isatty():
            self.color = NoColor()

    # pyrefly: ignore[bad-override-mutable-attribute]  # torchtitan builds the processor from this Config
    config: Config

    # pyrefly: ignore[bad-override]  # torchtitan passes the processor's own config, this Config
    def _build_metric_logger(self, *, config: Config, config_dict=None, **kwargs) -> BaseLogger:
        """torchtitan's loggers; wandb's run in ``WANDB_FOLDER`` of the dump folder, TensorBoard's in its own."""
        if config.enable_wandb:
            configure_wandb_environment(
                project=config.wandb_project, entity=config.wandb_entity, run_name=config.wandb_run_name
            )
        config_dict = {**(config_dict or {}), "run_metadata": run_metadata()}
        parts = []
        if config.enable_wandb:
            parts.append(dataclasses.replace(config, enable_tensorboard=False, save_tb_folder=WANDB_FOLDER))
        if config.enable_tensorboard:
            parts.append(dataclasses.replace(config, enable_wandb=False))
        built = LoggerContainer()
        for part in parts:
            for child in getattr(
                super()._build_metric_logger(config=part, config_dict=config_dict, **kwargs), "_loggers", []
            ):
                built.add_logger(child)
        children = built._loggers
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
        if self._progress.steps_run == 1:
            self._progress.first_step_seconds = time.perf_counter() - self._progress.started
            if is_rank_zero():
                logger.info(
                    f"first step done after {self._progress.first_step_seconds:.1f} s (building and "
                    "parallelising the model, loading a checkpoint, compiling and autotuning included)"
                )

    def _expert_parallel_placement(self) -> ExpertParallelPlacement | None:
        if not self.parallel_dims.ep_enabled:
            return None
        ep_mesh = self.parallel_dims.get_mesh("ep")
        return ExpertParallelPlacement(rank=ep_mesh.get_local_rank(), degree=self.parallel_dims.ep)

    def _reduce_groups(self, observer: MoERoutingObserver) -> list:
        """Groups whose ranks route different tokens: the loss mesh, and TP when it shards tokens."""
        groups = []
        loss_mesh = self.parallel_dims.get_optional_mesh("loss")
        if loss_mesh is not None:
            groups.append(loss_mesh.get_group())
        if self.parallel_dims.tp_enabled and any(layer.sharded_tokens for layer in observer.layers):
            groups.append(self.parallel_dims.get_mesh("tp").get_group())
        return groups

    def collect_moe_metrics(self, step: int) -> tuple[dict[str, float], dict[str, Any]]:
        """(scalars by full key, rich payload) for ``step``; resets the accumulators."""
        observer = self._observer
        assert observer is not None, "MoE metrics are collected only while MoE layers are watched"
        summaries = summarize(
            observer, num_steps=max(self._steps_since_log, 1), reduce_groups=self._reduce_groups(observer)
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
        rich: dict[str, Any] = {"histograms": histograms}
        if self._heatmap_due(step):
            self._last_heatmap_step = step
            rich["heatmap"] = (counts_per_layer_expert, [s.name for s in summaries])
        return scalars, rich

    def _heatmap_due(self, step: int) -> bool:
        return bool(self._rich_loggers) and heatmap_due(step, self._last_heatmap_step, self.config.heatmap_every)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        """torchtitan's metrics and step line, then the MoE metrics' ``moe:`` line."""
        moe_line = None
        if self._observer is not None:
            scalars, rich = self.collect_moe_metrics(step)
            extra_metrics = {**(extra_metrics or {}), **scalars}
            self._log_rich(rich, step)
            moe_line = moe_console_line(scalars)
        self._progress.last_step = step
        self._progress.record_loss(step, global_avg_loss)
        if not self._on_cpu:
            self._progress.record_gpu_memory_peaks()
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
        _open_processors.discard(self)
        super().close()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank != 0 and self._wandb_run is None:
            return
        if not self._on_cpu:
            self._progress.record_gpu_memory_peaks()
        for line in run_summary_lines(
            self._progress,
            output_folder=self._output_folder,
            checkpoint_folder=self._checkpoint_folder,
            wandb_run=self._wandb_run,
            wall_seconds=time.perf_counter() - self._progress.started,
            profiler_lines=self._profiler_output_lines,
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


_open_processors: "weakref.WeakSet[MoEMetricsProcessor]" = weakref.WeakSet()
"""Processors whose run has not closed them yet (``close_interrupted_runs``)."""


def close_interrupted_runs() -> None:
    """After Ctrl-C, which skips the trainer's close: close every open processor's loggers and print its
    run summary, marked interrupted."""
    for processor in list(_open_processors):
        processor._progress.interrupted = True
        processor.close()


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


def profiler_output_lines(dump_folder: str, config_dict: dict[str, Any] | None) -> list[str]:
    """Summary lines for what torchtitan's profiler wrote (``profiler.enable_profiling``: Chrome traces;
    ``profiler.enable_memory_snapshot``: allocator snapshots): the folder and the command that reads it."""
    profiler = (config_dict or {}).get("profiler") or {}
    lines = []
    if profiler.get("enable_profiling"):
        traces = os.path.abspath(os.path.join(dump_folder, profiler.get("save_traces_folder", PROFILE_DIR)))
        lines.append(
            f"  profiler traces:   {traces} (where a step's time went: python -m torchtitan_ext.bench trace "
            f"{traces}/iteration_N/rank0_trace.json.gz)"
        )
    if profiler.get("enable_memory_snapshot"):
        snapshots = os.path.abspath(os.path.join(dump_folder, profiler.get("save_memory_snapshot_folder", MEMORY_DIR)))
        lines.append(
            f"  memory snapshots:  {snapshots} (where the reserved memory came from: python -m torchtitan_ext.bench "
            f"memory {snapshots}/step_N)"
        )
    return lines


def _checkpoint_folder(dump_folder: str, config_dict: dict[str, Any] | None) -> str | None:
    """torchtitan's checkpoint folder (``dump_folder/checkpoint.folder``), None when checkpointing is off."""
    checkpoint = (config_dict or {}).get("checkpoint") or {}
    if not checkpoint.get("enable"):
        return None
    return os.path.join(dump_folder, checkpoint.get("folder", "checkpoint"))


def _log_rich_wandb(
    wandb_logger: WandBLogger, histograms: dict[str, np.ndarray], heatmap_png: bytes | None, step: int
) -> None:
    wandb = wandb_logger.wandb
    payload: dict[str, Any] = {
        key: wandb.Histogram(np_histogram=(counts, np.arange(len(counts) + 1))) for key, counts in histograms.items()
    }
    if heatmap_png is not None:
        from PIL import Image

        payload[f"{KEY_PREFIX}/{MODEL_SCOPE}/tokens_per_expert_heatmap"] = wandb.Image(
            Image.open(io.BytesIO(heatmap_png)), caption=f"step {step}"
        )
    wandb.log(payload, step=step)


def _log_rich_tensorboard(
    tb_logger: TensorBoardLogger, histograms: dict[str, np.ndarray], heatmap_png: bytes | None, step: int
) -> None:
    writer = tb_logger.writer
    for key, counts in histograms.items():
        experts = np.arange(len(counts), dtype=np.float64)
        writer.add_histogram_raw(
            key,
            min=0.0,
            max=float(len(counts)),
            num=float(counts.sum()),
            sum=float((experts * counts).sum()),
            sum_squares=float((experts**2 * counts).sum()),
            bucket_limits=(experts + 1).tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )
    if heatmap_png is not None:
        from PIL import Image

        image = np.asarray(Image.open(io.BytesIO(heatmap_png)).convert("RGB"))
        writer.add_image(f"{KEY_PREFIX}/{MODEL_SCOPE}/tokens_per_expert_heatmap", image, step, dataformats="HWC")
