"""Flavor registry, TOML overrides and the command-line entry points: good and bad input."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import apply_overrides, apply_toml_files
from torchtitan_ext.config.checks import run_config_checks
from torchtitan_ext.config.command_line import split_project_args
from torchtitan_ext.config.toml_files import load_toml
from torchtitan_ext.experiments.moe_backends.dispatcher import RoutingDispatcher
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts
from torchtitan_ext.flavors import main as flavors_main
from torchtitan_ext.model_size import parameter_counts
from torchtitan_ext.registry import UnknownFlavorError, all_flavors, get_flavor
from torchtitan_ext.run_training import FlavorConfigManager

TINY = "tiny-moe-grouped-mm"
FULL_SIZE = {"qwen3-30b-a3b", "deepseek-v3-16b", "mixtral-8x7b", "olmoe-1b-7b"}


def backends_of(config) -> set[str]:
    return {c.compute_backend for _, c, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)}


def transports_of(config) -> set[str]:
    return dispatcher_values(config, "ep_transport")


def dispatcher_values(config, field: str) -> set:
    return {getattr(c, field) for _, c, _, _ in config.model_spec.model.traverse(RoutingDispatcher.Config)}


def write_toml(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# Registry


def test_every_flavor_builds_with_a_description():
    names = {f.name for f in all_flavors()}
    assert names >= FULL_SIZE
    assert {"tiny-moe-grouped-mm", "tiny-moe-for-loop", "tiny-moe-batched-mm-padded"} <= names
    for flavor in all_flavors():
        assert flavor.description and "\n" not in flavor.description
        config = flavor.build()
        assert config.model_spec is not None
        stock_reference = flavor.name.endswith("-torchtitan-moe")
        assert bool(backends_of(config)) is not stock_reference, flavor.name


def test_flavor_build_returns_independent_configs():
    first, second = get_flavor(TINY).build(), get_flavor(TINY).build()
    first.training.steps = 1
    assert second.training.steps != 1


@pytest.mark.parametrize(
    "flavor,total,active",
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9), ("olmoe-1b-7b", 6.9e9, 1.3e9)],
)
def test_full_size_flavors_have_public_parameter_counts(flavor, total, active):
    counted_total, counted_active = parameter_counts(get_flavor(flavor).build_model_config())
    assert counted_total == pytest.approx(total, rel=0.02)
    assert counted_active == pytest.approx(active, rel=0.03)


def test_unknown_flavor_suggests_close_names():
    with pytest.raises(UnknownFlavorError, match="did you mean tiny-moe-grouped-mm"):
        get_flavor("tiny-moe-grouped")


# TOML overrides


def test_backend_switch_is_one_short_key(tmp_path):
    path = write_toml(
        tmp_path,
        "switch.toml",
        """
        [moe]
        compute_backend = "for_loop"
    """,
    )
    config = apply_toml_files(get_flavor(TINY).build(), [path])
    assert backends_of(config) == {"for_loop"}


def test_short_and_full_keys_and_later_files_win(tmp_path):
    first = write_toml(
        tmp_path,
        "a.toml",
        """
        [training]
        steps = 7
        batch_size = 3
        lr = 0.01
        [parallelism]
        ep = 2
        [wandb]
        enable = true
    """,
    )
    second = write_toml(
        tmp_path,
        "b.toml",
        """
        [training]
        steps = 9
        [model.layers.1.moe.router]
        top_k = 1
    """,
    )
    config = apply_toml_files(get_flavor(TINY).build(), [first, second])
    assert config.training.steps == 9
    assert config.training.local_batch_size == 3
    assert config.optimizer.param_groups[0].optimizer_kwargs["lr"] == 0.01
    assert config.parallelism.expert_parallel_degree == 2
    assert config.metrics.enable_wandb is True
    assert config.model_spec.model.layers[1].moe.router.top_k == 1
    assert config.model_spec.model.layers[0].moe.router.top_k == 2


def test_int_is_accepted_for_float_fields():
    config = apply_overrides(get_flavor(TINY).build(), {"training.max_norm": 2, "training.lr": 1})
    assert config.optimizer.param_groups[0].optimizer_kwargs["lr"] == 1.0


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"training.stepz": 3}, "unknown key 'training.stepz'; did you mean training.steps"),
        ({"moe.compute_backnd": "for_loop"}, "did you mean moe.compute_backend"),
        ({"training.steps": "ten"}, "training.steps = 'ten': expected int, got str"),
        ({"training.steps": True}, "expected int, got bool"),
        ({"wandb.enable": 1}, "expected bool, got int"),
        (
            {"moe.compute_backend": "cuda"},
            "not one of the valid choices: 'grouped_mm', 'for_loop', 'batched_mm_padded'",
        ),
        ({"training.dtype": "float16"}, "not one of the valid choices: 'bfloat16', 'float32'"),
        ({"training.lr": -1.0}, "training.lr = -1.0: must be a finite number > 0"),
        ({"training.lr": float("nan")}, "training.lr = nan: must be a finite number > 0"),
        ({"moe.align_size": 2**40}, "moe.align_size = 1099511627776: must be in [1, 2048]"),
        ({"training": 3}, "training is a section, not a value"),
    ],
)
def test_bad_values_are_named(overrides, message):
    """Types are refused when the overrides are applied; ranges by the config checks of the final config."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_config_checks(apply_overrides(get_flavor(TINY).build(), overrides))


