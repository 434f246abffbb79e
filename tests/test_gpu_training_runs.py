"""The GPU training suites of scripts/gpu_training_runs.py and the scale-out task of
scripts/measure_on_gpu.sh, checked without GPUs: which runs each suite launches (flavors, EP
degrees, transports, backends), that every run parses as the train entry would parse it on its
host, that each is compared with the right run, and that a host with too few GPUs is told so."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import nested_configs

import torchtitan_ext.model_size
from torchtitan_ext.experiments.moe_backends import startup_checks
from torchtitan_ext.experiments.moe_backends.cuda_graph_step import STATIC_ROWS_AUTO_UP_TO, static_rows_factor
from torchtitan_ext.experiments.moe_backends.dispatcher import RoutingDispatcher
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts
from torchtitan_ext.run_training import FlavorConfigManager

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("gpu_training_runs", ROOT / "scripts" / "gpu_training_runs.py")
assert SPEC is not None and SPEC.loader is not None
runs_module = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(runs_module)
Run = runs_module.Run

SCALE_SUITES = {"scale4": 4, "scale8": 8}


def all_runs(suite: str) -> list:
    return [run for batch in runs_module.suite_runs(suite) for run in batch]


def expert_parallel_degree(run) -> int:
    flag = "--parallelism.expert_parallel_degree"
    return int(run.args[run.args.index(flag) + 1]) if flag in run.args else 1


def parsed(run, monkeypatch):
    """``run``'s config as the train entry parses it on a host of ``run.gpus`` GPUs (of FP8 GEMMs) with
    the memory its flavor needs."""
    monkeypatch.setattr(torchtitan_ext.model_size, "machine_memory_bytes", lambda: 2**50)
    monkeypatch.setattr(startup_checks, "fp8_unavailable_reason", lambda precision: None)
    monkeypatch.setenv("WORLD_SIZE", str(run.gpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(run.gpus))
    monkeypatch.chdir(ROOT)  # the example TOML files are named relative to the checkout
    return FlavorConfigManager().parse_args(["--flavor", run.flavor, *run.args])


@pytest.mark.parametrize("suite, gpus", SCALE_SUITES.items())
def test_scale_suite_runs_every_model_and_layout_next_to_its_stock_baseline(suite, gpus):
    runs = all_runs(suite)
    by_name = {run.name: run for run in runs}
    assert len(by_name) == len(runs), "run names are unique"
    assert {run.gpus for run in runs} == {gpus}
    full_size = [run for run in runs if not run.flavor.startswith("tiny-")]
    expected_degrees = {4: {4}, 8: {8, 4}}[gpus]
    for model in ("qwen3-30b-a3b", "deepseek-v3-16b"):
        for degree in expected_degrees:
            layout = [r for r in full_size if r.name.startswith(f"{model} fsdp{gpus} ep{degree} ")]
            stock = [r for r in layout if r.flavor == f"{model}-torchtitan-moe"]
            assert len(stock) == 1 and stock[0].reference is None and "--compile.enable" in stock[0].args
            assert sorted(r.name.split(" ", 3)[3] for r in layout) == [
                "grouped_mm compiled",
                "torchtitan-moe compiled",
                "triton compiled",
                "triton compiled symm_mem",
                "triton compiled symm_mem cuda_graphs apply_scores",
                "triton compiled symm_mem defaults",
            ]
            for run in layout:
                assert expert_parallel_degree(run) == degree and "--compile.enable" in run.args
                assert run.args[run.args.index("--training.steps") + 1] == "20"
                assert run.args[run.args.index("--training.seq_len") + 1] == "2048"
                if run is not stock[0]:
                    assert run.flavor == model and run.reference == stock[0].name
                    # the same training as the baseline, with the project's layers and their TOML files
                    project_only = [
                        a
                        for a in run.args
                        if a
                        not in (
                            "--toml",
                            *runs_module.TRITON,
                            *runs_module.SYMM_MEM,
                            *runs_module.ALL_TO_ALL,
                            *runs_module.GROUPED_MM,
                            *runs_module.CUDA_GRAPHS_PRESET,
                            *runs_module.EXACT_ROWS,
                        )
                    ]
                    assert project_only == stock[0].args
    assert {expert_parallel_degree(r) for r in full_size} == expected_degrees
    assert len(full_size) == 2 * len(expected_degrees) * 6


@pytest.mark.parametrize("suite, gpus", SCALE_SUITES.items())
def test_scale_suite_compares_tiny_losses_at_every_ep_degree_with_ep1(suite, gpus):
    tiny = [run for run in all_runs(suite) if run.flavor.startswith("tiny-")]
    assert {run.flavor for run in tiny} == {"tiny-moe-triton", "tiny-deepseek-v3"}
    degrees = {4: [4], 8: [4, 8]}[gpus]
    for flavor in ("tiny-moe-triton", "tiny-deepseek-v3"):
        runs = [run for run in tiny if run.flavor == flavor]
        (ep1,) = [run for run in runs if expert_parallel_degree(run) == 1]
        assert ep1.reference is None and all(run.reference == ep1.name for run in runs if run is not ep1)
        layouts = {
            (
                expert_parallel_degree(run),
                "preset"
                if "examples/cuda_graphs.toml" in run.args
                else "symm_mem"
                if "examples/ep_symm_mem.toml" in run.args
                else "all_to_all",
            )
            for run in runs
            if run is not ep1
        }
        assert layouts == {(d, layout) for d in degrees for layout in ("all_to_all", "symm_mem", "preset")}
        assert all(run.gpus == gpus and run.args[:2] == ["--training.steps", "30"] for run in runs)
        assert all(("--compile.enable" in run.args) == ("compiled" in run.name.split()) for run in runs)


@pytest.mark.parametrize("suite", SCALE_SUITES)
def test_every_scale_run_parses_and_trains_the_named_backend_and_transport(suite, monkeypatch):
    """As the runs parse on a host without CUDA (where "auto" keeps exact rows) with Triton's interpreter on,
    as the CPU tests run, on any host."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for run in all_runs(suite):
        config = parsed(run, monkeypatch)
        backends = {experts.compute_backend for experts in nested_configs(config, BackendGroupedExperts.Config)}
        transports = {d.ep_transport for d in nested_configs(config, RoutingDispatcher.Config)}
        assert config.parallelism.expert_parallel_degree == expert_parallel_degree(run), run.name
        assert config.compile.enable == ("compiled" in run.name), run.name
        if run.flavor.endswith("-torchtitan-moe"):
            assert backends == set() and transports == set(), run.name
            continue
        if expert_parallel_degree(run) > 1:
            assert transports == {"symm_mem" if "symm_mem" in run.name.split() else "all_to_all"}, run.name
        receive_rows = {d.ep_receive_rows for d in nested_configs(config, RoutingDispatcher.Config)}
        # without CUDA the train entry turns CUDA graphs off; the preset's sync-free rows say it is the preset
        assert (receive_rows == {"static"}) == ("cuda_graphs" in run.name), run.name
        if run.flavor.startswith("tiny-"):
            assert backends == {"triton"} and config.training.mixed_precision_param == "float32", run.name
        else:
            assert backends == {run.name.split()[3]}, run.name
            assert config.training.local_batch_size == 1 and config.training.mixed_precision_param == "bfloat16"


