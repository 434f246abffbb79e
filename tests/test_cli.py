"""Short keys on the command line: same effect, validation and suggestions as in TOML."""

import logging
import subprocess
import sys

import pytest
import torch

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.command_line import split_override_args, switches_for_parser, take_options
from torchtitan_ext.experiments.moe_backends import cuda_graph_step
from torchtitan_ext.experiments.moe_backends.dispatcher import chosen_ep_transport
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts
from torchtitan_ext.experiments.moe_backends.layer import routing_dispatchers
from torchtitan_ext.metrics.metadata import run_metadata
from torchtitan_ext.run_training import FlavorConfigManager
from torchtitan_ext.stdout_pipe import READER_GONE_EXIT_CODE
from torchtitan_ext.train import main

TINY = "tiny-moe-grouped-mm"
FLAVOR_ARGS = ["--flavor", TINY]


def parse(*args):
    return FlavorConfigManager().parse_args(["--flavor", TINY, *args])


def test_short_keys_split_from_the_command_line_with_toml_values():
    overrides, rest = split_override_args(
        ["--parallelism.ep=1", "--training.lr", "1e-3", "--wandb.enable", "--training.steps", "3"]
    )
    assert overrides == {"parallelism.ep": 1, "training.lr": 1e-3, "wandb.enable": True}
    assert rest == ["--training.steps", "3"]


def test_one_splitter_takes_options_with_inline_next_or_no_value():
    taken, rest = take_options(
        ["--a=1", "x", "--a", "2", "--b", "--a", "--c", "3"], lambda name: name[2:] if name in ("--a", "--c") else None
    )
    assert taken == [("a", "1"), ("a", "2"), ("a", None), ("c", "3")]
    assert rest == ["x", "--b"]


def test_a_short_key_without_a_value_is_refused_unless_it_is_a_switch():
    with pytest.raises(ConfigError, match=r"^command line: --training\.lr needs a value$"):
        split_override_args(["--training.lr", "--training.steps", "3"])
    assert split_override_args(["--wandb.enable", "--training.batch-size=4"]) == (
        {"wandb.enable": True, "training.batch_size": 4},
        [],
    )


def test_a_short_key_and_the_field_it_names_set_apart_name_both_values():
    with pytest.raises(
        ConfigError,
        match=r"^command line: --moe_metrics\.enable false and --metrics\.moe_metrics both set metrics\.moe_metrics "
        r"\(to false and true\); keep one of them$",
    ):
        parse("--moe_metrics.enable", "false", "--metrics.moe_metrics", "true")


def test_switches_given_a_value_are_spelled_as_the_parser_takes_them():
    keys = ["compile.enable", "training.disable_cuda_graphs"]
    args = ["--compile.enable", "false", "--training.disable-cuda-graphs=true", "--compile.no_enable", "false"]
    assert switches_for_parser(args, keys) == [
        "--compile.no_enable",
        "--training.disable_cuda_graphs",
        "--compile.enable",
    ]
    untouched = ["--compile.enable", "--training.steps", "false", "--compile.enable", "activation-checkpoint:full"]
    assert switches_for_parser(untouched, keys) == untouched
    for bad in (["--compile.enable", "maybe"], ["--compile.enable=False"]):
        with pytest.raises(ConfigError, match=r"--compile\.enable is a switch: give true, false or no value"):
            switches_for_parser(bad, keys)


@pytest.mark.parametrize("value", [True, False])
def test_torchtitan_switches_take_true_or_false_as_the_short_keys_do(value):
    text = str(value).lower()
    config = parse("--compile.enable", text, "--metrics.enable-tensorboard", text, "--moe_metrics.enable", text)
    assert (config.compile.enable, config.metrics.enable_tensorboard, config.metrics.moe_metrics) == (value,) * 3
    assert parse(f"--compile.enable={text}").compile.enable is value


def test_activation_checkpoint_mode_is_a_key_and_torchtitans_subcommands_set_it(tmp_path):
    toml = tmp_path / "full.toml"
    toml.write_text('[activation_checkpoint]\nmode = "full"\npreserve_rng_state = false\n')
    full = parse("--toml", str(toml)).activation_checkpoint
    assert (type(full).__qualname__, full.preserve_rng_state) == ("FullAC.Config", False)
    for args in (["activation-checkpoint:selective"], ["--activation_checkpoint.mode", "selective"]):
        selective = parse("--toml", str(toml), *args).activation_checkpoint
        assert (type(selective).__qualname__, selective.preserve_rng_state) == ("MoESelectiveAC.Config", False), args
    assert parse("activation-checkpoint:none").activation_checkpoint is None
    assert type(parse("--activation_checkpoint.mode=full").activation_checkpoint).__qualname__ == "FullAC.Config"
    with pytest.raises(ConfigError, match=r"--activation_checkpoint\.mode is given twice \(full, none\)"):
        parse("--activation_checkpoint.mode", "full", "activation-checkpoint:none")
    with pytest.raises(ConfigError, match=r"activation_checkpoint\.mode = 'ful' is not one of the valid choices"):
        parse("--activation_checkpoint.mode", "ful")


