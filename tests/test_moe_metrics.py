"""MoE metrics: a CPU training run logged to an offline wandb run, read back from its
``.wandb`` file, its console output, and unit checks of the routing statistics on forced
routings."""

import glob
import io
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import apply_overrides
from torchtitan_ext.metrics.observer import MoERoutingObserver, summarize
from torchtitan_ext.metrics.processor import RunProgress, heatmap_due, profiler_output_lines, run_summary_lines
from torchtitan_ext.metrics.statistics import (
    HEATMAP_SCALE_MAX,
    layer_scalars,
    routing_heatmap_png,
    routing_scalars,
)
from torchtitan_ext.metrics.wandb_setup import (
    WandbRunLocation,
    configure_wandb_environment,
    wandb_run_location,
)
from torchtitan_ext.run_training import resolve_config

NUM_EXPERTS, TOP_K, BATCH, SEQ_LEN = 8, 2, 8, 128  # the tiny flavors
ROUTED_PER_STEP = BATCH * SEQ_LEN * TOP_K
LAYERS = ("layer_0", "layer_1")
WANDB_MISSING = "wandb (a dependency of the project) is not installed: these checks read the files of a wandb run"


def read_wandb_records(path):
    """Records of a ``.wandb`` file: a 7-byte header, then LevelDB-log chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    position, block_size, pending = 7, 32768, b""
    while position + 7 <= len(data):
        if block_size - position % block_size < 7:  # block trailer too short for a header
            position += block_size - position % block_size
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        chunk_type = data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if chunk_type in (1, 4):  # FULL or LAST chunk: a record is complete
            # pyrefly: ignore[missing-attribute]  # a protobuf module generated without type stubs
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_history_and_config(path) -> tuple[dict[int, dict], dict]:
    """({step: {key: value}}, run config) with nested keys joined by '/'."""
    history, config = {}, {}
    for record in read_wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return history, config


@dataclass(frozen=True)
class OfflineRun:
    history: dict[int, dict]
    config: dict
    root: Path
    run_folder: Path
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory) -> OfflineRun:
    """Four steps of the padded tiny flavor, log_freq 2 (logs at 1, 2, 4), wandb without credentials.

    Output goes to pipes (not a terminal), and colour printing is left at its default.
    """
    pytest.importorskip("wandb", reason=WANDB_MISSING)
    root = tmp_path_factory.mktemp("moe_metrics")
    toml = root / "metrics.toml"
    toml.write_text(
        '[wandb]\nenable = true\nproject = "moe-metrics-test"\nrun_name = "tiny-padded"\n'
        "[moe_metrics]\nheatmap_every = 3\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        HOME=str(root / "home"),
        NETRC=str(root / "no-netrc"),
        WANDB_CONFIG_DIR=str(root / "wandb-config"),
        WANDB_CACHE_DIR=str(root / "wandb-cache"),
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_ext.train",
            "--flavor",
            "tiny-moe-batched-mm-padded",
            "--toml",
            str(toml),
            "--training.steps",
            "4",
            "--metrics.log_freq",
            "2",
            "--metrics.enable_tensorboard",
            "--dump_folder",
            str(root / "dump"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    run_files = glob.glob(str(root / "dump" / "wandb" / "*" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(run_files) == 1, "wandb did not write one offline run under the dump folder"
    history, config = wandb_history_and_config(run_files[0])
    return OfflineRun(history, config, root, Path(run_files[0]).parent, result.stdout, result.stderr)


def console_messages(stdout: str) -> list[str]:
    """The messages of torchtitan's console lines (after ``... - LEVEL - ``)."""
    return [line.split(" - ", 3)[3] for line in stdout.splitlines() if line.startswith("[titan]")]


