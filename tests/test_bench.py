"""The benchmark CLI on CPU with tiny shapes, its plots, and the "auto" compute-backend choice."""

import dataclasses
import json
import pickle
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import make_backend_unavailable

from torchtitan_ext.bench import __main__ as bench_cli
from torchtitan_ext.bench import common, expert_block, moe_layer
from torchtitan_ext.bench.__main__ import flavor_shapes, main
from torchtitan_ext.bench.common import PROJECT_ROOT, SHAPES, TINY_SHAPE, checkout_commit, relative_error, source_commit
from torchtitan_ext.bench.plot import chart_of, plot
from torchtitan_ext.config import ConfigError
from torchtitan_ext.experiments.moe_backends import auto_backend
from torchtitan_ext.experiments.moe_backends.expert_timing import (
    BenchShape,
    Timer,
    expert_inputs,
    host_issue_ms,
    interleaved_round,
    make_timer,
    turn_order,
)
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts, runnable_backends
from torchtitan_ext.metrics.metadata import run_metadata
from torchtitan_ext.run_training import FlavorConfigManager

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
PNG_MAGIC = b"\x89PNG"
TORCH_BACKENDS = ["grouped_mm", "for_loop", "batched_mm_padded"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(auto_backend.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("WORLD_SIZE", "1")


def run_main(argv, tmp_path) -> dict:
    """Run a subcommand writing JSON and PNG into tmp_path; the parsed JSON."""
    assert main([*argv, "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")]) == 0
    assert (tmp_path / "out.png").read_bytes()[:4] == PNG_MAGIC
    return json.loads((tmp_path / "out.json").read_text())


ON_CPU = not torch.cuda.is_available()


def test_expert_tiny_shape(tmp_path, capsys):
    results = run_main(["expert", "--tiny", "--skew", "balanced", "--impls", "grouped_mm", "for_loop"], tmp_path)
    out = capsys.readouterr()
    assert "fwd+bwd ms" in out.out and "for_loop" in out.out
    assert "expert block" in out.err  # progress
    assert [row["impl"] for row in results["rows"]] == ["grouped_mm", "for_loop"]
    device = "cpu" if ON_CPU else torch.cuda.get_device_name()
    assert results["meta"]["device"] == device and results["meta"]["command"].startswith(
        "python -m torchtitan_ext.bench expert"
    )
    for row in results["rows"]:
        assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0
    if ON_CPU:  # FLOP rates and memory are GPU figures: neither in the rows nor in the table
        assert all(row["fwdbwd_tflops"] is None and row["fwdbwd_peak_mb"] is None for row in results["rows"])
        assert "TF/s" not in out.out and "peak MB" not in out.out


def test_expert_explicit_dims(tmp_path):
    results = run_main(
        [
            "expert",
            "--dim",
            "16",
            "--hidden",
            "24",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--tokens",
            "16",
            "--skew",
            "skewed",
            "--impls",
            "batched_mm_padded",
        ],
        tmp_path,
    )
    (row,) = results["rows"]
    assert row["shape"] == "D16-F24-E4-K2-T16" and row["skew"] == 2.0
    assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0


def test_layer_shapes_from_flavor(tmp_path, capsys):
    results = run_main(
        [
            *("layer", "--flavor", "tiny-moe-for-loop", "--tokens", "32", "--skew", "balanced"),
            *("--layers", "for_loop", "--compile", "eager"),
        ],
        tmp_path,
    )
    assert "err vs stock" in capsys.readouterr().out
    assert [row["layer"] for row in results["rows"]] == ["torchtitan", "for_loop"]
    assert results["rows"][0]["shape"] == "tiny-moe-for-loop"
    assert all(row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 and row["fwdbwd_speedup"] > 0 for row in results["rows"])


TRAIN_STEP_ARGV = [
    *("train-step", "--flavor", "tiny-moe-grouped-mm", "--backends", "for_loop", "grouped_mm"),
    *("--batch-size", "2", "--seq-len", "16", "--compile", "eager"),  # eager: CUDA's default adds compiled rows
]


def test_train_step_tiny_flavor(tmp_path, capsys):
    results = run_main(TRAIN_STEP_ARGV, tmp_path)
    out = capsys.readouterr().out
    assert "tokens/s" in out and "step-1 loss" in out
    for_loop, grouped_mm = results["rows"]
    assert for_loop["backend"] == "for_loop" and for_loop["tokens"] == 32
    assert for_loop["step_ms"] > 0 and for_loop["tokens_per_s"] > 0 and for_loop["flops_per_token"] > 0
    assert for_loop["first_loss"] == pytest.approx(grouped_mm["first_loss"], abs=1e-3)  # same weights, same tokens
    if ON_CPU:
        assert for_loop["tflops"] is None and for_loop["mfu"] is None and "MFU" not in out


def test_expert_inputs_are_seeded():
    first, again = (expert_inputs(TINY_SHAPE, 2.0, torch.device("cpu"), torch.float32) for _ in range(2))
    assert torch.equal(first.ids_TK, again.ids_TK) and torch.equal(first.x_TD, again.x_TD)
    assert all(torch.equal(a, b) for a, b in zip(first.weights, again.weights))


def test_host_issue_time_is_the_time_to_issue_one_call():
    calls, synchronized = [], []
    tensor = torch.zeros(1, requires_grad=True)

    def issue():
        assert tensor.grad is None
        tensor.grad = torch.ones(1)
        time.sleep(0.004)
        calls.append(len(calls))

    ms = host_issue_ms(issue, [tensor], calls=2, rounds=3, synchronize=lambda: synchronized.append(len(calls)))
    assert len(calls) == 9 and synchronized == [0, 3, 6, 9]
    assert 4.0 <= ms < 40.0


def test_cpu_timer_resets_grads_before_every_call():
    calls, leaf = [], torch.ones(3, requires_grad=True)

    def step():
        assert leaf.grad is None
        (leaf * 2).sum().backward()
        calls.append(1)

    ms = make_timer(torch.device("cpu"), warmup_ms=1, repeat_ms=5)(step, grad_to_none=[leaf])
    assert ms > 0 and len(calls) > 5


def test_plots_of_cpu_results_show_milliseconds(tmp_path):
    expert = run_main(["expert", "--tiny", "--skew", "balanced", "--impls", "grouped_mm", "for_loop"], tmp_path)
    chart = chart_of(expert)
    if ON_CPU:
        assert chart.value_label == "fwd+bwd ms (lower is better)"
        assert [bar.value for bar in chart.bars] == [row["fwdbwd_ms"] for row in expert["rows"]]
    measured = json.loads((RESULTS / "expert_block_h100.json").read_text())
    assert chart_of(measured).value_label == "fwd+bwd TFLOP/s (higher is better)"
    step = {
        "meta": {"device": "cpu"},
        "rows": [
            {
                "flavor": "f",
                "layers": 2,
                "tokens": 64,
                "backend": "b",
                "tokens_per_s": 1e4,
                "tflops": None,
                "step_ms": 147.0,
            }
        ],
    }
    assert [bar.value for bar in chart_of(step).bars] == [147.0]
    step["rows"][0]["step_ms"] = 0.0
    with pytest.raises(ValueError, match="nothing to plot"):
        chart_of(step)
    # a GPU run where one backend ran out of memory: its row has no rate and gets no bar
    gpu_step = {
        "meta": {"device": "H100"},
        "rows": [
            {
                "flavor": "f",
                "layers": 2,
                "tokens": 64,
                "backend": "for_loop",
                "step_ms": None,
                "tokens_per_s": None,
                "error": "out of memory",
            },
            {
                "flavor": "f",
                "layers": 2,
                "tokens": 64,
                "backend": "triton",
                "step_ms": 20.0,
                "tokens_per_s": 1e5,
                "tflops": 150.0,
            },
        ],
    }
    assert [(bar.series, bar.value) for bar in chart_of(gpu_step).bars] == [("triton", 150.0)]


@pytest.mark.skipif(not ON_CPU, reason="full-size shapes run on a GPU")
@pytest.mark.parametrize(
    "argv, refused",
    [
        (["expert", "--flavor", "qwen3-30b-a3b"], "bench expert: qwen3-30b-a3b (dim 2048) is full-size"),
        (["layer", "--shapes", "mixtral-8x7b"], "bench layer: mixtral-8x7b (dim 4096) is full-size"),
        (["expert", "--dim", "2048", "--hidden", "8", "--experts", "4", "--top-k", "2"], "is full-size"),
        (["train-step", "--flavor", "qwen3-30b-a3b", "--backends", "for_loop"], "flavor qwen3-30b-a3b (dim 2048)"),
        (["auto", "--flavor", "olmoe-1b-7b"], "bench auto: flavor olmoe-1b-7b (dim 2048) is full-size"),
    ],
)
def test_full_size_shapes_are_refused_on_cpu(argv, refused, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert refused in err and "needs a CUDA GPU" in err


def test_ep_plot_shows_host_ahead_bandwidth_next_to_back_to_back():
    """Host-ahead bars: the same routed bytes over the host-ahead time, where a row has one."""
    measured = json.loads((RESULTS / "ep_dispatch_h200x2_2026-11-24.json").read_text())
    row = next(r for r in measured["bench"] if r["transport"] == "symm_mem")
    bars = {(bar.panel, bar.group, bar.series): bar.value for bar in chart_of(measured).bars}
    where = (f"2 ranks, {row['routing']} routing", f"T{row['tokens_per_rank']} D{row['dim']}")
    ratio = row["ms"]["dispatch_combine"] / row["ms_host_ahead"]["dispatch_combine"]
    assert bars[(*where, "dispatch+combine (symm_mem), host ahead")] == pytest.approx(
        row["dispatch_combine_GBps"] * ratio
    )
    raw_ratio = row["ms"]["raw_a2a"] / row["ms_host_ahead"]["raw_a2a"]
    assert bars[(*where, "raw all-to-all, host ahead")] == pytest.approx(row["raw_a2a_GBps"] * raw_ratio)
    del row["ms_host_ahead"]
    assert (*where, "dispatch+combine (symm_mem), host ahead") not in {
        (bar.panel, bar.group, bar.series) for bar in chart_of(measured).bars
    }


def test_ep_plot_names_the_cuda_graph_replay_of_static_rows_apart():
    """A row replayed from a CUDA graph is its own series, not a second bar of the exact-rows transport."""
    measured = json.loads((RESULTS / "ep_dispatch_h200x2_2026-11-24.json").read_text())
    exact = next(r for r in measured["bench"] if r["transport"] == "symm_mem")
    replayed = {**exact, "receive_rows": "static", "launch": "cuda_graph", "dispatch_combine_GBps": 1234.0}
    measured["bench"].append(replayed)
    where = (f"2 ranks, {exact['routing']} routing", f"T{exact['tokens_per_rank']} D{exact['dim']}")
    bars = {(bar.panel, bar.group, bar.series): bar.value for bar in chart_of(measured).bars}
    assert bars[(*where, "dispatch+combine (symm_mem, static rows, CUDA graph)")] == 1234.0
    assert bars[(*where, "dispatch+combine (symm_mem)")] == exact["dispatch_combine_GBps"]


@pytest.mark.parametrize(
    "name",
    [
        "expert_block_h100.json",
        "moe_layer_h100.json",
        "ep_dispatch_h200_2026-11-21.json",
        "ep_dispatch_h200x2_2026-11-24.json",
        "ep_dispatch_h200x2_a0a01b5.json",
    ],
)
def test_plot_measured_results(tmp_path, name):
    out = tmp_path / "plot.png"
    assert main(["plot", "--from", str(RESULTS / name), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == PNG_MAGIC


@pytest.mark.parametrize(
    "argv, message",
    [
        (["expert", "--dim", "16"], "need all of --dim --hidden --experts --top-k"),
        (["expert", "--tiny", "--shapes", "mixtral-8x7b"], "choose one shape source"),
        (["expert", "--impls", "nope"], "invalid choice: 'nope'"),
        (["layer", "--tiny", "--batch", "5"], "--batch 5 must divide the tokens of every shape (tiny)"),
        (["layer", "--tiny", "--batch", "0"], "--batch must be >= 1, got 0"),
        (["ep", "--tokens", "4096", "0"], "--tokens must be >= 1, got 4096 0"),
        (["ep", "--dims", "-1"], "--dims must be >= 1, got -1"),
        (["train-step", "--backends", "for_loop"], "the following arguments are required: --flavor"),
        (["plot", "--from", "missing.json", "--out", "x.png"], "No such file"),
        (["ep"], "run it under torchrun with >= 2 CUDA GPUs"),
        (["layer", "--compile", "eager", "--compiled-layers", "triton"], "which --compile eager leaves out"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_named_shapes_are_the_moe_layers_of_the_public_models():
    dims = {name: (s.tokens, s.dim, s.hidden_dim, s.num_experts, s.top_k) for name, s in SHAPES.items()}
    assert dims == {
        "qwen3-30b-a3b": (8192, 2048, 768, 128, 8),
        "olmoe-1b-7b": (8192, 2048, 1024, 64, 8),
        "deepseek-v2-lite": (8192, 2048, 1408, 64, 6),
        "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
    }
    for flavor, name in [(name, name) for name in ("qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b")] + [
        ("deepseek-v3-16b", "deepseek-v2-lite")  # torchtitan's 16B config: DeepSeek-V2-Lite's MoE layers
    ]:
        (shape,) = flavor_shapes(flavor, [], SHAPES[name].tokens)
        assert dataclasses.replace(shape, name=name) == SHAPES[name], flavor


def test_what_cannot_run_here_is_the_backend_tables_verdict(monkeypatch, capsys):
    make_backend_unavailable(monkeypatch, "triton", "needs CUDA")
    assert "fused_routed" not in expert_block.default_impls() and "triton" not in expert_block.default_impls()
    kinds = moe_layer.default_kinds()  # the FP8 layers of the torch backends too, where FP8 GEMMs run
    assert kinds[: 1 + len(TORCH_BACKENDS)] == ["torchtitan", *TORCH_BACKENDS] and not {"triton", "triton_fp8"} & set(
        kinds
    )
    for argv, refused in (
        (["expert", "--tiny", "--impls", "for_loop", "fused_routed"], "--impls fused_routed: needs CUDA"),
        (["layer", "--tiny", "--layers", "triton"], "--layers triton: needs CUDA"),
        (["train-step", "--flavor", "tiny-moe-triton", "--backends", "triton"], "--backends triton: needs CUDA"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and refused in capsys.readouterr().err
    make_backend_unavailable(monkeypatch, "triton", None)
    assert expert_block.default_impls() == [*TORCH_BACKENDS, "triton", "torch_routed", "fused_routed"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of FP8 layers without CUDA")
def test_fp8_layers_need_fp8_gemms_and_torchtitans_needs_torchao(monkeypatch, capsys):
    """The refusals name the hardware the layers need, not the training key that emulates FP8."""
    assert not {"grouped_mm_fp8", moe_layer.STOCK_FP8} & set(moe_layer.default_kinds())
    make_backend_unavailable(monkeypatch, "triton", None)
    monkeypatch.setattr(moe_layer, "torchao_missing_reason", lambda: "torchao is not installed")
    cases = [
        ("grouped_mm_fp8", "--layers grouped_mm_fp8: FP8 expert GEMMs need a CUDA GPU of compute capability 9.0"),
        ("triton_fp8", "--layers triton_fp8: FP8 expert GEMMs need a CUDA GPU of compute capability 9.0"),
        (moe_layer.STOCK_FP8, f"--layers {moe_layer.STOCK_FP8}: torchao is not installed"),
    ]
    for layer, refused in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["layer", "--tiny", "--layers", layer])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and refused in err and "expert_precision" not in err
    monkeypatch.setattr(moe_layer, "torchao_missing_reason", lambda: None)
    with pytest.raises(SystemExit):
        main(["layer", "--tiny", "--layers", moe_layer.STOCK_FP8])
    err = capsys.readouterr().err
    assert "FP8 expert GEMMs need a CUDA GPU" in err and "expert_precision" not in err


def test_the_cli_applies_the_torch_version_fixes_before_a_subcommand_runs(monkeypatch, tmp_path):
    applied: list[object] = []
    monkeypatch.setattr(bench_cli, "apply_torch_version_fixes", lambda: applied.append(True))
    monkeypatch.setattr(bench_cli, "run_plot", lambda parser, args, device, command: applied.append("plot"))
    assert main(["plot", "--from", "result.json", "--out", str(tmp_path / "result.png")]) == 0
    assert applied == [True, "plot"]


def test_relative_error():
    expected = torch.tensor([3.0, 4.0])
    assert relative_error(torch.tensor([3.0, 4.5]), expected) == pytest.approx(0.1)
    assert relative_error(expected.to(torch.bfloat16), expected) == 0.0
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.tensor([1e-13, 0.0]), torch.zeros(2)) == pytest.approx(0.1)  # floor 1e-12


def test_config_errors_exit_2(capsys):
    assert main(["train-step", "--flavor", "tiny-moe-for-lop"]) == 2
    assert "unknown flavor 'tiny-moe-for-lop'; did you mean" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train-step", "auto"])
def test_a_sequence_length_the_model_cannot_take_is_refused(command, capsys):
    assert main([command, "--flavor", "tiny-moe-for-loop", "--seq-len", "100000"]) == 2
    assert "--seq-len: training.seq_len = 100000: exceeds the model's RoPE length" in capsys.readouterr().err


def test_auto_refuses_an_expert_parallel_degree_that_does_not_divide_the_experts(tmp_path, monkeypatch, capsys):
    """As the train entry does, before measuring: by the flag (an argument error) or the TOML files."""
    monkeypatch.setattr(auto_backend, "resolve_for_config", lambda *a, **k: pytest.fail("measured an unusable layout"))
    undivided = "= 3: does not divide the number of experts (8)"
    with pytest.raises(SystemExit) as exit_info:
        main(["auto", "--flavor", "tiny-moe-for-loop", "--expert-parallel-degree", "3"])
    assert exit_info.value.code == 2 and f"error: --expert-parallel-degree {undivided}\n" in capsys.readouterr().err
    toml = tmp_path / "ep3.toml"
    toml.write_text("[parallelism]\nexpert_parallel_degree = 3\n")
    assert main(["auto", "--flavor", "tiny-moe-for-loop", "--toml", str(toml)]) == 2
    assert capsys.readouterr().err == f"error: {toml}:2: parallelism.expert_parallel_degree {undivided}\n"


# --- compute_backend = "auto" ------------------------------------------------------------

SHAPE_A = BenchShape("a", 64, 16, 24, 4, 2)
SHAPE_B = BenchShape("b", 64, 32, 24, 4, 2)


def fake_measure(ms_by_shape_and_backend: dict, calls: list):
    def measure(shape, backends):
        calls.append((shape.name, tuple(backends)))
        return {backend: ms_by_shape_and_backend[shape.name, backend] for backend in backends}

    return measure


def test_choice_sums_layers_and_breaks_ties_by_order():
    ms = {("a", "for_loop"): 1.0, ("a", "grouped_mm"): 2.0, ("b", "for_loop"): 5.0, ("b", "grouped_mm"): 2.0}
    # for_loop: 3*1 + 1*5 = 8; grouped_mm: 3*2 + 1*2 = 8 -> tie, the earlier candidate wins
    backend, totals = auto_backend.choose_backend(
        {SHAPE_A: 3, SHAPE_B: 1}, ["grouped_mm", "for_loop"], fake_measure(ms, [])
    )
    assert (backend, totals) == ("grouped_mm", {"grouped_mm": 8.0, "for_loop": 8.0})
    backend, _ = auto_backend.choose_backend({SHAPE_A: 1, SHAPE_B: 1}, ["grouped_mm", "for_loop"], fake_measure(ms, []))
    assert backend == "grouped_mm"  # 4 vs 6


def test_triton_is_a_candidate_only_where_it_runs(monkeypatch):
    make_backend_unavailable(monkeypatch, "triton", "needs CUDA")
    assert runnable_backends() == TORCH_BACKENDS
    make_backend_unavailable(monkeypatch, "triton", None)
    assert runnable_backends() == [*TORCH_BACKENDS, "triton"]


def test_choice_is_cached_per_device_shape_and_dtype(monkeypatch):
    make_backend_unavailable(monkeypatch, "triton", "needs CUDA")
    ms = {("a", "grouped_mm"): 3.0, ("a", "for_loop"): 2.0, ("a", "batched_mm_padded"): 1.0}
    calls = []
    measure = fake_measure(ms, calls)
    cpu = torch.device("cpu")
    first = auto_backend.resolve(
        {SHAPE_A: 2}, cpu, torch.float32, expert_parallel=False, may_measure=True, measure=measure
    )
    assert (first.backend, first.cached) == ("batched_mm_padded", False)
    assert calls == [("a", ("grouped_mm", "for_loop", "batched_mm_padded"))]  # one round of all candidates
    assert first.ms_per_step == {"grouped_mm": 6.0, "for_loop": 4.0, "batched_mm_padded": 2.0}
    again = auto_backend.resolve(
        {SHAPE_A: 2}, cpu, torch.float32, expert_parallel=False, may_measure=False, measure=measure
    )
    assert (again.backend, again.cached, len(calls)) == ("batched_mm_padded", True, 1)
    cache = json.loads(auto_backend.cache_file().read_text())
    assert list(cache) == [first.cache_key] and "cpu|" in first.cache_key and "float32" in first.cache_key
    assert first.measured == auto_backend.MEASURED_ON_ONE_DEVICE
    with pytest.raises(
        auto_backend.AutoBackendError, match="no cached choice"
    ):  # another dtype: a miss, and no measuring allowed
        auto_backend.resolve(
            {SHAPE_A: 2}, cpu, torch.bfloat16, expert_parallel=False, may_measure=False, measure=measure
        )
    with pytest.raises(auto_backend.AutoBackendError, match="no cached choice"):  # under EP another thing is measured
        auto_backend.resolve({SHAPE_A: 2}, cpu, torch.float32, expert_parallel=True, may_measure=False, measure=measure)
    auto_backend.resolve(
        {SHAPE_A: 2}, cpu, torch.float32, expert_parallel=False, may_measure=True, remeasure=True, measure=measure
    )
    assert len(calls) == 2


def test_auto_in_toml_resolves_at_startup_and_is_recorded(tmp_path, monkeypatch):
    make_backend_unavailable(monkeypatch, "triton", "needs CUDA")
    one_device_ms = {"grouped_mm": 3.0, "for_loop": 1.0, "batched_mm_padded": 2.0}
    expert_parallel_ms = {"grouped_mm": 1.0, "for_loop": 3.0, "batched_mm_padded": 2.0}
    monkeypatch.setattr(auto_backend, "layer_measure", lambda device, dtype: lambda shape, backends: one_device_ms)
    monkeypatch.setattr(
        auto_backend, "expert_block_measure", lambda device, dtype: lambda shape, backends: expert_parallel_ms
    )
    toml = tmp_path / "auto.toml"
    toml.write_text('[moe]\ncompute_backend = "auto"\n')
    config = FlavorConfigManager().parse_args(["--flavor", "tiny-moe-grouped-mm", "--toml", str(toml)])
    backends = {e.compute_backend for _, e, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)}
    assert backends == {"for_loop"}  # one device: the fastest whole layer
    assert run_metadata()["compute_backend"] == "for_loop"
    assert run_metadata()["toml_overrides"][str(toml)] == {"moe.compute_backend": "auto"}
    ep2 = ["--flavor", "tiny-moe-grouped-mm", "--toml", str(toml), "--parallelism.expert_parallel_degree", "2"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # ranks only read the cache: EP 2 was never measured
    with pytest.raises(ConfigError, match="no cached choice") as error:
        FlavorConfigManager().parse_args(ep2)
    exact = f"--flavor tiny-moe-grouped-mm --toml {toml} --batch-size 8 --seq-len 128 --expert-parallel-degree 2"
    assert f"run the single-process `python -m torchtitan_ext.bench auto {exact}` first" in str(error.value)
    assert str(error.value).endswith(f"or set a backend: {', '.join(runnable_backends())} (those that run here)")
    monkeypatch.setenv("WORLD_SIZE", "1")  # the documented single-process step measures it
    assert main(["auto", "--flavor", "tiny-moe-grouped-mm", "--toml", str(toml), "--expert-parallel-degree", "2"]) == 0
    monkeypatch.setenv("WORLD_SIZE", "2")  # every rank now reads the same cached choice
    FlavorConfigManager().parse_args(ep2)
    assert run_metadata()["compute_backend"] == "grouped_mm"  # under EP: the fastest expert block


def test_unresolved_auto_cannot_build():
    with pytest.raises(ValueError, match="resolved to a backend at start-up"):
        BackendGroupedExperts.Config(dim=8, hidden_dim=8, num_experts=2, compute_backend="auto")


def test_real_tiny_measurement(monkeypatch, capsys):
    make_backend_unavailable(monkeypatch, "triton", "needs CUDA")
    for expert_parallel in (False, True):
        choice = auto_backend.resolve(
            {TINY_SHAPE: 2}, torch.device("cpu"), torch.float32, expert_parallel=expert_parallel, may_measure=True
        )
        assert choice.backend in TORCH_BACKENDS and set(choice.ms_per_step) == set(TORCH_BACKENDS)
        assert all(ms > 0 for ms in choice.ms_per_step.values())
    assert main(["auto", "--flavor", "tiny-moe-for-loop", "--batch-size", "2", "--seq-len", "16"]) == 0
    assert "MoE layer forward+backward" in capsys.readouterr().out
    assert (
        main(
            [
                "auto",
                "--flavor",
                "tiny-moe-for-loop",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--expert-parallel-degree",
                "2",
            ]
        )
        == 0
    )
    assert "expert block forward+backward" in capsys.readouterr().out


def test_layer_profile_lists_the_slowest_operators(tmp_path, capsys):
    results = run_main(["layer", "--tiny", "--skew", "balanced", "--layers", "for_loop", "--profile", "3"], tmp_path)
    out = capsys.readouterr().out
    slowest = "slowest operators (self CPU time)" if ON_CPU else "slowest GPU kernels"
    assert f"torchtitan: {slowest}, ms per call" in out and f"for_loop: {slowest}" in out
    for row in results["rows"]:
        times = [kernel["ms"] for kernel in row["kernels"]]
        assert len(times) == 3 and times == sorted(times, reverse=True) and times[0] > 0


def test_layer_profile_must_not_be_negative(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_main(["layer", "--tiny", "--profile", "-1"], tmp_path)
    assert exit_info.value.code == 2
    assert "--profile must be >= 0" in capsys.readouterr().err


def test_layer_rounds_report_the_median_of_interleaved_timings(tmp_path, capsys, monkeypatch):
    from torchtitan_ext.bench import common

    calls = []
    measured = iter([5.0, 3.0, 1.0, 9.0, 2.0, 5.0, 4.0, 1.0, 3.0, 2.0, 9.0, 4.0])

    class ScriptedTimer(Timer):
        def __call__(self, fn, grad_to_none=None):
            calls.append("fwd+bwd" if grad_to_none else "fwd")
            return next(measured)

    monkeypatch.setattr(common, "make_timer", lambda device: ScriptedTimer())
    results = run_main(
        ["layer", "--tiny", "--skew", "balanced", "--layers", "for_loop", "--rounds", "3", "--compile", "eager"],
        tmp_path,
    )
    stock, for_loop = results["rows"]
    # each round: the forwards of stock and for_loop, then their forward+backwards
    assert calls == ["fwd", "fwd", "fwd+bwd", "fwd+bwd"] * 3
    assert stock["fwd_ms_rounds"] == [5.0, 2.0, 3.0] and stock["fwd_ms"] == 3.0
    assert stock["fwdbwd_ms_rounds"] == [1.0, 4.0, 9.0] and stock["fwdbwd_ms"] == 4.0
    assert for_loop["fwd_ms_rounds"] == [3.0, 5.0, 2.0] and for_loop["fwd_ms"] == 3.0
    assert for_loop["fwdbwd_ms_rounds"] == [9.0, 1.0, 4.0] and for_loop["fwdbwd_speedup"] == 1.0
    err = capsys.readouterr().err
    assert "forward: torchtitan, for_loop  (round 3 of 3)" in err
    assert "forward+backward: torchtitan, for_loop  (round 1 of 3)" in err


def test_gpu_flop_rates_of_tiny_shapes_stay_above_zero():
    from torchtitan_ext.bench.common import expert_tflops

    tiny = expert_tflops(TINY_SHAPE, 0.05, torch.device("cuda"), backward=True)
    assert tiny == 0.04424
    assert expert_tflops(BenchShape("big", 8192, 4096, 14336, 8, 2), 27.0, torch.device("cuda"), backward=True) == 641.4
    assert expert_tflops(TINY_SHAPE, 0.05, torch.device("cpu"), backward=True) is None


def test_turn_order_alternates_names_call_by_call():
    assert turn_order(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert turn_order(["a"], 2) == ["a", "a"]


def test_interleaved_round_takes_turns_and_reports_each_names_median():
    leaf = torch.ones(2, requires_grad=True)
    ran, batches = [], []

    def step(name, ms):
        def call():
            assert leaf.grad is None
            leaf.grad = torch.ones(2)
            ran.append((name, ms))

        return call

    def time_calls(fns):
        batches.append(len(fns))
        start = len(ran)
        for fn in fns:
            fn()
        return [ms for _, ms in ran[start:]]

    medians = interleaved_round(
        {"slow": (step("slow", 4.0), [leaf]), "fast": (step("fast", 1.0), [leaf])},
        time_calls,
        repeat_ms=20.0,
        min_calls=3,
    )
    assert medians == {"slow": 4.0, "fast": 1.0}
    # one untimed call each, three to estimate each, then 20 ms x 2 names / 5 ms per turn = 8 turns
    assert batches == [3, 3, 16]
    assert [name for name, _ in ran[8:]] == turn_order(["slow", "fast"], 8)


def test_interleaved_round_calls_each_name_at_least_min_calls_times():
    counts = {"a": 0, "b": 0}

    def count(name):
        def call():
            counts[name] += 1

        return call

    interleaved_round(
        {"a": (count("a"), []), "b": (count("b"), [])},
        lambda fns: [fn() or 50.0 for fn in fns],
        repeat_ms=10.0,
        min_calls=5,
    )
    assert counts == {"a": 1 + 3 + 5, "b": 1 + 3 + 5}


def test_expert_rounds_give_medians_and_per_round_times(tmp_path):
    results = run_main(
        ["expert", "--tiny", "--skew", "balanced", "--impls", "grouped_mm", "for_loop", "--rounds", "3"], tmp_path
    )
    for row in results["rows"]:
        for key in ("fwd_ms", "fwdbwd_ms"):
            assert len(row[f"{key}_rounds"]) == 3
            assert row[key] == pytest.approx(sorted(row[f"{key}_rounds"])[1], abs=1e-3)


@pytest.mark.parametrize("command", ["layer", "expert"])
def test_rounds_must_be_positive(command, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_main([command, "--tiny", "--rounds", "0"], tmp_path)
    assert exit_info.value.code == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["expert", "--tiny", "--json"], "--json"),
        (["layer", "--tiny", "--plot"], "--plot"),
        (["plot", "--from", str(RESULTS / "expert_block_h100.json"), "--out"], "--out"),
    ],
)
def test_a_file_to_write_in_a_missing_folder_is_refused_before_measuring(argv, flag, tmp_path, capsys):
    path = tmp_path / "missing" / "result.out"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, str(path)])
    assert exit_info.value.code == 2
    assert f"{flag} {path}: the folder {path.parent} does not exist" in capsys.readouterr().err


def synthetic_gpu_trace(path: Path) -> None:
    """One 1 ms profiler step: overlapping kernels on two streams, a copy, host syncs and launches."""

    def event(name, cat, ts, dur, tid=7):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events = [
        event("ProfilerStep#3", "user_annotation", 0, 1000, tid=1),
        *(event("ProfilerStep#3", "gpu_user_annotation", 100, 800, tid=stream) for stream in (7, 9)),
        event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", 100, 300),
        event("_permute_kernel", "kernel", 300, 200, tid=9),  # overlaps the all-to-all
        event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "kernel", 600, 100),
        event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 800, 50),
        event("_permute_kernel", "kernel", 2000, 100),  # after the step: not counted
        event("aten::item", "cpu_op", 440, 70, tid=1),
        event("aten::_local_scalar_dense", "cpu_op", 445, 60, tid=1),
        event("cudaStreamSynchronize", "cuda_runtime", 450, 50, tid=1),
        event("aten::_local_scalar_dense", "cpu_op", 440, 70, tid=2),  # another thread's: not this sync's
        event("cudaStreamSynchronize", "cuda_runtime", 900, 50, tid=1),
        *(event("cudaLaunchKernel", "cuda_runtime", 10 * i, 5, tid=1) for i in range(3)),
    ]
    path.write_text(json.dumps({"traceEvents": events}))


def test_trace_summary_of_a_gpu_step(tmp_path, capsys):
    path = tmp_path / "rank0_trace.json"
    synthetic_gpu_trace(path)
    out = tmp_path / "summary.json"
    assert main(["trace", str(path), "--top", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["traces"][0]
    assert summary["steps"] == 1 and summary["wall_ms"] == 1.0
    assert summary["gpu_busy_ms"] == 0.55  # 100-500 (two streams), 600-700, 800-850
    assert summary["gpu_busy_outside_communication_ms"] == 0.35  # without the all-to-all: 300-500, 600-700, 800-850
    assert summary["kinds"] == {"communication": 0.3, "project Triton": 0.2, "matmul": 0.1, "copy/fill": 0.05}
    assert summary["host"] == {
        "sync_calls": 2,
        "sync_ms": 0.1,
        "kernel_launches": 3,
        "syncs_by_operator": [
            {"operator": "aten::_local_scalar_dense", "syncs": 1, "ms": 0.05},
            {"operator": "no host operator", "syncs": 1, "ms": 0.05},
        ],
    }
    assert [k["name"][:4] for k in summary["top_kernels"]] == ["nccl", "_per"]
    assert summary["gpu_idle_gaps"] == []  # none of its idle spans reaches 1 ms
    printed = capsys.readouterr().out
    assert (
        "GPU busy 0.6 ms (55% of the time), 0.3 ms (35%) outside communication kernels" in printed
        and "2 syncs (0.1 ms waiting for the GPU)" in printed
        and "host syncs by operator: aten::_local_scalar_dense 1, no host operator 1" in printed
    )


def test_trace_names_the_gpus_idle_spans_and_what_the_host_ran_then(tmp_path, capsys):
    """A 10 ms step whose GPU waits 4 ms for the host's data loader (a nested operator inside it,
    overlapping less) and 1.5 ms at its end with no host event."""

    def event(name, cat, ts, dur, tid=1):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    loader = "enumerate(DataLoader)#_StatefulSingleProcessDataLoaderIter.__next__"
    events = [
        event("ProfilerStep#5", "user_annotation", 0, 10_000),
        event("_gate_up_forward_kernel", "kernel", 0, 1_000, tid=7),
        event("_permute_kernel", "kernel", 900, 100, tid=9),
        event(loader, "user_annotation", 1_200, 3_600),
        event("aten::copy_", "cpu_op", 2_000, 1_000),
        event("_weight_gradient_kernel", "kernel", 5_000, 3_500, tid=7),
        event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 8_200, 300, tid=9),
    ]
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "summary.json"
    assert main(["trace", str(path), "--json", str(out)]) == 0
    (summary,) = json.loads(out.read_text())["traces"]
    assert summary["gpu_idle_gaps"] == [
        {"at_ms": 1.0, "ms": 4.0, "host": loader, "host_ms": 3.6},
        {"at_ms": 8.5, "ms": 1.5},
    ]
    printed = capsys.readouterr().out
    assert f"      1.0     4.0  {loader} (3.6 ms of it)" in printed
    assert "      8.5     1.5  no host event" in printed


def test_trace_kinds_name_every_kernel_module_of_the_project():
    """Kernels of a whole-model trace on 2x H100 (triton over symm_mem), from several kernel modules."""
    from torchtitan_ext.bench.trace import kernel_kind, project_kernel_names

    names = project_kernel_names()
    for kernel in (
        "_weight_gradient_kernel",
        "_gate_up_forward_kernel",
        "_gate_up_backward_input_kernel",
        "_permute_kernel",
        "_push_pairs_kernel",
        "_scaled_grouped_gemm_kernel",
        "_quantize_rows_kernel",
        "_topk_routing_forward_kernel",
    ):
        assert kernel_kind(kernel, names) == "project Triton", kernel
    barrier = "c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)"
    assert kernel_kind(barrier, names) == "communication"


def test_trace_summary_of_a_cpu_run(tmp_path, capsys):
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            a = torch.mm(a, a).tanh()
    path = tmp_path / "cpu_trace.json"
    profiler.export_chrome_trace(str(path))
    assert main(["trace", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "no GPU kernels in this trace" in printed and "aten::mm" in printed


@pytest.mark.parametrize(
    "command, name, content, refusal",
    [
        ("trace", "bad.json", b"not json", "cannot read a torch.profiler trace"),
        ("trace", "bad.json", json.dumps({"traceEvents": []}).encode(), "cannot read a torch.profiler trace"),
        ("memory", "bad.pickle", b"not a pickle", "cannot read a CUDA memory snapshot"),
        ("memory", "bad.pickle", pickle.dumps({"traceEvents": []}), "cannot read a CUDA memory snapshot"),
    ],
)
def test_an_unreadable_profile_exits_2(tmp_path, command, name, content, refusal, capsys):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(path)])
    assert exit_info.value.code == 2
    assert f"{command} {path}: {refusal}" in capsys.readouterr().err


def test_kernel_profile_clears_gradients_before_each_call_like_the_timed_runs():
    from torchtitan_ext.bench.common import kernel_profile

    weight = torch.ones(4, requires_grad=True)
    kernel_profile(lambda: (weight * 2).sum().backward(), torch.device("cpu"), top=3, grad_to_none=[weight])
    assert weight.grad is not None and torch.equal(weight.grad, torch.full((4,), 2.0))


def test_train_step_goes_on_after_a_backend_runs_out_of_memory(tmp_path, capsys, monkeypatch):
    from torchtitan_ext.bench import train_step

    measure = train_step.bench_backend

    def out_of_memory_for_loop(config, backend, device, timer, **compile_options):
        if backend == "for_loop":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB")
        return measure(config, backend, device, timer, **compile_options)

    monkeypatch.setattr(train_step, "bench_backend", out_of_memory_for_loop)
    results = run_main(TRAIN_STEP_ARGV, tmp_path)
    captured = capsys.readouterr()
    for_loop, grouped_mm = results["rows"]
    assert for_loop["step_ms"] is None and "out of memory" in for_loop["error"] and for_loop["tokens"] == 32
    assert grouped_mm["step_ms"] > 0 and "error" not in grouped_mm
    assert "for_loop: out of memory" in captured.err and "out of memory; try a smaller" in captured.out


def test_train_step_times_a_stock_flavor_as_one_torchtitan_row(capsys):
    from torchtitan_ext.bench import train_step

    assert train_step.backends_to_run("olmoe-1b-7b-torchtitan-moe", [], None, ["grouped_mm"]) == [train_step.STOCK_MOE]
    assert train_step.backends_to_run("olmoe-1b-7b", [], None, ["grouped_mm", "triton"]) == ["grouped_mm", "triton"]
    config = train_step.step_config(
        "olmoe-1b-7b-torchtitan-moe", [], train_step.STOCK_MOE, batch_size=1, seq_len=8, num_layers=1
    )
    assert not train_step.has_switchable_experts(config) and len(config.model_spec.model.layers) == 1
    assert main(["train-step", "--flavor", "olmoe-1b-7b-torchtitan-moe", "--backends", "grouped_mm"]) == 2
    assert "built with torchtitan's own MoE layers" in capsys.readouterr().err


# --- compiled variants ---------------------------------------------------------------------

COMPILED_LAYER_ARGV = ["layer", "--tiny", "--skew", "balanced", "--layers", "grouped_mm"]
COMPILE_ON_CPU = ["--compile", "both", "--compile-backend", "aot_eager"]


def test_layer_times_compiled_variants_beside_eager_with_speedups_over_stock_compiled(tmp_path, capsys):
    results = run_main([*COMPILED_LAYER_ARGV, *COMPILE_ON_CPU], tmp_path)
    captured = capsys.readouterr()
    rows = results["rows"]
    assert [(row["layer"], row["compiled"]) for row in rows] == [
        ("torchtitan", False),
        ("grouped_mm", False),
        ("torchtitan", True),
        ("grouped_mm", True),
    ]
    assert results["meta"]["compile_backend"] == "aot_eager"
    stock_eager, _, stock_compiled, _ = rows
    for row in rows:
        assert row["fwdbwd_ms"] > 0 and row["first_call_s"] > 0 and "error" not in row
        for key in ("fwd", "fwdbwd"):
            assert row[f"{key}_speedup"] == round(stock_eager[f"{key}_ms"] / row[f"{key}_ms"], 2)
            assert row[f"{key}_speedup_vs_stock_compiled"] == round(stock_compiled[f"{key}_ms"] / row[f"{key}_ms"], 2)
    assert stock_compiled["fwdbwd_speedup_vs_stock_compiled"] == 1.0
    assert float(rows[3]["rel_err_vs_stock"]) == pytest.approx(float(rows[1]["rel_err_vs_stock"]), rel=0.05)
    assert "fwd+bwd x stock compiled" in captured.out and "1st call s" in captured.out
    assert "compile (first forward+backward): grouped_mm compiled" in captured.err
    assert "forward: torchtitan, grouped_mm, torchtitan compiled, grouped_mm compiled" in captured.err  # one round
    bars = chart_of(results).bars
    assert [(bar.label, bar.compiled) for bar in bars] == [
        ("torchtitan", False),
        ("grouped_mm", False),
        ("torchtitan compiled", True),
        ("grouped_mm compiled", True),
    ]
    assert [bar.label for bar in chart_of(results, only=["grouped_mm"]).bars] == ["grouped_mm", "grouped_mm compiled"]
    assert "compiled: aot_eager" in chart_of(results).title


def test_layer_compile_choice_picks_the_variants(monkeypatch):
    measured = {}

    def record(shapes, variants, *args, **kwargs):
        measured["variants"] = variants
        return {"rows": []}

    monkeypatch.setattr(moe_layer, "run", record)

    def variants(*argv):
        assert main(["layer", "--tiny", *argv]) == 0
        return [variant.name for variant in measured.pop("variants")]

    layers = ["--layers", "grouped_mm", "for_loop", "triton"]
    eager = ["torchtitan", "grouped_mm", "for_loop", "triton"]
    compiled = ["torchtitan compiled", "grouped_mm compiled", "triton compiled"]  # for_loop only when named
    assert variants(*layers, "--compile", "both") == eager + compiled
    assert variants(*layers, "--compile", "compiled") == ["torchtitan", *compiled]  # stock eager: the reference
    assert variants(*layers, "--compile", "eager") == eager
    assert variants(*layers) == (eager if ON_CPU else eager + compiled)  # CPU: eager unless asked
    assert variants(*layers, "--compiled-layers", "for_loop") == [*eager, "torchtitan compiled", "for_loop compiled"]


def test_a_layer_that_fails_to_compile_gets_an_error_row_and_the_others_are_timed(tmp_path, monkeypatch, capsys):
    from torchtitan_ext.bench import common

    def fails_to_compile(module, backend):
        def call(*args):
            raise RuntimeError("GuardOnDataDependentSymNode: Could not guard on data-dependent expression u0 < 0\nmore")

        return call

    monkeypatch.setattr(common, "compile_like_torchtitan", fails_to_compile)
    results = run_main([*COMPILED_LAYER_ARGV, *COMPILE_ON_CPU], tmp_path)
    eager_rows, compiled_rows = results["rows"][:2], results["rows"][2:]
    for row in compiled_rows:
        assert row["compiled"] and row["fwdbwd_ms"] is None and row["fwdbwd_speedup"] is None
        assert row["error"] == (
            "compile failed: RuntimeError: GuardOnDataDependentSymNode: "
            "Could not guard on data-dependent expression u0 < 0"
        )
    for row in eager_rows:
        assert row["fwdbwd_ms"] > 0 and row["fwdbwd_speedup_vs_stock_compiled"] is None
    captured = capsys.readouterr()
    assert "grouped_mm compiled: compile failed: RuntimeError" in captured.err
    assert "forward: torchtitan, grouped_mm" in captured.err and "compile failed" in captured.out


TINY_SIZES = ["--batch-size", "2", "--seq-len", "16"]


class ThreeCallTimer(Timer):
    """The median ms of three calls: what a row needs, without the CPU timer's seconds of repeats."""

    def __call__(self, fn, grad_to_none=None):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]


def test_train_step_compiles_each_block_as_torchtitan_does_beside_the_stock_step(tmp_path, capsys, monkeypatch):
    from torchtitan_ext.bench import train_step

    monkeypatch.setattr(train_step, "make_timer", lambda device: ThreeCallTimer())
    compiled_models = []

    def spy_apply_compile(model, **kwargs):
        train_step_apply_compile(model, **kwargs)
        compiled_models.append([block._compiled_call_impl is not None for block in model.layers.values()])

    train_step_apply_compile = train_step.apply_compile
    monkeypatch.setattr(train_step, "apply_compile", spy_apply_compile)
    argv = ["train-step", "--flavor", "tiny-moe-grouped-mm", "--stock-flavor", "tiny-torchtitan-moe"]
    results = run_main([*argv, "--backends", "grouped_mm", *TINY_SIZES, *COMPILE_ON_CPU], tmp_path)
    rows = results["rows"]
    assert [(row["flavor"], row["backend"], row["compiled"]) for row in rows] == [
        ("tiny-torchtitan-moe", "torchtitan", False),
        ("tiny-torchtitan-moe", "torchtitan", True),
        ("tiny-moe-grouped-mm", "grouped_mm", False),
        ("tiny-moe-grouped-mm", "grouped_mm", True),
    ]
    assert compiled_models == [[True, True], [True, True]]  # every block of each compiled model
    assert results["meta"]["compile_backend"] == "aot_eager"
    stock_eager, stock_compiled = rows[0]["step_ms"], rows[1]["step_ms"]
    for row in rows:
        assert row["step_ms"] > 0 and row["first_step_s"] > 0 and "error" not in row
        assert row["first_loss"] == pytest.approx(rows[0]["first_loss"], abs=1e-4)  # same weights, same tokens
        assert row["speedup_vs_stock"] == round(stock_eager / row["step_ms"], 2)
        assert row["speedup_vs_stock_compiled"] == round(stock_compiled / row["step_ms"], 2)
    out = capsys.readouterr().out
    assert "x stock compiled" in out and "1st step s" in out
    chart = chart_of(results)
    assert {bar.group for bar in chart.bars} == {"2 layers, 32 tokens"}  # stock beside the backends
    assert [bar.label for bar in chart.bars] == [
        "torchtitan",
        "torchtitan compiled",
        "grouped_mm",
        "grouped_mm compiled",
    ]


def test_train_step_stock_flavor_must_have_torchtitans_moe_layers(capsys):
    argv = ["train-step", "--flavor", "tiny-moe-grouped-mm", "--stock-flavor", "tiny-moe-for-loop", *TINY_SIZES]
    assert main(argv) == 2
    assert "--stock-flavor tiny-moe-for-loop is built with this project's MoE layers" in capsys.readouterr().err


def test_results_record_the_commit_of_the_checkout_that_runs_not_of_the_current_folder(tmp_path, monkeypatch):
    def git(folder, *args):
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True)

    other = tmp_path / "another_repository"
    (other / "sub").mkdir(parents=True)
    git(other, "init", "-q")
    git(other, "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-q", "--allow-empty", "-m", "x")
    assert checkout_commit(other) == git(other, "rev-parse", "--short", "HEAD").stdout.strip()
    assert checkout_commit(other / "sub") is None  # a folder inside another repository
    assert checkout_commit(tmp_path) is None  # no repository at all
    monkeypatch.delenv("SOURCE_COMMIT", raising=False)
    monkeypatch.chdir(other)
    assert source_commit() == checkout_commit(PROJECT_ROOT)  # the running package's, None outside a checkout
    monkeypatch.setattr(common, "PROJECT_ROOT", tmp_path)
    assert source_commit() is None
    monkeypatch.setenv("SOURCE_COMMIT", "abc1234")
    assert source_commit() == "abc1234"


def test_a_backend_has_one_colour_in_every_plot(tmp_path, monkeypatch):
    """The expert-block and MoE-layer charts of the measured H100 results: grouped_mm (first in the
    layer chart only after stock torchtitan) and triton keep one colour each."""
    import matplotlib.axes

    drawn = {}
    draw_bars = matplotlib.axes.Axes.bar

    def recording_bar(axis, *args, label=None, color=None, **kwargs):
        drawn.setdefault(label, set()).add(color)
        return draw_bars(axis, *args, label=label, color=color, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", recording_bar)
    for name in ("expert_block_h100.json", "moe_layer_h100.json"):
        plot(json.loads((RESULTS / name).read_text()), str(tmp_path / f"{name}.png"))
    assert {"grouped_mm", "triton", "torchtitan"} <= drawn.keys()
    assert all(len(colours) == 1 for colours in drawn.values()), drawn
    assert len({colour for colours in drawn.values() for colour in colours}) == len(drawn)


MIB = 1024**2


def synthetic_memory_snapshot(path: Path) -> None:
    """Rank 1's allocator (torch's ``_snapshot()`` format): 2 GiB and a 20 MiB side-stream segment
    reserved and 1 GiB of weights allocated before the recorded history; then the reserve grows twice,
    for an autotuning buffer (1 GiB, freed again) and for a compiled graph's output (512 MiB)."""

    def frames(*sites):
        return [{"filename": filename, "line": line, "name": name} for filename, line, name in sites]

    torch_frame = ("/env/site-packages/torch/utils/_contextlib.py", 120, "decorate_context")
    autotune = frames(torch_frame, ("/repo/torchtitan_ext/kernels/autotune.py", 50, "benchmark"))
    model = frames(("/repo/model.py", 10, "forward"))
    graph = frames(("/cache/inductor/ab/cabc.py", 99, "call"))
    weights = frames(("/repo/init.py", 5, "init_weights"))
    base = 1 << 40

    def event(action, addr, size, frames_, time_us):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": frames_}

    trace = [
        event("alloc", base + 1024 * MIB, 512 * MIB, model, 1_000_000),
        event("segment_map", base + 2048 * MIB, 1024 * MIB, autotune, 1_500_000),
        event("alloc", base + 1536 * MIB, 800 * MIB, autotune, 1_500_001),
        event("free_requested", base + 1536 * MIB, 800 * MIB, autotune, 1_600_000),
        event("free_completed", base + 1536 * MIB, 800 * MIB, autotune, 1_600_000),
        event("segment_map", base + 3072 * MIB, 512 * MIB, graph, 3_000_000),
        event("alloc", base + 1536 * MIB, 600 * MIB, graph, 3_000_001),
    ]

    def block(address, size, state, frames_=()):
        return {"address": address, "size": size, "requested_size": size, "state": state, "frames": list(frames_)}

    main_segment = {
        "device": 1,
        "address": base,
        "total_size": 3584 * MIB,
        "stream": 0,
        "is_expandable": True,
        "blocks": [
            block(base, 1024 * MIB, "active_allocated", weights),
            block(base + 1024 * MIB, 512 * MIB, "active_allocated", model),
            block(base + 1536 * MIB, 600 * MIB, "active_allocated", graph),
            block(base + 2136 * MIB, 1448 * MIB, "inactive"),
        ],
    }
    side_segment = {
        "device": 1,
        "address": base + (1 << 36),
        "total_size": 20 * MIB,
        "stream": 7,
        "is_expandable": True,
        "blocks": [block(base + (1 << 36), 20 * MIB, "inactive")],
    }
    snapshot = {"segments": [main_segment, side_segment], "device_traces": [[], trace]}
    with open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)


def test_memory_summary_names_where_the_reserve_grew(tmp_path, capsys):
    path = tmp_path / "000001_step_6.pickle"
    synthetic_memory_snapshot(path)
    out = tmp_path / "memory.json"
    assert main(["memory", str(path), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["snapshots"][0]
    assert summary["device"] == 1 and summary["events"] == 7 and summary["expandable_segments"]
    assert summary["reserved_gib"] == round(3604 / 1024, 3) and summary["allocated_gib"] == round(2136 / 1024, 3)
    assert summary["largest_free_block_mib"] == 1448.0
    assert summary["reserved_gib_by_stream"] == {"0": 3.5, "7": round(20 / 1024, 3)}
    assert summary["reserved_gib_at_first_event"] == round(2068 / 1024, 3)
    assert summary["peak_allocated_gib"] == round(2336 / 1024, 3)  # weights, model output, autotuning buffer
    # The first growth had 512 MiB free on stream 0 for an 800 MiB request; the second 1.5 GiB for 600 MiB.
    assert summary["growth"] == {"count": 2, "gib": 1.5, "while_the_stream_had_room_gib": 0.5}
    assert summary["growth_by_site"] == [
        {"site": "autotune.py:50 benchmark", "gib": 1.0, "count": 1},
        {"site": "cabc.py:99 call", "gib": 0.5, "count": 1},
    ]
    first, last = summary["largest_growths"]
    assert (first["seconds"], first["request_mib"], first["allocated_gib"]) == (0.5, 800.0, 1.5)
    assert (first["free_on_stream_mib"], last["free_on_stream_mib"]) == (512.0, 1536.0)
    assert last == summary["last_growth"] and last["reserved_gib_after"] == round(3604 / 1024, 3)
    assert last["stack"] == ["cabc.py:99 call"]
    assert summary["live_at_last_growth"] == [
        {"site": "init.py:5 init_weights", "gib": 1.0},
        {"site": "model.py:10 forward", "gib": 0.5},
    ]
    printed = capsys.readouterr().out
    assert "the reserve grew 2 times by 1.50 GiB in all, 0.50 GiB of it for requests smaller" in printed
    assert "reserved by stream" in printed
    assert "for a 600.0 MiB request from cabc.py:99 call" in printed


def test_memory_summary_counts_what_was_allocated_before_the_history(tmp_path):
    """Memory allocated before the ring buffer's first event (freed within it, or still held at the
    snapshot without frames) is named as such when it held memory at a growth."""
    path = tmp_path / "snapshot.pickle"
    segment = {"device": 0, "address": 0, "total_size": 2048 * MIB, "stream": 0, "blocks": []}
    segment["blocks"] = [
        {"address": 0, "size": 1984 * MIB, "state": "inactive", "frames": []},
        {"address": 1984 * MIB, "size": 64 * MIB, "state": "active_allocated", "frames": []},
    ]
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 1024 * MIB, "stream": 0, "time_us": 0, "frames": []},
        {"action": "alloc", "addr": 0, "size": 1024 * MIB, "stream": 0, "time_us": 0, "frames": []},
        {"action": "free_completed", "addr": 0, "size": 1024 * MIB, "stream": 0, "time_us": 1, "frames": []},
        {"action": "free_completed", "addr": 5, "size": 256 * MIB, "stream": 0, "time_us": 2, "frames": []},
    ]
    with open(path, "wb") as f:
        pickle.dump({"segments": [segment], "device_traces": [trace]}, f)
    summary = bench_cli.memory_snapshot.summarize(str(path))
    assert summary["reserved_gib_at_first_event"] == 1.0 and summary["peak_allocated_gib"] == 1.312
    assert summary["live_at_last_growth"] == [{"site": "allocated before the recorded history", "gib": 0.312}]
    assert summary["last_growth"]["site"] == "unknown" and not summary["expandable_segments"]
    assert (
        summary["last_growth"]["free_on_stream_mib"] == 704.0
        and summary["growth"]["while_the_stream_had_room_gib"] == 0
    )


def test_memory_summary_of_a_folder_reads_every_ranks_snapshot(tmp_path, capsys):
    step = tmp_path / "memory_snapshot" / "step_000000000006"
    step.mkdir(parents=True)
    for rank in (1, 0):
        synthetic_memory_snapshot(step / f"00000{rank}_step_6.pickle")
    out = tmp_path / "memory.json"
    assert main(["memory", str(tmp_path / "memory_snapshot"), "--json", str(out)]) == 0
    snapshots = json.loads(out.read_text())["snapshots"]
    assert [Path(s["snapshot"]).name for s in snapshots] == ["000000_step_6.pickle", "000001_step_6.pickle"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["memory", str(tmp_path / "empty")])
    assert exit_info.value.code == 2
    assert f"memory {tmp_path / 'empty'}: the folder holds no .pickle snapshots" in capsys.readouterr().err


def write_structured_log(folder: Path, rank: int, records: list[dict]) -> None:
    """torchtitan's structured log of one rank: one JSON record per line."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(record) for record in records]
    (folder / f"training.global_rank_{rank}.20261126-000000-ABCDEF.jsonl").write_text("\n".join(lines) + "\n")


def test_memory_growth_is_split_by_the_training_steps_of_the_ranks_structured_log(tmp_path, capsys):
    dump = tmp_path / "outputs"
    snapshot = dump / "profiling" / "memory_snapshot" / "step_000000000006" / "000001_step_6.pickle"
    snapshot.parent.mkdir(parents=True)
    synthetic_memory_snapshot(snapshot)  # the reserve grows at 1.5 s and 3.0 s
    started = {"time_us": 900_000, "log_type_name": "structured_logger_started"}
    steps = [{"time_us": t, "step": n, "log_type_name": "step_start"} for t, n in ((1_200_000, 1), (2_500_000, 2))]
    write_structured_log(dump / "structured_logs", 0, [started, {"time_us": 10**15, "step": 1}])  # another rank's
    write_structured_log(dump / "structured_logs", 1, [started, *steps, {"time_us": 3_500_000}])
    summary = bench_cli.memory_snapshot.summarize(str(snapshot))
    assert summary["growth_by_step"] == {"1": 1.0, "2": 0.5}
    assert summary["steps_from"].endswith("training.global_rank_1.20261126-000000-ABCDEF.jsonl")
    assert [g["step"] for g in summary["largest_growths"]] == [1, 2]
    bench_cli.memory_snapshot.print_summary(summary)
    printed = capsys.readouterr().out
    assert "by training step (GiB; step 0: before step 1): 1: 1.000, 2: 0.500" in printed
    assert "last growth at 2.0 s (step 2)" in printed

    write_structured_log(dump / "structured_logs", 1, [{"time_us": 10**15, "log_type_name": "step_start", "step": 1}])
    summary = bench_cli.memory_snapshot.summarize(str(snapshot))
    assert summary["growth_by_step"] is None and "the snapshot's times lie outside" in summary["steps_from"]
    (dump / "structured_logs" / "training.global_rank_1.20261126-000000-ABCDEF.jsonl").unlink()
    summary = bench_cli.memory_snapshot.summarize(str(snapshot))
    assert summary["steps_from"] == "not split by step: no structured_logs/ of this rank above the snapshot"
    bench_cli.memory_snapshot.print_summary(summary)
    assert "growth not split by step: no structured_logs/ of this rank" in capsys.readouterr().out