@pytest.mark.parametrize("suite", runs_module.SUITES)
def test_every_ep_run_trains_over_the_transport_its_name_says_on_a_gpu_host(suite, monkeypatch):
    """On one host of CUDA GPUs (H100s) the default transport, "auto", is symm_mem: each EP run of
    the project's layers names its transport, so it trains over the one its name says; it trains under
    CUDA graphs with static rows where its name says so, or says "defaults" and its static receive
    buffers are no larger than measured."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for run in all_runs(suite):
        if expert_parallel_degree(run) == 1 or run.flavor.endswith("-torchtitan-moe"):
            continue
        config = parsed(run, monkeypatch)
        transports = {d.ep_transport for d in nested_configs(config, RoutingDispatcher.Config)}
        assert transports == {"symm_mem" if "symm_mem" in run.name.split() else "all_to_all"}, run.name
        dispatchers = nested_configs(config, RoutingDispatcher.Config)
        receive_rows = {d.ep_receive_rows for d in dispatchers}
        measured_static_rows = static_rows_factor(config) <= STATIC_ROWS_AUTO_UP_TO
        graphed = "cuda_graphs" in run.name or ("defaults" in run.name.split() and measured_static_rows)
        static = graphed or "static_rows" in run.name.split()
        assert receive_rows == {"static" if static else "exact"}, run.name
        assert config.training.disable_cuda_graphs != graphed, run.name


@pytest.mark.parametrize("suite", ["full", *SCALE_SUITES])
def test_every_full_size_run_names_its_backend_and_whether_it_compiles(suite, monkeypatch):
    """The full-size flavors' defaults (compiled, triton) decide nothing: each run's arguments say
    what its name says, and it parses to that."""
    for run in all_runs(suite):
        if run.flavor.startswith("tiny-"):
            continue
        compiled = "compiled" in run.name.split()
        assert (runs_module.COMPILE if compiled else runs_module.EAGER)[0] in run.args, run.name
        named_backend = {"grouped_mm": runs_module.GROUPED_MM, "triton": runs_module.TRITON}
        if run.flavor.endswith("-torchtitan-moe"):
            assert not any(" ".join(args) in " ".join(run.args) for args in named_backend.values()), run.name
            continue
        (backend,) = [name for name in named_backend if name in run.name.split()]
        assert " ".join(named_backend[backend]) in " ".join(run.args), run.name
        config = parsed(run, monkeypatch)
        assert config.compile.enable == compiled, run.name
        experts = nested_configs(config, BackendGroupedExperts.Config)
        assert {e.compute_backend for e in experts} == {backend}
        precision = "fp8_rowwise" if "fp8" in run.name.split() else "native"
        assert {e.expert_precision for e in experts} == {precision}, run.name


def test_local_batch_size_reaches_every_full_size_run():
    for suite in SCALE_SUITES:
        for batch in runs_module.suite_runs(suite, 3):
            for run in batch:
                if not run.flavor.startswith("tiny-"):
                    assert run.args[run.args.index("--training.local_batch_size") + 1] == "3"


def test_qwen3_on_four_80gb_gpus_is_skipped_with_the_reason():
    skipped = runs_module.runs_that_do_not_fit(all_runs("scale4"), 80 * 10**9)
    assert sorted(skipped) == sorted(run.name for run in all_runs("scale4") if run.flavor.startswith("qwen3"))
    assert "113.7 GiB of each of 4 GPUs" in next(iter(skipped.values()))
    assert runs_module.runs_that_do_not_fit(all_runs("scale8"), 80 * 10**9) == {}


def make_run(name, flavor, reference=None, losses=(2.0, 1.5), tps=100):
    steps = range(1, 21)
    run = Run(name, flavor, 8, [], reference)
    run.losses = {s: losses[0] + (losses[1] - losses[0]) * (s - 1) / 19 for s in steps}
    run.tokens_per_second = dict.fromkeys(steps, tps)
    run.mfu_percent = dict.fromkeys(steps, tps / 10)
    return run


def test_losses_are_compared_with_the_reference_at_the_flavors_tolerance():
    stock = make_run("m stock", "qwen3-30b-a3b-torchtitan-moe")
    close = make_run("m triton", "qwen3-30b-a3b", stock.name, losses=(2.03, 1.5))
    far = make_run("m grouped_mm", "qwen3-30b-a3b", stock.name, losses=(2.1, 1.5))
    tiny_ep1 = make_run("t ep1", "tiny-moe-triton")
    tiny_close = make_run("t ep4", "tiny-moe-triton", tiny_ep1.name, losses=(2.0001, 1.5))
    tiny_far = make_run("t ep8", "tiny-moe-triton", tiny_ep1.name, losses=(2.001, 1.5))
    orphan = make_run("o", "qwen3-30b-a3b", "not run", losses=(9.0, 9.0))
    late_spike = make_run("m for_loop", "qwen3-30b-a3b", stock.name)
    late_spike.losses[runs_module.FULL_SIZE_COMPARED_STEPS + 1] *= 4  # bf16 runs drift apart later
    tiny_late = make_run("t ep2", "tiny-moe-triton", tiny_ep1.name)
    tiny_late.losses[20] *= 1.001  # fp32 runs must agree at every step
    fp8_close = make_run("m fp8 close", "qwen3-30b-a3b", stock.name, losses=(2.07, 1.5))
    fp8_close.args = [*runs_module.FP8]
    fp8_far = make_run("m fp8 far", "qwen3-30b-a3b", stock.name, losses=(2.1, 1.5))
    fp8_far.args = [*runs_module.FP8]
    runs = [stock, close, far, tiny_ep1, tiny_close, tiny_far, orphan, late_spike, tiny_late, fp8_close, fp8_far]
    problems = runs_module.compare_losses(runs)
    assert [problem.split(":")[0] for problem in problems] == ["m grouped_mm", "t ep8", "t ep2", "m fp8 far"]
    assert problems[0].endswith(f"over steps 1-{runs_module.FULL_SIZE_COMPARED_STEPS}")


def test_deepseek_losses_are_compared_over_the_first_two_steps():
    stock = make_run("d stock", "deepseek-v3-16b-torchtitan-moe")
    step3_apart = make_run("d triton", "deepseek-v3-16b", stock.name)
    step3_apart.losses[3] *= 1.4  # its bf16 training from scratch amplifies rounding from step 3 on
    step2_apart = make_run("d grouped_mm", "deepseek-v3-16b", stock.name)
    step2_apart.losses[2] *= 1.03
    qwen_stock = make_run("q stock", "qwen3-30b-a3b-torchtitan-moe")
    qwen_step3_apart = make_run("q triton", "qwen3-30b-a3b", qwen_stock.name)
    qwen_step3_apart.losses[3] *= 1.4
    problems = runs_module.compare_losses([stock, step3_apart, step2_apart, qwen_stock, qwen_step3_apart])
    assert [problem.split(":")[0] for problem in problems] == ["d grouped_mm", "q triton"]
    assert problems[0].endswith("over steps 1-2")
    assert runs_module.compared_steps(stock) == runs_module.compared_steps(step3_apart) == 2


def test_summary_gives_each_run_its_ratio_to_its_stock_baseline():
    stock8 = make_run("m ep8 stock", "qwen3-30b-a3b-torchtitan-moe", tps=100)
    triton8 = make_run("m ep8 triton", "qwen3-30b-a3b", stock8.name, tps=130)
    stock4 = make_run("m ep4 stock", "qwen3-30b-a3b-torchtitan-moe", tps=200)
    triton4 = make_run("m ep4 triton", "qwen3-30b-a3b", stock4.name, tps=250)
    tiny = make_run("t ep4", "tiny-moe-triton", "t ep1")
    rows = {row["name"]: row for row in runs_module.throughput_summary([stock8, triton8, stock4, triton4, tiny])}
    assert {name: row["ratio_to_stock_compiled"] for name, row in rows.items()} == {
        "m ep8 stock": 1.0,
        "m ep8 triton": 1.3,
        "m ep4 stock": 1.0,
        "m ep4 triton": 1.25,
        "t ep4": None,
    }
    assert (
        rows["m ep8 triton"]["median_mfu_percent"] == 13.0 and rows["m ep8 triton"]["median_tokens_per_second"] == 130
    )


def in_round(run, number, tps):
    launched = run.in_round(number)
    launched.losses = dict(run.losses)
    launched.tokens_per_second = {step: tps for step in run.tokens_per_second}
    launched.mfu_percent = {step: tps / 10 for step in run.tokens_per_second}
    return launched


def test_rounds_give_each_run_the_median_of_its_ratios_to_the_stock_run_of_each_round():
    stock = make_run("m stock", "qwen3-30b-a3b-torchtitan-moe")
    ours = make_run("m triton", "qwen3-30b-a3b", stock.name)
    runs = [
        in_round(stock, 1, 100),
        in_round(ours, 1, 150),
        in_round(stock, 2, 80),
        in_round(ours, 2, 100),
        in_round(stock, 3, 100),
        in_round(ours, 3, 130),
    ]
    runs[3].peak_memory_gib = 70.0
    rows = {row["name"]: row for row in runs_module.throughput_summary(runs)}
    assert [launch["ratio_to_stock_compiled"] for launch in rows["m triton"]["rounds"]] == [1.5, 1.25, 1.3]
    assert rows["m triton"]["ratio_to_stock_compiled"] == 1.3  # the median ratio, not the ratio of medians
    assert rows["m triton"]["median_tokens_per_second"] == 130
    assert rows["m triton"]["peak_memory_gib"] == 70.0
    assert rows["m stock"]["ratio_to_stock_compiled"] == 1.0
    assert "rounds" not in runs_module.throughput_summary([stock, ours])[1]


def test_each_round_is_compared_with_its_own_stock_launch():
    stock = make_run("m stock", "qwen3-30b-a3b-torchtitan-moe")
    ours = make_run("m triton", "qwen3-30b-a3b", stock.name)
    wrong = in_round(ours, 2, 100)
    wrong.losses[1] = 9.0
    runs = [in_round(stock, 1, 100), in_round(ours, 1, 100), in_round(stock, 2, 100), wrong]
    problems = runs_module.compare_losses(runs)
    assert len(problems) == 1 and problems[0].startswith("m triton (round 2): loss differs from m stock (round 2)'s")


def test_rounds_launch_every_chosen_run_round_after_round(tmp_path, monkeypatch):
    launched = []

    def fake_launch(run, device_ids, port, env, timeout_s):
        launched.append((run.round, run.name))
        for step in range(1, 21):
            run.losses[step], run.tokens_per_second[step], run.memory_gib[step] = 2.0, 100, 50.0
        run.returncode = 0
        return run

    monkeypatch.setattr(runs_module, "launch", fake_launch)
    monkeypatch.setattr(runs_module.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(runs_module, "runs_that_do_not_fit", lambda runs, memory: {})
    monkeypatch.setattr(
        runs_module.torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": 2**40})
    )
    monkeypatch.setattr(runs_module, "environment", dict)
    out = tmp_path / "full.json"
    only = ["torchtitan-moe.compiled$", "triton.compiled.symm_mem.defaults$"]
    assert runs_module.main(["full", "--out", str(out), "--rounds", "2", "--only", *only]) == 0
    names = [name for _, name in launched]
    assert [number for number, _ in launched] == [1] * (len(names) // 2) + [2] * (len(names) // 2)
    assert names[: len(names) // 2] == names[len(names) // 2 :]
    assert any("torchtitan-moe" in name for name in names) and any("defaults" in name for name in names)
    summary = json.loads(out.read_text())["summary"]
    assert all(len(row["rounds"]) == 2 for row in summary)


def test_train_rounds_reach_the_suite(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAIN_ROUNDS", "3")
    result, commands = measure_on_gpu(tmp_path, 2, "train-full")
    assert result.returncode == 0, result.stdout + result.stderr
    [suite] = [c.split() for c in commands if "gpu_training_runs.py" in c]
    assert suite[suite.index("--rounds") + 1] == "3"


@pytest.mark.parametrize("suite", ["tiny", "numerics"])
def test_rounds_are_refused_for_the_suites_that_do_not_time(suite, tmp_path, capsys):
    with pytest.raises(SystemExit):
        runs_module.main([suite, "--out", str(tmp_path / "out.json"), "--rounds", "2"])
    assert "--rounds times the speed suites" in capsys.readouterr().err


@pytest.mark.parametrize("suite", SCALE_SUITES)
def test_a_host_with_too_few_gpus_is_told_before_anything_runs(suite, tmp_path, capsys):
    gpus = SCALE_SUITES[suite]
    if torch.cuda.device_count() >= gpus:
        pytest.skip(f"this host has the {gpus} GPUs the {suite} suite runs on")
    with pytest.raises(SystemExit) as exit_info:
        runs_module.main([suite, "--out", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert (
        f"the {suite} suite runs on {gpus} GPUs of one host; this host has {torch.cuda.device_count()}"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "out.json").exists()


def measure_on_gpu(tmp_path: Path, gpus: int, *tasks: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """scripts/measure_on_gpu.sh with stand-ins for nvidia-smi (``gpus`` GPUs), python3 and torchrun
    that log their arguments: (the result, the logged commands)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "commands.log"
    bin_dir.mkdir()
    stand_ins = {
        "nvidia-smi": f'[ "$1" = --list-gpus ] && for i in $(seq {gpus}); do echo "GPU $i"; done; exit 0',
        "python3": f'echo "python3 $*" >> {log}',
        "torchrun": f'echo "torchrun $*" >> {log}',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "measure_on_gpu.sh"), *tasks],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    commands = log.read_text().splitlines() if log.exists() else []
    return result, [c for c in commands if "pip install" not in c]