def test_offline_run_logs_moe_metrics_per_layer(offline_run):
    history = offline_run.history
    assert sorted(history) == [1, 2, 4]
    for step, window_steps in ((1, 1), (2, 1), (4, 2)):
        row = history[step]
        for scope in LAYERS:
            prefix = f"moe/{scope}/"
            assert sum(row[prefix + "tokens_per_expert/values"]) == ROUTED_PER_STEP * window_steps
            assert row[prefix + "tokens_per_expert/bins"] == list(range(NUM_EXPERTS + 1))
            assert row[prefix + "routed_tokens"] == ROUTED_PER_STEP * window_steps
            assert 1.0 <= row[prefix + "load_imbalance"] <= NUM_EXPERTS / TOP_K
            assert row[prefix + "load_cv"] >= 0
            assert 0 <= row[prefix + "dead_expert_fraction"] <= 1
            assert 0 <= row[prefix + "router_entropy"] <= math.log(NUM_EXPERTS) + 1e-9
            assert row[prefix + "expert_bias_norm"] > 0  # torchtitan's aux-loss-free balancing is on
            counts = np.array(row[prefix + "tokens_per_expert/values"])
            expected_padding = (NUM_EXPERTS * counts.max() - counts.sum()) / window_steps
            assert row[prefix + "padding_rows_per_step"] >= 0
            if window_steps == 1:  # one forward per step: the padding follows from the counts
                assert row[prefix + "padding_rows_per_step"] == pytest.approx(expected_padding)
        model = "moe/model/"
        assert sum(row[model + "tokens_per_expert/values"]) == len(LAYERS) * ROUTED_PER_STEP * window_steps
        assert row[model + "load_imbalance_max"] == max(row[f"moe/{s}/load_imbalance"] for s in LAYERS)
        assert row[model + "padding_rows_per_step"] == pytest.approx(
            sum(row[f"moe/{s}/padding_rows_per_step"] for s in LAYERS)
        )
        assert "loss_metrics/global_avg_loss" in row  # torchtitan's own metrics in the same rows
        if not torch.cuda.is_available():  # the CUDA allocator's counts mean nothing on CPU
            assert "memory/num_ooms" not in row and "memory/num_alloc_retries" not in row
    assert history[1]["moe/model/tokens_per_expert_heatmap/_type"] == "image-file"
    assert "moe/model/tokens_per_expert_heatmap/_type" not in history[2]  # next due at step >= 4
    assert history[4]["moe/model/tokens_per_expert_heatmap/_type"] == "image-file"


def test_offline_run_config_has_run_metadata(offline_run):
    config, root = offline_run.config, offline_run.root
    metadata = config["run_metadata"]
    assert metadata["flavor"] == "tiny-moe-batched-mm-padded"
    assert metadata["compute_backend"] == "batched_mm_padded"
    assert metadata["expert_parallel_degree"] == 1
    assert metadata["toml_files"] == [str(root / "metrics.toml")]
    assert metadata["toml_overrides"][str(root / "metrics.toml")]["wandb.project"] == "moe-metrics-test"
    assert config["metrics"]["heatmap_every"] == 3  # the fully resolved config is there too
    assert config["training"]["steps"] == 4 and "layers" in config["model_spec"]["model"]


def test_offline_run_writes_tensorboard_events(offline_run):
    root = offline_run.root
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_dir,) = {os.path.dirname(p) for p in glob.glob(str(root / "dump" / "tb" / "*" / "events.*"))}
    assert not glob.glob(str(root / "dump" / "tb" / "*" / "wandb"))  # wandb's run has a folder of its own
    events = EventAccumulator(events_dir, size_guidance={"histograms": 0, "images": 0}).Reload()
    # pyrefly: ignore[bad-assignment]  # tensorboard types Tags() as dict[str, bool | list]; these keys hold lists
    tags: dict[str, list[str]] = events.Tags()
    assert "moe/layer_0/load_imbalance" in tags["scalars"]
    assert "moe/layer_1/tokens_per_expert" in tags["histograms"]
    assert "moe/model/tokens_per_expert_heatmap" in tags["images"]