def test_a_list_of_values_is_one_key_set_whole(tmp_path):
    """Lists of plain values (compile.components) are set from TOML as lists, and type-checked; only lists
    of config nodes (model.layers) are indexed."""
    toml = tmp_path / "compile.toml"
    toml.write_text('[compile]\ncomponents = ["model"]\n')
    assert apply_toml_files(get_flavor(TINY).build(), [str(toml)]).compile.components == ["model"]
    with pytest.raises(ConfigError, match=re.escape("compile.components = 'model': expected list, got str")):
        apply_overrides(get_flavor(TINY).build(), {"compile.components": "model"})
    with pytest.raises(ConfigError, match=re.escape("unknown key 'compile.components.0'")):
        apply_overrides(get_flavor(TINY).build(), {"compile.components.0": "model"})


def test_nothing_is_half_applied():
    config = get_flavor(TINY).build()
    steps_before = config.training.steps
    with pytest.raises(ConfigError) as error:
        apply_overrides(config, {"training.steps": 5, "moe.compute_backend": "for_loop", "nope": 1})
    assert "nope" in str(error.value)
    assert config.training.steps == steps_before
    assert backends_of(config) == {"grouped_mm"}


def test_all_errors_are_reported_together():
    with pytest.raises(ConfigError) as error:
        apply_overrides(get_flavor(TINY).build(), {"a.b": 1, "training.steps": "x"})
    assert len(str(error.value).splitlines()) == 2


def test_the_value_problems_of_every_toml_file_are_reported_together(tmp_path):
    first = write_toml(tmp_path, "first.toml", '[moe]\ncompute_backend = "for_lop"\n')
    second = write_toml(tmp_path, "second.toml", '[training]\nsteps = "x"\n')
    with pytest.raises(ConfigError) as error:
        apply_toml_files(get_flavor(TINY).build(), [first, second])
    assert [line.split(": ")[0] for line in str(error.value).splitlines()] == [f"{first}:2", f"{second}:2"]


def test_malformed_toml_names_file_and_line(tmp_path):
    path = write_toml(
        tmp_path,
        "broken.toml",
        """
        [training]
        steps = 3
        [moe
    """,
    )
    with pytest.raises(ConfigError, match=r"broken.toml: malformed TOML: .*line 4"):
        load_toml(path)


def test_missing_toml_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read TOML file"):
        load_toml(tmp_path / "absent.toml")


# Entry points


def test_split_project_args():
    flavor, tomls, rest = split_project_args(
        ["--flavor", "x", "--toml=a.toml", "--training.steps", "3", "--toml", "b.toml"]
    )
    assert (flavor, tomls, rest) == ("x", ["a.toml", "b.toml"], ["--training.steps", "3"])
    with pytest.raises(ConfigError, match="--toml needs a value"):
        split_project_args(["--toml"])


def test_cli_beats_toml_beats_flavor(tmp_path):
    path = write_toml(
        tmp_path,
        "o.toml",
        """
        [training]
        steps = 7
        seq_len = 64
    """,
    )
    config = FlavorConfigManager().parse_args(["--flavor", TINY, "--toml", path, "--training.steps", "11"])
    assert config.training.steps == 11
    assert config.training.seq_len == 64
    assert config.training.local_batch_size == get_flavor(TINY).build().training.local_batch_size


def run_module(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_train_bad_input_exits_2_before_building(tmp_path):
    bad = write_toml(
        tmp_path,
        "bad.toml",
        """
        [moe]
        compute_backend = "for_lop"
    """,
    )
    result = run_module("torchtitan_ext.train", "--flavor", TINY, "--toml", bad)
    assert result.returncode == 2
    assert "not one of the valid choices" in result.stderr
    assert "Building" not in result.stderr + result.stdout
    assert "process group" not in (result.stderr + result.stdout).lower()

    result = run_module("torchtitan_ext.train", "--flavor", "mixtral")
    assert result.returncode == 2 and re.search(r"did you mean [^?]*\bmixtral-8x7b", result.stderr)

    result = run_module("torchtitan_ext.train", "--flavor", TINY, "--training.stepz", "3")
    assert result.returncode == 2


def test_train_help_explains_project_options():
    result = run_module("torchtitan_ext.train", "--help")
    assert result.returncode == 0
    for text in ("--flavor", "--toml", "--help-torchtitan", "torchtitan option"):
        assert text in result.stdout


def test_flavors_cli_lists_counts_and_backends(capsys):
    assert flavors_main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["flavor", "total", "active", "compute_backend"]
    qwen = next(line for line in lines if line.startswith("qwen3-30b-a3b"))
    assert "30.53B" in qwen and "3.35B" in qwen and qwen.split()[3] == "triton"


def test_flavors_cli_show_applies_toml(tmp_path, capsys):
    path = write_toml(
        tmp_path,
        "s.toml",
        """
        [moe]
        compute_backend = "batched_mm_padded"
    """,
    )
    assert flavors_main(["--show", TINY, "--toml", path, "--full"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["flavor"] == TINY and shown["toml_files"] == [path]
    experts = shown["model"]["layers"][0]["moe"]["routed_experts"]["inner_experts"]
    assert experts["compute_backend"] == "batched_mm_padded"


def test_flavors_cli_bad_input_exits_2(capsys):
    assert flavors_main(["--show", "nope"]) == 2
    assert "unknown flavor 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("example", sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.toml")))