def test_scale_out_on_eight_gpus_runs_ep4_ep8_and_the_8_gpu_suite(tmp_path):
    result, commands = measure_on_gpu(tmp_path, 8, "scale-out")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [c.split()[:2] for c in commands] == [
        ["torchrun", "--nproc_per_node=4"],
        ["torchrun", "--nproc_per_node=8"],
        ["python3", "scripts/gpu_training_runs.py"],
    ]
    assert commands[2].split()[2] == "scale8"


def test_scale_out_on_four_gpus_runs_ep4_and_the_4_gpu_suite(tmp_path):
    result, commands = measure_on_gpu(tmp_path, 4, "scale-out")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [" ".join(c.split()[:3]) for c in commands] == [
        "torchrun --nproc_per_node=4 -m",
        "python3 scripts/gpu_training_runs.py scale4",
    ]


@pytest.mark.parametrize("task, needed", [("scale-out", 4), ("ep8", 8)])
def test_tasks_refuse_a_host_with_too_few_gpus(tmp_path, task, needed):
    result, commands = measure_on_gpu(tmp_path, 2, task)
    assert result.returncode == 2 and commands == []
    assert f"{task} needs {needed} GPUs of one host; this host has 2" in result.stdout


def test_two_gpu_suites_compare_with_for_loop_and_with_stock_compiled():
    tiny = all_runs("tiny")
    for run in tiny:
        name = run.name.removesuffix(" defaults").removesuffix(" cuda_graphs")
        backend, _, layout = name.removesuffix(" compiled").partition(" ")
        eager_for_loop = backend == "for_loop" and not run.name.endswith("compiled")
        expected = None if eager_for_loop or "warm" in layout else f"for_loop {layout}"
        assert run.reference == expected, run.name
    (stock, *others) = all_runs("full")
    assert stock.name == runs_module.STOCK_COMPILED and stock.reference is None
    assert all(run.reference == stock.name for run in others)