def test_console_has_moe_line_after_each_step_line_and_no_colour_codes(offline_run):
    assert "\x1b[" not in offline_run.stdout  # output is a pipe, not a terminal
    messages = console_messages(offline_run.stdout)
    step_lines = [i for i, message in enumerate(messages) if message.startswith("step:")]
    assert len(step_lines) == 3
    for index in step_lines:
        assert messages[index + 1].startswith("moe: imbalance")
    assert sum(message.startswith("moe:") for message in messages) == 3
    if not torch.cuda.is_available():
        assert not any("tflops" in message or "mfu" in message for message in messages)
        assert "tps: " in messages[step_lines[0]]


def test_console_ends_with_run_summary_and_wandb_sync_command(offline_run):
    messages = console_messages(offline_run.stdout)
    summary_start = next(i for i, m in enumerate(messages) if m.startswith("run summary:"))
    summary = messages[summary_start : summary_start + 4]
    assert re.fullmatch(
        r"run summary: 4 steps run \(last step 4\), loss \d+\.\d{4} \(step 1\) -> "
        r"\d+\.\d{4} \(step 4\), wall time \d+\.\d s, first step done after \d+\.\d s",
        summary[0],
    )
    assert summary[1] == f"  output folder:     {offline_run.root / 'dump'}"
    assert summary[2] == "  checkpoint folder: none (checkpoint.enable is false)"
    folder = offline_run.run_folder
    assert summary[3] == f"  wandb run:         {folder} (offline; upload it with: wandb sync {folder})"
    assert f"wandb: run folder {folder} (offline; upload it with: wandb sync {folder})" in messages
    assert "Run data is saved locally in" in offline_run.stderr + offline_run.stdout  # wandb is not silenced


def test_run_summary_lines():
    progress = RunProgress(steps_run=20, last_step=20, first_step_seconds=4.56)
    progress.record_loss(1, 6.5)
    progress.record_loss(20, 2.25)
    online = WandbRunLocation(folder="/runs/run-1", url="https://wandb.ai/team/project/runs/1")
    lines = run_summary_lines(
        progress, output_folder="/out", checkpoint_folder="/out/checkpoint", wandb_run=online, wall_seconds=12.34
    )
    assert lines == [
        "run summary: 20 steps run (last step 20), loss 6.5000 (step 1) -> 2.2500 (step 20), wall time 12.3 s, "
        "first step done after 4.6 s",
        "  output folder:     /out",
        "  checkpoint folder: /out/checkpoint",
        "  wandb run:         https://wandb.ai/team/project/runs/1 (local files: /runs/run-1)",
    ]
    assert online.sync_command is None
    assert WandbRunLocation(folder="/a b", url=None).sync_command == "wandb sync '/a b'"
    nothing = run_summary_lines(
        RunProgress(), output_folder="/out", checkpoint_folder=None, wandb_run=None, wall_seconds=0.0
    )
    assert nothing[0] == "run summary: 0 steps run, no loss logged, wall time 0.0 s" and len(nothing) == 3


def test_the_run_summary_gives_the_gpu_memory_peaks_of_the_whole_run(monkeypatch):
    """torchtitan resets the allocator's peaks at every logged step: the run's peaks are the largest of
    each interval's, allocated and reserved apart."""
    intervals = iter([(5, 8), (7, 7), (6, 9)])

    def memory_stats():
        allocated, reserved = next(intervals)
        return {"active_bytes.all.peak": allocated * 2**30, "reserved_bytes.all.peak": reserved * 2**30}

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    progress = RunProgress()
    for _ in range(3):
        progress.record_gpu_memory_peaks()
    lines = run_summary_lines(progress, output_folder="/out", checkpoint_folder=None, wandb_run=None, wall_seconds=1.0)
    assert (
        lines[-1] == "  peak GPU memory:   7.00 GiB allocated, 9.00 GiB reserved by the caching allocator (this rank)"
    )


def test_wandb_run_location_of_a_live_offline_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason=WANDB_MISSING)

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    run = wandb.init(project="location-test", dir=str(tmp_path))
    try:
        location = wandb_run_location(run)
    finally:
        wandb.finish()
    assert location.url is None and Path(location.folder).name.startswith("offline-run-")
    assert list(Path(location.folder).glob("run-*.wandb"))
    assert location.sync_command == f"wandb sync {location.folder}"