def test_short_keys_on_the_command_line_take_effect():
    config = parse(
        "--moe.compute_backend", "for_loop", "--training.lr", "1e-3", "--parallelism.ep", "1", "--training.steps", "3"
    )
    backends = {e.compute_backend for _, e, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)}
    assert backends == {"for_loop"}
    assert {g.optimizer_kwargs["lr"] for g in config.optimizer.param_groups} == {1e-3}
    assert config.training.steps == 3


def test_command_line_beats_toml(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('[moe]\ncompute_backend = "batched_mm_padded"\n')
    config = parse("--toml", str(toml), "--moe.compute_backend", "for_loop")
    backends = {e.compute_backend for _, e, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)}
    assert backends == {"for_loop"}


@pytest.mark.parametrize(
    "args,fragments",
    [
        (
            ["--moe.compute_backend", "for_lop"],
            ["command line: moe.compute_backend = 'for_lop' is not one of the valid choices"],
        ),
        (["--training.lr", "nan"], ["training.lr = nan: must be a finite number > 0"]),
        (["--parallelism.epp", "2"], ["unknown option --parallelism.epp; did you mean", "--parallelism.ep"]),
        (["--training.steps", "x"], ["command line: training.steps = 'x': expected int (How many train steps"]),
        (["--training.steps", "0"], ["training.steps = 0: must be >= 1"]),
        (["--metrics.log_freq", "0"], ["metrics.log_freq = 0: must be >= 1 (every N steps)"]),
        (["--training.lr"], ["--training.lr needs a value"]),
        (["--compile.enable", "yes"], ["--compile.enable is a switch: give true, false or no value, got 'yes'"]),
        (
            ["--moe.recompute_preactivations", "true"],
            [
                "moe.recompute_preactivations = true: compute_backend 'grouped_mm' with expert_precision 'native' "
                "keeps its pre-activations for backward; triton in native precision can recompute them"
            ],
        ),
        (
            ["--moe.recompute_preactivations_layers", "1"],
            ["moe.recompute_preactivations = true: compute_backend 'grouped_mm' with expert_precision 'native'"],
        ),
        (
            ["--moe.experts_fsdp", "never"],
            ["command line: moe.experts_fsdp = 'never' is not one of the valid choices"],
        ),
        (
            ["--moe.recompute_preactivations_layers", "3"],
            ["moe.recompute_preactivations_layers = 3: this flavor has 2 MoE layers (0 to 2;"],
        ),
    ],
)
def test_bad_command_line_is_one_message_and_exit_2(capsys, args, fragments):
    code = main(["--flavor", TINY, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("error:") == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_bad_command_line_raises_config_error():
    with pytest.raises(ConfigError, match=r"unknown option --training\.stepz; did you mean --training\.steps"):
        parse("--training.stepz", "3")


def test_help_lists_short_keys_with_types_and_choices(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--moe.compute_backend" in out and "{grouped_mm,for_loop,batched_mm_padded,triton,auto}" in out
    assert "--parallelism.ep" in out and "--training.lr" in out and "float" in out


def test_run_metadata_and_start_up_line_name_the_ep_transport_under_ep(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level(logging.INFO):
        parse("--parallelism.expert_parallel_degree", "2")
    chosen = chosen_ep_transport("auto", 2)  # symm_mem on a host with CUDA GPUs, else all_to_all
    assert run_metadata()["ep_transport"] == chosen
    assert f"expert_parallel_degree=2, ep_transport={chosen}," in caplog.text
    parse()
    assert "ep_transport" not in run_metadata()


def test_experts_that_recompute_their_preactivations_are_named_in_the_start_up_line_and_the_metadata(
    monkeypatch, caplog
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton backend on a host without CUDA
    with caplog.at_level(logging.INFO):
        FlavorConfigManager().parse_args(["--flavor", "tiny-moe-triton", "--moe.recompute_preactivations", "true"])
    assert run_metadata()["recompute_preactivations"] is True
    assert "compute_backend=triton, expert_parallel_degree=1, recompute_preactivations=True," in caplog.text
    parse()
    assert "recompute_preactivations" not in run_metadata()


def test_experts_in_fsdp_on_every_layout_are_named_in_the_start_up_line_and_the_metadata(caplog):
    with caplog.at_level(logging.INFO):
        parse("--moe.experts_fsdp", "always")
    assert run_metadata()["experts_fsdp"] == "always"
    assert "experts_fsdp=always," in caplog.text
    parse()
    assert "experts_fsdp" not in run_metadata()


def test_recompute_preactivations_layers_recompute_in_the_first_moe_layers_only(monkeypatch, caplog):
    """The first N MoE layers, whose activations live through the whole backward, recompute; the rest keep
    their pre-activations, and the start-up line and the metadata count them. Set with
    moe.recompute_preactivations, it is refused as two keys setting one option."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton backend on a host without CUDA
    with caplog.at_level(logging.INFO):
        config = FlavorConfigManager().parse_args(
            ["--flavor", "tiny-moe-triton", "--moe.recompute_preactivations_layers", "1"]
        )
    experts = [e for _, e, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)]
    assert [e.recompute_preactivations for e in experts] == [True, False]
    assert run_metadata()["recompute_preactivations"] == "1 of 2 MoE layers"
    assert "recompute_preactivations=1 of 2 MoE layers," in caplog.text
    both = ["--moe.recompute_preactivations", "true", "--moe.recompute_preactivations_layers", "0"]
    with pytest.raises(ConfigError, match=r"moe\.recompute_preactivations_layers = 0 both set .* keep one of them"):
        FlavorConfigManager().parse_args(["--flavor", "tiny-moe-triton", *both])


def test_ep_options_set_for_a_run_without_ep_are_warned_of_with_where_they_were_set(monkeypatch, tmp_path, caplog):
    toml = tmp_path / "ep.toml"
    toml.write_text('[moe]\nep_transport = "all_to_all"\n')
    without_ep = "has no effect: it applies only with parallelism.expert_parallel_degree > 1, and this run has 1"
    with caplog.at_level(logging.WARNING):
        parse(
            "--toml", str(toml), "--moe.ep_receive_rows", "static", "--moe.align_size", "1",
            "--moe.experts_apply_scores", "true",
        )  # fmt: skip
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert f"{toml}:2: moe.ep_transport {without_ep}" in warnings
    assert f"command line: moe.ep_receive_rows {without_ep}" in warnings
    assert f"command line: moe.experts_apply_scores {without_ep}" in warnings
    caplog.clear()
    parse()  # the flavor's defaults ("auto", "exact") are no one's choice
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    parse("--toml", str(toml), "--parallelism.expert_parallel_degree", "2")
    assert "applies only with parallelism.expert_parallel_degree" not in caplog.text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.steps", "abc"], "training.steps = 'abc': expected int (How many train steps to run"),
        (["--training.steps=1.5"], "training.steps = '1.5': expected int (How many train steps to run"),
        (["--lr_scheduler.warmup_steps", "x"], "lr_scheduler.warmup_steps = 'x': expected int (Steps for lr"),
    ],
)
def test_a_torchtitan_option_given_a_value_of_another_type_is_refused_as_a_short_key_is(args, message):
    with pytest.raises(ConfigError) as refusal:
        parse(*args)
    assert str(refusal.value).startswith(f"command line: {message}")
    assert "\n" not in str(refusal.value)


def test_a_heatmap_period_set_where_no_heatmap_is_drawn_is_warned_of(tmp_path, caplog):
    toml = tmp_path / "metrics.toml"
    toml.write_text("[moe_metrics]\nheatmap_every = 10\n")

    def warnings(*args: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            parse("--toml", str(toml), *args)
        return [record.getMessage() for record in caplog.records if "heatmap_every" in record.getMessage()]

    setting = f"{toml}:2: moe_metrics.heatmap_every = 10 has no effect"
    assert warnings("--moe_metrics.enable", "false") == [
        f"{setting}: the MoE metrics are off (command line: moe_metrics.enable = false)"
    ]
    assert warnings() == [
        f"{setting}: the heatmap is an image for Weights & Biases or TensorBoard, and neither is on "
        "(wandb.enable, tensorboard.enable)"
    ]
    assert warnings("--tensorboard.enable", "true") == []
    assert warnings("--moe_metrics.enable", "false", "--moe_metrics.heatmap_every", "0") == []
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse("--moe_metrics.enable", "false")  # the flavor's default period is no one's choice
    assert "heatmap_every" not in caplog.text


@pytest.mark.parametrize(
    "cuda, interpreter, processes_per_host, chosen, why",
    [
        (True, False, "2", "symm_mem", "every EP group of 2 ranks is on one host of CUDA GPUs"),
        (True, False, "1", "all_to_all", "needs every rank of an EP group on one host"),
        (True, True, "2", "all_to_all", "Triton's interpreter is on"),
        (False, False, "2", "all_to_all", "no CUDA GPU"),
    ],
)
def test_auto_ep_transport_is_symm_mem_where_every_ep_group_is_on_one_gpu_host(
    monkeypatch, caplog, cuda, interpreter, processes_per_host, chosen, why
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", processes_per_host)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if interpreter:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.INFO):
        config = parse("--parallelism.expert_parallel_degree", "2")
    assert {dispatcher.ep_transport for dispatcher in routing_dispatchers(config)} == {chosen}
    assert run_metadata()["ep_transport"] == chosen
    assert f"moe.ep_transport = 'auto' -> '{chosen}' (" in caplog.text and why in caplog.text
    assert "--toml examples/ep_symm_mem.toml" not in caplog.text  # no note suggests what "auto" chose against


@pytest.mark.parametrize(
    "cuda, processes_per_host, transport, noted",
    [
        (True, "2", "all_to_all", True),
        (True, "1", "all_to_all", False),  # an EP group spans hosts
        (True, "2", "symm_mem", False),
        (False, "2", "all_to_all", False),
    ],
)
def test_all_to_all_within_a_gpu_host_notes_symm_mem(monkeypatch, caplog, cuda, processes_per_host, transport, noted):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", processes_per_host)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with caplog.at_level(logging.INFO):
        parse("--parallelism.expert_parallel_degree", "2", "--moe.ep_transport", transport)
    assert ("moe.ep_transport = 'symm_mem' (--toml examples/ep_symm_mem.toml)" in caplog.text) == noted


def parse_on_a_gpu_host(monkeypatch, caplog, ep: str, *args: str):
    """The config at EP ``ep`` of compiled triton with the options ``args`` (``--key value`` pairs, which
    replace those defaults), parsed as on a host of ``ep`` Hopper GPUs; the start-up log in ``caplog``."""
    monkeypatch.setenv("WORLD_SIZE", ep)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", ep)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    options = {"--moe.compute_backend": "triton", "--compile.enable": "true", **dict(zip(args[::2], args[1::2]))}
    caplog.clear()
    with caplog.at_level(logging.INFO):
        return parse(
            "--parallelism.expert_parallel_degree", ep, *(part for option in options.items() for part in option)
        )


def auto_rows_line(caplog) -> str:
    """The start-up log's line on what ``moe.ep_receive_rows = "auto"`` became ("" where none was logged)."""
    return next((line for line in caplog.text.splitlines() if "moe.ep_receive_rows = 'auto' ->" in line), "")


def test_auto_receive_rows_turn_on_cuda_graphs_where_a_compiled_symm_mem_step_replays(monkeypatch, caplog):
    config = parse_on_a_gpu_host(monkeypatch, caplog, "2")
    dispatchers = routing_dispatchers(config)
    assert {(d.ep_transport, d.ep_receive_rows, d.experts_apply_scores) for d in dispatchers} == {
        ("symm_mem", "static", True)
    }
    assert not config.training.disable_cuda_graphs
    line = auto_rows_line(caplog)
    assert "-> 'static', training.disable_cuda_graphs -> false, moe.experts_apply_scores -> true" in line
    assert "static receive buffers 2x a balanced step's rows" in line and "--moe.ep_receive_rows exact" in line
    assert "ep_receive_rows=static, experts_apply_scores=True, compile=on, cuda_graphs=on" in caplog.text
    assert run_metadata()["ep_receive_rows"] == "static"


@pytest.mark.parametrize(
    "args, ep, why",
    [
        (["--moe.ep_transport", "all_to_all"], "2", "rows move over all_to_all"),
        (["--compile.enable", "false"], "2", "the model runs eager"),
        (["--moe.compute_backend", "for_loop"], "2", "compute_backend for_loop reads expert counts on the host"),
        (["--moe.compute_backend", "grouped_mm"], "2", "compute_backend grouped_mm in float32"),
        (["--moe.expert_precision", "fp8_rowwise"], "2", "FP8 weight gradients in float32 on compute capability"),
        (
            ["--moe.align_size", "8"],
            "2",
            "the experts cannot apply the router scores (the symm_mem transport pads its expert groups",
        ),
        (["--moe.experts_apply_scores", "false"], "2", "experts_apply_scores = false (command line): static rows"),
        (["--training.disable_cuda_graphs", "true"], "2", "CUDA graphs are off (command line)"),
    ],
)
def test_auto_receive_rows_stay_exact_with_the_reason(monkeypatch, caplog, args, ep, why):
    config = parse_on_a_gpu_host(monkeypatch, caplog, ep, *args)
    assert {d.ep_receive_rows for d in routing_dispatchers(config)} == {"exact"}
    assert config.training.disable_cuda_graphs and not any(d.experts_apply_scores for d in routing_dispatchers(config))
    line = auto_rows_line(caplog)
    assert "-> 'exact' (" in line and why in line, line


def test_auto_receive_rows_stop_where_the_static_buffers_were_not_measured(monkeypatch, caplog):
    config = parse_on_a_gpu_host(monkeypatch, caplog, "4")
    assert {d.ep_receive_rows for d in routing_dispatchers(config)} == {"static"}
    monkeypatch.setattr(cuda_graph_step, "STATIC_ROWS_AUTO_UP_TO", 2)
    config = parse_on_a_gpu_host(monkeypatch, caplog, "4")
    assert {d.ep_receive_rows for d in routing_dispatchers(config)} == {"exact"}
    assert "static receive buffers would hold 4x a balanced step's rows (measured up to 2x)" in auto_rows_line(caplog)


def test_set_options_win_over_the_auto_receive_rows(monkeypatch, caplog):
    """A TOML file's or the command line's ep_receive_rows and experts_apply_scores are kept (the latter
    false: exact rows, above); CUDA graphs asked for over all_to_all take static rows, which a captured
    step needs."""
    config = parse_on_a_gpu_host(monkeypatch, caplog, "2", "--moe.ep_receive_rows", "exact")
    assert {d.ep_receive_rows for d in routing_dispatchers(config)} == {"exact"}
    assert config.training.disable_cuda_graphs and not auto_rows_line(caplog)
    config = parse_on_a_gpu_host(monkeypatch, caplog, "2", "--moe.experts_apply_scores", "true")
    assert {(d.ep_receive_rows, d.experts_apply_scores) for d in routing_dispatchers(config)} == {("static", True)}
    assert "-> 'static', training.disable_cuda_graphs -> false (" in auto_rows_line(caplog)
    args = ["--moe.ep_transport", "all_to_all", "--training.disable_cuda_graphs", "false"]
    config = parse_on_a_gpu_host(monkeypatch, caplog, "2", *args)
    assert {(d.ep_receive_rows, d.experts_apply_scores) for d in routing_dispatchers(config)} == {("static", False)}
    assert "-> 'static' (CUDA graphs are on" in auto_rows_line(caplog)


def test_cuda_graphs_asked_for_on_cpu_take_the_rows_a_gpu_run_captures_and_say_none_is_captured(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU host, also where the tests run on GPUs
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["--parallelism.expert_parallel_degree", "2", "--moe.compute_backend", "triton"]
    with caplog.at_level(logging.INFO):
        config = parse(*args, "--training.disable_cuda_graphs", "false")
    assert {d.ep_receive_rows for d in routing_dispatchers(config)} == {"static"}
    assert (
        "-> 'static' (CUDA graphs are asked for, and a captured EP step reads nothing on the host; without a "
        "CUDA device no graph is captured, and these are the rows a GPU run would capture)" in auto_rows_line(caplog)
    )
    assert "cuda_graphs=off (no CUDA device; training.disable_cuda_graphs = false applies on GPUs)" in caplog.text


def test_auto_receive_rows_name_the_toml_line_that_keeps_them_exact(monkeypatch, caplog, tmp_path):
    toml = tmp_path / "scores.toml"
    toml.write_text("[moe]\nexperts_apply_scores = false\n")
    config = parse_on_a_gpu_host(monkeypatch, caplog, "2", "--toml", str(toml))
    assert {d.ep_receive_rows for d in routing_dispatchers(config)} == {"exact"}
    assert f"experts_apply_scores = false ({toml}:2): static rows" in auto_rows_line(caplog)


@pytest.mark.parametrize(
    "args",
    [
        ["--moe.compute_backend", "grouped_mm", "--training.mixed_precision_param", "bfloat16"],
        ["--moe.expert_precision", "fp8_rowwise", "--training.mixed_precision_param", "bfloat16"],
        [
            "--moe.compute_backend",
            "grouped_mm",
            "--moe.expert_precision",
            "fp8_rowwise",
            "--training.mixed_precision_param",
            "bfloat16",
        ],
    ],
    ids=["grouped_mm", "fp8_triton", "fp8_grouped_mm"],
)
def test_auto_receive_rows_turn_on_cuda_graphs_for_every_backend_that_weights_its_rows(monkeypatch, caplog, args):
    """grouped_mm (in bf16) and FP8 experts weight the down projection's input rows by their scores, so they
    take static rows under CUDA graphs as triton does."""
    config = parse_on_a_gpu_host(monkeypatch, caplog, "2", *args)
    assert {(d.ep_receive_rows, d.experts_apply_scores) for d in routing_dispatchers(config)} == {("static", True)}
    assert not config.training.disable_cuda_graphs
    assert "-> 'static', training.disable_cuda_graphs -> false" in auto_rows_line(caplog)


def test_auto_receive_rows_leave_emulated_fp8_experts_without_cuda_graphs(monkeypatch, caplog):
    """The emulated FP8 GEMMs run torch._grouped_mm in fp32, which reads its offsets on the host (as for
    a GPU where the emulation is asked for)."""
    config = parse_on_a_gpu_host(monkeypatch, caplog, "2", "--moe.ep_receive_rows", "exact")
    for dispatcher in routing_dispatchers(config):
        dispatcher.ep_receive_rows = "auto"
    for _, experts, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config):
        experts.expert_precision = "fp8_rowwise_emulated"
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "bfloat16"
    choice = cuda_graph_step.auto_receive_rows(config, True, cuda_graph_step.SetBy())
    assert choice.rows == "exact" and "expert_precision fp8_rowwise_emulated computes its GEMMs" in choice.why
    assert cuda_graph_step.auto_receive_rows(config, False, cuda_graph_step.SetBy()).why == (
        "CUDA graphs stay off: no NVIDIA CUDA GPU"
    )


def test_one_gpu_turns_on_the_flavors_cuda_graphs_where_the_compiled_step_replays(monkeypatch, caplog):
    """Without EP the receive rows are exact (nothing is exchanged) and a compiled step on one GPU replays
    as a CUDA graph; the start-up lines say so."""
    config = parse_on_a_gpu_host(monkeypatch, caplog, "1")
    assert {d.ep_receive_rows for d in routing_dispatchers(config)} == {"exact"} and not auto_rows_line(caplog)
    assert not config.training.disable_cuda_graphs
    assert "training.disable_cuda_graphs -> false (one GPU: the compiled step replays as a CUDA graph" in caplog.text
    assert "--training.disable_cuda_graphs true keeps them off" in caplog.text
    assert "expert_parallel_degree=1, compile=on, cuda_graphs=on" in caplog.text


@pytest.mark.parametrize(
    "args, why",
    [
        (["--compile.enable", "false"], "the model runs eager"),
        (["--moe.compute_backend", "for_loop"], "compute_backend for_loop reads expert counts on the host"),
        (["--moe.compute_backend", "grouped_mm"], "compute_backend grouped_mm in float32"),
    ],
)
def test_one_gpu_keeps_the_flavors_cuda_graphs_off_with_the_reason(monkeypatch, caplog, args, why):
    config = parse_on_a_gpu_host(monkeypatch, caplog, "1", *args)
    assert config.training.disable_cuda_graphs
    assert f"training.disable_cuda_graphs stays true ({why}" in caplog.text


def test_one_gpu_leaves_cuda_graphs_set_by_the_user_and_the_stock_layers_alone(monkeypatch, caplog):
    config = parse_on_a_gpu_host(monkeypatch, caplog, "1", "--training.disable_cuda_graphs", "true")
    assert config.training.disable_cuda_graphs and "training.disable_cuda_graphs -> false" not in caplog.text
    assert "training.disable_cuda_graphs stays true" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        config = FlavorConfigManager().parse_args(["--flavor", "tiny-torchtitan-moe", "--compile.enable", "true"])
    assert config.training.disable_cuda_graphs and "training.disable_cuda_graphs" not in caplog.text


def test_the_one_gpu_rule_names_what_it_was_not_measured_on(monkeypatch, caplog):
    config = parse_on_a_gpu_host(monkeypatch, caplog, "1")
    assert cuda_graph_step.one_gpu_graphs_left_off_reason(config, True, 1) is None
    assert cuda_graph_step.one_gpu_graphs_left_off_reason(config, True, 2) == (
        "2 ranks without expert parallelism: measured on one GPU only"
    )
    assert cuda_graph_step.one_gpu_graphs_left_off_reason(config, False, 1) == "no NVIDIA CUDA GPU"


@pytest.mark.parametrize(
    "args",
    [
        ["--training.batch_size", "4", "--training.local_batch_size", "2"],
        ["--training.local_batch_size", "2", "--training.batch_size", "4"],
        ["--training.batch_size", "8", "--training.local_batch_size", "2"],  # 8: the flavor's own value
        ["--parallelism.ep", "2", "--parallelism.expert_parallel_degree", "1"],
        ["--moe.top_k", "1", "--model.layers.0.moe.router.top_k", "2"],
    ],
)
def test_two_options_that_set_one_field_are_an_error_naming_both(capsys, args):
    code = main(["--flavor", TINY, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error:") == 1 and "keep one of them" in err, err
    for option in args[::2]:
        assert option.removeprefix("--") in err, err


def test_two_options_that_agree_or_sources_in_precedence_are_no_conflict(tmp_path):
    config = parse("--training.batch_size", "2", "--training.local_batch_size", "2")
    assert config.training.local_batch_size == 2
    toml = tmp_path / "a.toml"
    toml.write_text("[training]\nbatch_size = 4\n")
    assert parse("--toml", str(toml), "--training.local_batch_size", "2").training.local_batch_size == 2


def test_model_keys_on_the_command_line_are_the_toml_keys(capsys):
    config = parse("--model.layers.0.moe.router.route_scale", "2.5")
    assert config.model_spec.model.layers[0].moe.router.route_scale == 2.5
    for args, message in (
        (["--model.dim", "128"], "command line: model.dim cannot be overridden"),
        (["--loss.loss_fn.global_vocab_size", "5"], "loss.loss_fn.global_vocab_size cannot be overridden"),
        (["--model.dimm", "128"], "command line: unknown key 'model.dimm'; did you mean model.dim?"),
    ):
        assert main(["--flavor", TINY, *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "subcommands" not in err, err


@pytest.mark.parametrize(
    "args, warmup_steps, decay_ratio",
    [
        (["--training.steps", "50"], 5, 0.8),  # the flavor's schedule fits
        (["--training.steps", "20"], 5, 0.75),
        (["--training.steps", "3"], 3, 0.0),
        (["--training.steps", "20", "--lr_scheduler.warmup_steps", "10"], 10, 0.8),  # set: torchtitan's to adjust
    ],
)
def test_a_short_run_gets_a_schedule_that_fits_unless_one_is_set(args, warmup_steps, decay_ratio):
    scheduler = parse(*args).lr_scheduler
    assert (scheduler.warmup_steps, scheduler.decay_ratio) == (warmup_steps, pytest.approx(decay_ratio))


QUICK_ANSWERS = {
    "--help": (["--help"], 0, "short keys (command line --KEY VALUE, or TOML):"),
    "unknown option": ([*FLAVOR_ARGS, "--training.stesp", "3"], 2, "unknown option --training.stesp; did you mean"),
    "unknown flavor": (
        ["--flavor", "mixtral"],
        2,
        "unknown flavor 'mixtral'; did you mean tiny-mixtral, mixtral-8x7b?",
    ),
    "no flavor": (["--training.steps", "3"], 2, "--flavor is required"),
    "torchrun option last": (
        [*FLAVOR_ARGS, "--nproc_per_node", "2"],
        2,
        f"--nproc_per_node 2: torchrun options come first, before the training arguments: "
        f"python -m torchtitan_ext.train --nproc_per_node 2 --flavor {TINY}",
    ),
    "repeated option": (
        [*FLAVOR_ARGS, "--training.steps", "3", "--training.steps=4"],
        2,
        "--training.steps is given twice (3, 4): give it once",
    ),
    "repeated torchrun option": (
        ["--nproc_per_node=2", "--nproc-per-node", "2", *FLAVOR_ARGS],
        2,
        "--nproc_per_node is given twice (2, 2): give it once",
    ),
}


@pytest.mark.parametrize("case", list(QUICK_ANSWERS))
def test_help_and_argument_errors_come_before_torch_is_imported(capsys, case):
    args, code, text = QUICK_ANSWERS[case]
    assert main(args) == code  # fills the command facts cache of this test session
    assert text in capsys.readouterr()[0 if code == 0 else 1]
    probe = (
        "import sys\n"
        "from torchtitan_ext.train import main\n"
        f"print('exit', main({args!r}))\n"
        "print('heavy modules:', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchtitan')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.endswith(f"exit {code}\nheavy modules: []\n"), result.stdout[-2000:] + result.stderr
    assert text in result.stdout + result.stderr


@pytest.mark.parametrize("module, args", [("torchtitan_ext.flavors", []), ("torchtitan_ext.train", ["--help"])])
def test_output_into_a_reader_that_stopped_ends_quietly(module, args):
    command = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert command.stdout is not None and command.stderr is not None
    command.stdout.close()  # as `| head -1` does once it has its line
    err = command.stderr.read()
    assert command.wait(timeout=120) == READER_GONE_EXIT_CODE, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_flavor_that_does_not_build_leaves_the_others_and_its_run_to_say_why(monkeypatch):
    from torchtitan_ext import registry
    from torchtitan_ext.command_facts import CommandFacts, build_command_facts
    from torchtitan_ext.train import argument_errors

    def broken():
        raise ValueError("this flavor's config does not build")

    registry.all_flavors()
    monkeypatch.setitem(registry._FLAVORS, "broken", registry.Flavor("broken", "d", "moe_backends", broken))
    facts = CommandFacts(**build_command_facts())
    tiny_keys = facts.flavor_keys[TINY]
    assert facts.flavor_keys["broken"] is None and tiny_keys is not None and "training.steps" in tiny_keys
    assert argument_errors(["--flavor", "broken", "--anything", "1"], facts) == []  # the run reports the build
    assert argument_errors([*FLAVOR_ARGS, "--anything", "1"], facts) == ["command line: unknown option --anything"]
    assert argument_errors([*FLAVOR_ARGS, "--show", "tiny-moe-grouped-mm"], facts) == [
        "command line: --show is an option of the flavors command, not of training: "
        "python -m torchtitan_ext.flavors --show NAME [--toml FILE] prints a flavor's settings"
    ]


def test_the_checks_before_torch_name_every_unknown_key_of_every_file_and_the_command_line(tmp_path):
    from torchtitan_ext.command_facts import command_facts
    from torchtitan_ext.train import argument_errors

    files = []
    for name, text in (("a.toml", "[training]\nstepz = 3\n"), ("b.toml", "[moe]\ntop_kk = 1\n")):
        (tmp_path / name).write_text(text)
        files += ["--toml", str(tmp_path / name)]
    errors = argument_errors([*FLAVOR_ARGS, *files, "--model.foo", "1", "--training.sedd", "1"], command_facts())
    assert [e.split(" unknown ")[0] for e in errors] == [
        f"{tmp_path / 'a.toml'}:2:",
        f"{tmp_path / 'b.toml'}:2:",
        "command line:",
        "command line:",
    ], errors
    assert "'model.foo'" in errors[2] and "--training.sedd" in errors[3]


@pytest.mark.parametrize(
    "args, toml",
    [
        (["--training.stesp", "3"], None),
        (["--model.dim", "128"], None),
        (["--model.layers.0.moe", "3"], None),
        (["--nproc_per_node", "2", "--training.steps", "3"], None),
        ([], "[training]\nstepz = 3\n[model]\ndim = 5\ntraining = 3\n"),
        ([], "[training\n"),
        (["--toml"], None),
        (
            [
                "--training.steps",
                "3",
                "--moe.compute-backend=for_loop",
                "--training.steps=4",
                "--moe.compute_backend",
                "for_loop",
            ],
            None,
        ),
        (["--compile.enable", "--training.stesp", "3", "--compile.no-enable"], None),
    ],
)
def test_the_checks_before_torch_say_what_the_run_would(tmp_path, args, toml):
    from torchtitan_ext.command_facts import command_facts
    from torchtitan_ext.train import argument_errors

    if toml is not None:
        (tmp_path / "bad.toml").write_text(toml)
        args = ["--toml", str(tmp_path / "bad.toml"), *args]
    quick = argument_errors([*FLAVOR_ARGS, *args], command_facts())
    with pytest.raises(ConfigError) as error:
        parse(*args)
    assert quick and "\n".join(quick) == str(error.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--moe.compute_backend", "triton", "--moe.compute_backend", "grouped_mm"],
            "--moe.compute_backend is given twice (triton, grouped_mm)",
        ),
        (["--training.steps", "5", "--training.steps=10"], "--training.steps is given twice (5, 10)"),
        (
            ["--training.local-batch-size=2", "--training.local_batch_size", "2"],
            "--training.local_batch_size is given twice (2, 2)",
        ),
        (["--moe.top-k", "1", "--moe.top_k=2"], "--moe.top_k is given twice (1, 2)"),
        (
            ["--model.layers.0.moe.router.top_k=1", "--model.layers.0.moe.router.top-k", "1"],
            "--model.layers.0.moe.router.top_k is given twice (1, 1)",
        ),
        (["--compile.enable", "--compile.enable"], "--compile.enable is given twice (true, true)"),
        (["--compile.enable", "--compile.no-enable"], "--compile.enable is given twice (true, false)"),
        (
            ["--training.seed", "1", "--training.seed=2", "--training.seed", "3"],
            "--training.seed is given 3 times (1, 2, 3)",
        ),
        (["--flavor=tiny-moe-for-loop"], f"--flavor is given twice ({TINY}, tiny-moe-for-loop)"),
    ],
)
def test_a_key_given_twice_is_refused_naming_its_values(capsys, args, message):
    code = main([*FLAVOR_ARGS, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == f"error: command line: {message}: give it once\n"


def test_repeated_keys_are_listed_with_the_other_errors(tmp_path, capsys):
    toml = tmp_path / "a.toml"
    toml.write_text("[training]\nstepz = 3\n")
    args = [*FLAVOR_ARGS, "--toml", str(toml), "--training.steps", "5", "--moe.compute_backend", "triton"]
    args += ["--training.stesp", "1", "--training.steps=10", "--moe.compute-backend=grouped_mm"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    lines = err.removeprefix("error: ").splitlines()
    assert [line.split(" unknown ")[0] for line in lines[:2]] == [f"{toml}:2:", "command line:"], lines
    assert lines[2:] == [
        "command line: --training.steps is given twice (5, 10): give it once",
        "command line: --moe.compute_backend is given twice (triton, grouped_mm): give it once",
    ]


def test_a_torchrun_option_given_twice_is_refused_before_torchrun_starts(monkeypatch, capsys):
    import torchtitan_ext.train

    monkeypatch.setattr(torchtitan_ext.train, "launch", lambda args: pytest.fail("torchrun was started"))
    code = main(
        [
            "--nproc_per_node=2",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            *FLAVOR_ARGS,
            "--training.steps",
            "1",
            "--training.steps",
            "1",
        ]
    )
    assert code == 2
    assert capsys.readouterr().err == (
        "error: command line: --nproc_per_node is given twice (2, 1): give it once\n"
        "command line: --training.steps is given twice (1, 1): give it once\n"
    )


def test_a_toml_key_set_once_on_the_command_line_and_the_values_of_a_list_key_are_no_repeat(tmp_path):
    from torchtitan_ext.command_facts import command_facts
    from torchtitan_ext.train import argument_errors

    files = []
    for name, steps in (("a.toml", 7), ("b.toml", 8)):
        (tmp_path / name).write_text(f'[training]\nsteps = {steps}\n[moe]\ncompute_backend = "for_loop"\n')
        files += ["--toml", str(tmp_path / name)]
    fqns = ["tok_embeddings,layers.0", "layers.1,norm,output"]
    args = [*files, "--training.steps", "11", "--moe.compute_backend", "grouped_mm"]
    args += ["--parallelism.module_fqns_per_model_part", *fqns, "--compile.components", "model"]
    assert argument_errors([*FLAVOR_ARGS, *args], command_facts()) == []
    config = parse(*args)
    assert config.training.steps == 11
    assert {e.compute_backend for _, e, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)} == {
        "grouped_mm"
    }
    assert config.parallelism.module_fqns_per_model_part == [fqn.split(",") for fqn in fqns]
    assert config.compile.components == ["model"]