def test_fp8_task_runs_the_fp8_tests_layers_and_runs_next_to_bf16_and_stock(tmp_path):
    result, commands = measure_on_gpu(tmp_path, 2, "fp8")
    assert result.returncode == 0, result.stdout + result.stderr
    (tests,) = [c for c in commands if c.startswith("python3 -m pytest")]
    (layer,) = [c for c in commands if "bench layer" in c]
    (training,) = [c for c in commands if "gpu_training_runs.py" in c]
    assert "tests/test_fp8_experts_gpu.py" in tests
    assert {"grouped_mm_fp8", "torchtitan_fp8"} <= set(layer.split())  # the stand-in python3 imports torchao
    only = training.split("--only ")[1].split(" --")[0].split()
    chosen = [run.name for batch in runs_module.only_matching(runs_module.suite_runs("full"), only) for run in batch]
    assert chosen == [
        runs_module.STOCK_COMPILED,
        "olmoe grouped_mm compiled",
        "olmoe triton compiled symm_mem defaults",
        "olmoe grouped_mm compiled symm_mem",
        "olmoe grouped_mm compiled symm_mem defaults",
        "olmoe grouped_mm fp8 compiled",
        "olmoe grouped_mm fp8 compiled symm_mem",
        "olmoe grouped_mm fp8 compiled symm_mem defaults",
        "olmoe triton fp8 compiled symm_mem",
        "olmoe triton fp8 compiled symm_mem defaults",
        "olmoe triton compiled symm_mem",
    ]