def test_heatmap_steps_follow_multiples_of_heatmap_every():
    def heatmap_steps(log_steps, every):
        drawn, last = [], None
        for step in log_steps:
            if heatmap_due(step, last, every):
                drawn.append(step)
                last = step
        return drawn

    every_tenth = [1, *range(10, 201, 10)]
    assert heatmap_steps(every_tenth, 50) == [1, 50, 100, 150, 200]
    assert heatmap_steps([1, *range(30, 201, 30)], 50) == [1, 60, 120, 150]
    assert heatmap_steps(every_tenth, 0) == []


def test_heatmaps_of_different_steps_share_one_colour_scale():
    from PIL import Image

    def pixel(png: bytes, xy_fraction: tuple[float, float]) -> float | tuple[int, ...] | None:
        image = Image.open(io.BytesIO(png)).convert("RGB")
        return image.getpixel((int(image.width * xy_fraction[0]), int(image.height * xy_fraction[1])))

    balanced_layer = np.full(8, 10.0)
    mild = np.stack([balanced_layer, np.array([2, 1, 1, 1, 1, 1, 1, 0]) * 5.0])
    extreme = np.stack([balanced_layer, np.array([8 * HEATMAP_SCALE_MAX, 0, 0, 0, 0, 0, 0, 0])])
    names = ["layer_0", "layer_1"]
    # the balanced layer (top row) keeps its colour whatever the other layer's range
    assert pixel(routing_heatmap_png(mild, names, 1), (0.3, 0.3)) == pixel(
        routing_heatmap_png(extreme, names, 2), (0.3, 0.3)
    )


def test_routing_scalars_on_crafted_loads():
    balanced = routing_scalars(np.full(8, 100))
    assert balanced == {"load_imbalance": 1.0, "load_cv": 0.0, "dead_expert_fraction": 0.0}
    one_expert = routing_scalars(np.array([800, 0, 0, 0, 0, 0, 0, 0]))
    assert one_expert["load_imbalance"] == 8.0
    assert one_expert["dead_expert_fraction"] == 7 / 8
    assert one_expert["load_cv"] == pytest.approx(math.sqrt(7))
    half = routing_scalars(np.array([200, 200, 200, 200, 0, 0, 0, 0]))
    assert half["load_imbalance"] == 2.0 and half["dead_expert_fraction"] == 0.5


def tiny_moe_layer() -> torch.nn.Module:
    """One MoE layer of the tiny flavor, initialised, in training mode."""
    config = resolve_config("tiny-moe-grouped-mm", [])
    moe = config.model_spec.model.layers[0].moe.build()
    torch.manual_seed(0)
    moe.init_states(buffer_device=torch.device("cpu"))
    return moe.train()