def test_example_toml_files_apply(example):
    config = apply_toml_files(get_flavor(TINY).build(), [str(example)])
    read_back = {
        "moe.compute_backend": backends_of,
        "moe.expert_precision": lambda c: {
            e.expert_precision for _, e, _, _ in c.model_spec.model.traverse(BackendGroupedExperts.Config)
        },
        "moe.ep_transport": transports_of,
        "moe.ep_receive_rows": lambda c: dispatcher_values(c, "ep_receive_rows"),
        "moe.experts_apply_scores": lambda c: dispatcher_values(c, "experts_apply_scores"),
        "training.disable_cuda_graphs": lambda c: {c.training.disable_cuda_graphs},
        "data.dataset": lambda c: {c.dataloader.dataset},
        "data.path": lambda c: {c.dataloader.dataset_path},
        "data.tokenizer": lambda c: {c.hf_assets_path},
    }
    keys = load_toml(example)
    assert set(keys) <= set(read_back), f"no read-back for {sorted(set(keys) - set(read_back))}"
    for key, value in keys.items():
        assert read_back[key](config) == {value}, key


def test_two_keys_of_one_toml_file_that_set_one_field_are_an_error_naming_both(tmp_path):
    path = write_toml(tmp_path, "both.toml", "[training]\nbatch_size = 4\nlocal_batch_size = 2\n")
    with pytest.raises(ConfigError) as error:
        apply_toml_files(get_flavor(TINY).build(), [path])
    assert str(error.value) == (
        f"{path}:2: training.batch_size = 4 and {path}:3: training.local_batch_size = 2 both set "
        "training.local_batch_size; keep one of them"
    )
    path = write_toml(tmp_path, "moe.toml", "[moe]\ntop_k = 1\n[model.layers.1.moe.router]\ntop_k = 2\n")
    with pytest.raises(ConfigError, match=r"moe\.top_k = 1 and .* model\.layers\.1\.moe\.router\.top_k = 2 both set"):
        apply_toml_files(get_flavor(TINY).build(), [path])


def test_one_layers_top_k_sets_its_router_and_dispatcher(tmp_path):
    """``[model.layers.1.moe.router] top_k = 1`` (the documented per-layer override) changes that layer's
    router and dispatcher, and no other layer; one file setting the two apart is refused."""
    path = write_toml(tmp_path, "layer.toml", "[model.layers.1.moe.router]\ntop_k = 1\n")
    config = FlavorConfigManager().parse_args(["--flavor", TINY, "--toml", path])
    layers = config.model_spec.model.layers
    assert [layer.moe.router.top_k for layer in layers] == [2, 1]
    assert [layer.moe.routed_experts.token_dispatcher.top_k for layer in layers] == [2, 1]
    both = write_toml(
        tmp_path,
        "both.toml",
        "[model.layers.1.moe.router]\ntop_k = 1\n[model.layers.1.moe.routed_experts.token_dispatcher]\ntop_k = 2\n",
    )
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.moe\.router\.top_k = 1 and .* both set"):
        FlavorConfigManager().parse_args(["--flavor", TINY, "--toml", both])


def test_switching_checkpointing_off_selective_refuses_to_drop_a_selective_option(tmp_path):
    path = write_toml(tmp_path, "sac.toml", '[activation_checkpoint]\nforce_recompute_mm_shapes_by_fqns = ["x"]\n')
    with pytest.raises(
        ConfigError,
        match=r"^command line: activation_checkpoint\.mode = 'full' would drop .*sac\.toml:2: "
        r"activation_checkpoint\.force_recompute_mm_shapes_by_fqns = \['x'\], an option of selective",
    ):
        FlavorConfigManager().parse_args(["--flavor", TINY, "--toml", path, "--activation_checkpoint.mode", "full"])
    config = FlavorConfigManager().parse_args(["--flavor", TINY, "--activation_checkpoint.mode", "full"])
    assert type(config.activation_checkpoint).__name__ == "Config"


@pytest.mark.parametrize("where", ["toml", "command line"])
def test_an_option_of_a_section_switched_off_says_so(tmp_path, where):
    key = "activation_checkpoint.preserve_rng_state"
    if where == "toml":
        path = write_toml(tmp_path, "off.toml", '[activation_checkpoint]\nmode = "none"\npreserve_rng_state = false\n')
        args = ["--toml", path]
    else:
        args = ["--activation_checkpoint.mode", "none", f"--{key}", "false"]
    with pytest.raises(ConfigError, match=rf"{key} does not apply: activation_checkpoint is off \(None\)"):
        FlavorConfigManager().parse_args(["--flavor", TINY, *args])