def test_only_runs_the_matching_runs_with_the_runs_they_are_compared_with():
    def chosen(*patterns):
        return [
            run.name
            for batch in runs_module.only_matching(runs_module.suite_runs("scale4"), list(patterns))
            for run in batch
        ]

    assert chosen("^deepseek-v3-16b.*symm_mem$", "tiny-deepseek-v3 fsdp4 ep4 all_to_all") == [
        "tiny-deepseek-v3 fsdp4 ep1",
        "tiny-deepseek-v3 fsdp4 ep4 all_to_all",
        "deepseek-v3-16b fsdp4 ep4 torchtitan-moe compiled",
        "deepseek-v3-16b fsdp4 ep4 triton compiled symm_mem",
    ]
    assert chosen("no such run") == []


def test_tiny_suite_compiles_every_backend_at_every_layout(monkeypatch):
    tiny = {run.name: run for run in all_runs("tiny")}
    for backend in runs_module.TINY_BACKENDS:
        for layout in ("ep1 1gpu", "ep2 all_to_all", "ep2 symm_mem"):
            eager, compiled = tiny[f"{backend} {layout}"], tiny[f"{backend} {layout} compiled"]
            exact = runs_module.EXACT_ROWS if compiled.gpus > 1 else []
            assert compiled.args == [*eager.args, *runs_module.COMPILE, *exact] and compiled.flavor == eager.flavor
            assert parsed(compiled, monkeypatch).compile.enable and not parsed(eager, monkeypatch).compile.enable