def observe(moe: torch.nn.Module, steps: int = 1) -> dict[str, float]:
    observer = MoERoutingObserver([torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": moe})})], None)
    torch.manual_seed(1)
    for _ in range(steps):
        moe(torch.randn(BATCH, SEQ_LEN, 64)).sum().backward()
    (summary,) = summarize(observer, num_steps=steps, reduce_groups=[])
    observer.remove()
    assert summary.name == "layer_0"
    return layer_scalars(summary)


def test_router_biased_to_two_experts_shows_imbalance_and_dead_experts():
    moe = tiny_moe_layer()
    natural = observe(moe)
    assert natural["routed_tokens"] == ROUTED_PER_STEP
    assert natural["dead_expert_fraction"] == 0.0
    assert natural["load_imbalance"] < 2.0

    with torch.no_grad():  # the routing bias makes experts 0 and 1 every token's top 2
        moe.get_buffer("expert_bias_E").copy_(torch.tensor([10.0, 10.0, 0, 0, 0, 0, 0, 0]))
    forced = observe(moe, steps=2)
    assert forced["routed_tokens"] == 2 * ROUTED_PER_STEP
    assert forced["load_imbalance"] == NUM_EXPERTS / TOP_K
    assert forced["dead_expert_fraction"] == 6 / 8
    assert forced["load_cv"] > natural["load_cv"]
    assert forced["expert_bias_norm"] == pytest.approx(math.sqrt(200))
    assert 0 <= forced["router_entropy"] <= math.log(NUM_EXPERTS)  # the gate itself is unchanged


def test_eval_forwards_are_not_counted():
    moe = tiny_moe_layer()
    observer = MoERoutingObserver([torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": moe})})], None)
    with torch.no_grad():
        moe.eval()(torch.randn(2, 16, 64))
    (summary,) = summarize(observer, num_steps=1, reduce_groups=[])
    assert summary.tokens_per_expert_E.sum() == 0 and summary.num_tokens == 0


def test_heatmap_is_a_png():
    png = routing_heatmap_png(np.arange(16).reshape(2, 8), ["layer_0", "layer_1"], step=5)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("layers, experts, most_pixels", [(48, 128, (1200, 800)), (2, 8, (500, 300))])
def test_a_heatmap_of_any_size_stays_within_a_readable_image(layers, experts, most_pixels):
    """Qwen3-30B-A3B's 48 x 128 map was 3400 x 1590 px with 7-pt labels; text no longer shrinks with the map."""
    from PIL import Image

    names = [f"layer_{i}" for i in range(layers)]
    png = routing_heatmap_png(np.arange(layers * experts).reshape(layers, experts) % 7, names, step=1)
    width, height = Image.open(io.BytesIO(png)).size
    assert width <= most_pixels[0] and height <= most_pixels[1]
    assert width >= 0.8 * most_pixels[0] and height >= 0.8 * most_pixels[1]


def test_wandb_goes_offline_without_credentials(monkeypatch, tmp_path):
    for variable in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    configure_wandb_environment(project="p", entity=None, run_name=None)
    assert os.environ["WANDB_MODE"] == "offline" and os.environ["WANDB_PROJECT"] == "p"

    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password secret\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    configure_wandb_environment(project=None, entity=None, run_name=None)
    assert "WANDB_MODE" not in os.environ


def test_toml_short_keys_set_metrics_fields():
    config = resolve_config("tiny-moe-for-loop", [])
    config = apply_overrides(
        config,
        {
            "moe_metrics.enable": False,
            "moe_metrics.heatmap_every": 7,
            "wandb.project": "p",
            "wandb.entity": "e",
            "wandb.run_name": "r",
        },
    )
    metrics = config.metrics
    assert (metrics.moe_metrics, metrics.heatmap_every) == (False, 7)
    assert (metrics.wandb_project, metrics.wandb_entity, metrics.wandb_run_name) == ("p", "e", "r")
    with pytest.raises(ConfigError, match="heatmap_every"):
        apply_overrides(config, {"moe_metrics.heatmap_every": -1})
    with pytest.raises(ConfigError, match=r"moe_metrics\.enable"):
        apply_overrides(config, {"moe_metrics.enable": "yes"})


def test_the_run_summary_names_the_profiler_outputs_and_the_commands_that_read_them():
    config = {
        "profiler": {
            "enable_profiling": True,
            "save_traces_folder": "profiling/traces",
            "enable_memory_snapshot": True,
            "save_memory_snapshot_folder": "snapshots",
        }
    }
    lines = profiler_output_lines("/out", config)
    assert lines == [
        "  profiler traces:   /out/profiling/traces (where a step's time went: python -m torchtitan_ext.bench trace "
        "/out/profiling/traces/iteration_N/rank0_trace.json.gz)",
        "  memory snapshots:  /out/snapshots (where the reserved memory came from: python -m torchtitan_ext.bench "
        "memory /out/snapshots/step_N)",
    ]
    summary = run_summary_lines(
        RunProgress(),
        output_folder="/out",
        checkpoint_folder=None,
        wandb_run=None,
        wall_seconds=1.0,
        profiler_lines=lines,
    )
    assert summary[-2:] == lines
    assert profiler_output_lines("/out", {"profiler": {"enable_profiling": False}}) == []
    assert profiler_output_lines("/out", None) == []