def test_tiny_suite_trains_triton_under_cuda_graphs_against_for_loop_eager_on_one_gpu_and_over_symm_mem(monkeypatch):
    tiny = {run.name: run for run in all_runs("tiny")}
    graphed = [run for run in tiny.values() if "cuda_graphs" in run.name]
    assert [(run.gpus, run.reference) for run in graphed] == [(1, "for_loop ep1 1gpu"), (2, "for_loop ep2 symm_mem")]
    defaults = tiny["triton ep2 symm_mem compiled defaults"]
    assert defaults.reference == "for_loop ep2 symm_mem" and "--moe.ep_receive_rows" not in defaults.args
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton backend parses on a host without CUDA
    for run in graphed:
        assert "--training.no-disable-cuda-graphs" in run.args and tiny[run.reference].args[0] == run.args[0]
        config = parsed(run, monkeypatch)
        assert config.compile.enable and config.parallelism.expert_parallel_degree == run.gpus
        assert not tiny[run.reference].args.count("--compile.enable")


def test_numerics_suite_trains_each_bf16_layer_and_fp8_for_300_steps_on_the_endless_corpus(monkeypatch):
    runs = all_runs("numerics")
    assert [run.name for run in runs] == [
        runs_module.STOCK_COMPILED,
        "olmoe grouped_mm compiled",
        "olmoe triton compiled",
        *runs_module.NUMERICS_FP8,
    ]
    for run in runs:
        config = parsed(run, monkeypatch)
        assert config.training.steps == 300 and config.training.local_batch_size == 2 and config.compile.enable
        assert config.dataloader.dataset == "markov_text"
        assert run.reference is None, run.name
        precisions = {e.expert_precision for e in nested_configs(config, BackendGroupedExperts.Config)}
        assert precisions <= {"fp8_rowwise" if run.name in runs_module.NUMERICS_FP8 else "native"}, run.name


def curve(name: str, losses: list[float]) -> Run:
    run = Run(name, "olmoe-1b-7b", 2, [])
    run.losses = {step: loss for step, loss in enumerate(losses, start=1)}
    return run


def test_loss_band_counts_the_steps_and_windows_of_the_probe_inside_the_others_spread():
    low, high = curve("a", [2.0, 2.0, 1.0, 1.0]), curve("b", [2.2, 2.2, 1.2, 1.2])
    probe = curve("fp8", [2.1, 2.3, 1.1, 0.9])
    band = runs_module.loss_band([low, high, probe], probe="fp8", window=2)
    assert band["band_of"] == ["a", "b"]
    assert band["steps"]["compared"] == 4 and band["steps"]["inside"] == 2
    assert band["steps"]["largest_rel_above"] == pytest.approx(0.1 / 2.2)  # 2.3 above 2.2
    assert band["steps"]["largest_rel_below"] == pytest.approx(0.1)  # 0.9 below 1.0
    # window means: probe 2.2 in [2.0, 2.2]; 1.0 in [1.0, 1.2]
    assert band["windows_of_2"] == {"compared": 2, "inside": 2, "largest_rel_above": 0.0, "largest_rel_below": 0.0}
    assert runs_module.loss_band([low, probe], probe="fp8") is None
    assert runs_module.loss_band([low, high], probe="fp8") is None


def test_each_fp8_runs_loss_band_is_the_bf16_runs_spread():
    first, second = runs_module.NUMERICS_FP8
    bf16 = [curve("a", [2.0, 1.0]), curve("b", [2.2, 1.2])]
    fp8 = [curve(first, [2.1, 1.1]), curve(second, [9.0, 9.0])]
    assert runs_module.loss_band([*bf16, *fp8], probe=first)["band_of"] == ["a", "b"]
    assert runs_module.loss_band([*bf16, *fp8], probe=second)["steps"]["inside"] == 0


def test_a_run_killed_after_training_completed_says_so_in_one_line():
    log = ["step: 300  loss: 1.4\n", "Training completed\n", "TCPStore: Broken pipe\n"]
    tail = runs_module.error_tail(log, -9, 165, 300)
    assert tail == (
        "killed (-9) by the suite's run timeout (165 s, --run-timeout) after the run logged 'Training completed' "
        "and 300 steps"
    )
    assert runs_module.error_tail(log[:1], -9, 165, 1) == "step: 300  loss: 1.4\n"
    assert runs_module.error_tail(log, 1, 165, 300) == "".join(log)
    run = make_run("grouped_mm", "olmoe-1b-7b")
    run.returncode, run.error_tail = -9, tail
    _, problems = runs_module.write_results("full", {}, [run], {}, os.devnull)
    assert problems == [f"grouped_mm: exit code -9: {tail}"]


def test_rank_zeros_log_lines_fill_the_run():
    run = Run("r", "olmoe-1b-7b", 2, [])
    steps = [
        "step:  1  loss: 10.8323  grad_norm: 3.1  memory: 61.20GiB(77.3%)  tps: 4,101  tflops: 80.1  mfu: 8.10%",
        "step:  2  loss:  9.5000  grad_norm: 2.9  memory: 63.55GiB(80.2%)  tps: 12,334  tflops: 98.2  mfu: 9.93%",
    ]
    runs_module.record_log_line(run, steps[0], 41.26)
    runs_module.record_log_line(run, steps[1], 43.0)
    runs_module.record_log_line(
        run,
        "[titan]   peak GPU memory:   58.31 GiB allocated, 63.55 GiB reserved by the caching allocator (this rank)",
        50,
    )
    assert run.seconds_to_first_step == 41.3 and run.losses == {1: 10.8323, 2: 9.5}
    assert run.tokens_per_second == {1: 4101, 2: 12334} and run.mfu_percent == {1: 8.1, 2: 9.93}
    assert run.peak_memory_gib == 63.55 and run.peak_allocated_gib == 58.31
    assert runs_module.throughput_summary([run])[0]["peak_allocated_gib"] == 58.31


def test_memory_task_snapshots_stock_and_ours_and_reads_each_snapshot(tmp_path):
    result, commands = measure_on_gpu(tmp_path, 2, "memory")
    assert result.returncode == 0, result.stdout + result.stderr
    trains = [c for c in commands if "torchtitan_ext.train" in c]
    reads = [c for c in commands if "torchtitan_ext.bench memory" in c]
    assert [c.split("--flavor ")[1].split()[0] for c in trains] == ["olmoe-1b-7b-torchtitan-moe", "olmoe-1b-7b"]
    for command in trains:
        options = command.split()
        assert {"--compile.enable", "--profiler.enable_memory_snapshot", "--nproc_per_node=2"} <= set(options)
        assert options[options.index("--profiler.memory_snapshot_freq") + 1] == "8"
        assert options[options.index("--training.steps") + 1] == "8"
    assert "examples/ep_symm_mem.toml" in trains[1] and "examples/triton.toml" in trains[1]
    assert [c.split("--json ")[1] for c in reads] == [
        f"{tmp_path}/out/memory_stock.json",
        f"{tmp_path}/out/memory_triton_symm_mem.json",
    ]


def test_memory_task_refuses_an_unknown_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMORY_RUNS", "stock tritn")
    result, commands = measure_on_gpu(tmp_path, 2, "memory")
    assert result.returncode == 2
    assert "unknown memory run tritn" in result.stdout
    assert len([c for c in commands if "torchtitan_ext.train" in c]) == 1


def test_profile_task_traces_the_flavor_and_each_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("PROFILE_VARIANTS", "--moe.experts_apply_scores true;--moe.ep_transport all_to_all")
    result, commands = measure_on_gpu(tmp_path, 2, "profile")
    assert result.returncode == 0, result.stdout + result.stderr
    trains = [c for c in commands if "torchtitan_ext.train" in c]
    reads = [c for c in commands if "torchtitan_ext.bench trace" in c]
    assert len(trains) == 3 and len(reads) == 3
    assert "experts_apply_scores" not in trains[0]
    assert "--moe.experts_apply_scores true" in trains[1] and "--moe.ep_transport all_to_all" in trains[2]
    for command in trains:
        options = command.split()
        assert {"--compile.enable", "--profiler.enable_profiling", "--nproc_per_node=2"} <= set(options)
        assert options[options.index("--profiler.profile_freq") + 1] == options[options.index("--training.steps") + 1]
    assert [c.split("--json ")[1] for c in reads] == [f"{tmp_path}/out/profile_{i}.json" for i in range(3)]
    assert all("rank*_trace.json.gz" in c for c in reads)  # every rank's trace (the glob, unexpanded here)


def test_profile_task_without_variants_traces_stock_and_the_flavor_as_it_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("PROFILE_VARIANTS", "none")
    monkeypatch.setenv("PROFILE_STOCK", "1")
    result, commands = measure_on_gpu(tmp_path, 2, "profile")
    assert result.returncode == 0, result.stdout + result.stderr
    trains = [c.split() for c in commands if "torchtitan_ext.train" in c]
    assert [options[options.index("--flavor") + 1] for options in trains] == [
        "olmoe-1b-7b-torchtitan-moe",
        "olmoe-1b-7b",
    ]
    assert "--moe.ep_receive_rows" not in trains[1]
    reads = [c for c in commands if "torchtitan_ext.bench trace" in c]
    assert [c.split("--json ")[1] for c in reads] == [f"{tmp_path}/out/profile_{name}.json" for name in ("stock", "0")]


def test_profile_task_takes_a_flavor_its_gpus_and_its_stock_sibling(tmp_path, monkeypatch):
    monkeypatch.setenv("PROFILE_FLAVOR", "deepseek-v3-16b")
    monkeypatch.setenv("PROFILE_GPUS", "4")
    monkeypatch.setenv("PROFILE_STOCK", "1")
    result, commands = measure_on_gpu(tmp_path, 4, "profile")
    assert result.returncode == 0, result.stdout + result.stderr
    trains = [c.split() for c in commands if "torchtitan_ext.train" in c]
    reads = [c for c in commands if "torchtitan_ext.bench trace" in c]
    flavors = [options[options.index("--flavor") + 1] for options in trains]
    assert flavors == ["deepseek-v3-16b-torchtitan-moe", "deepseek-v3-16b", "deepseek-v3-16b"]
    assert "examples/triton.toml" not in trains[0] and "examples/triton.toml" in trains[1]
    assert trains[2][trains[2].index("--moe.ep_receive_rows") + 1] == "exact"  # the step that waits for the host
    for options in trains:
        assert "--nproc_per_node=4" in options
        assert options[options.index("--parallelism.expert_parallel_degree") + 1] == "4"
    names = ["stock", "0", "1"]
    assert [c.split("--json ")[1] for c in reads] == [f"{tmp_path}/out/profile_{name}.json" for name in names]
    two_gpus = tmp_path / "two_gpus"
    two_gpus.mkdir()
    refused, ran = measure_on_gpu(two_gpus, 2, "profile")  # 4 GPUs asked for, 2 here
    assert refused.returncode != 0 and not [c for c in ran if "torchtitan_ext.train" in c]
