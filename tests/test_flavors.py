"""The flavors CLI: a cached listing that imports neither torch nor torchtitan, and the
concise and full views of one flavor."""

import json
import os
import subprocess
import sys

import pytest
from helpers import model_config, nested_configs
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from torchtitan_ext import command_facts, flavors
from torchtitan_ext.experiments.moe_backends import flavors as moe_backends_flavors
from torchtitan_ext.experiments.moe_backends.cache import CACHE_ENV
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts, backend_names
from torchtitan_ext.experiments.moe_backends.flavors import tiny_flavor_name
from torchtitan_ext.flavors import main
from torchtitan_ext.model_size import parameter_counts
from torchtitan_ext.registry import all_flavors, get_flavor

TINY = "tiny-moe-grouped-mm"


def test_cached_listing_imports_neither_torch_nor_torchtitan(capsys):
    assert main([]) == 0  # fills the listing cache of this test session
    listing = capsys.readouterr().out
    probe = (
        "import sys\n"
        "from torchtitan_ext.flavors import main\n"
        "main([])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchtitan'))\n"
        "print('heavy modules:', heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=os.environ.copy()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("heavy modules: []\n")
    assert result.stdout.removesuffix("heavy modules: []\n") == listing


def test_listing_cache_follows_the_sources(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    builds = []
    monkeypatch.setattr(flavors, "listing_rows", lambda: builds.append(1) or [["f", "1", "1", "b", "d"]])
    monkeypatch.setattr(command_facts, "source_fingerprint", lambda: "sources v1")
    assert flavors.cached_listing_rows() == [["f", "1", "1", "b", "d"]]
    assert flavors.cached_listing_rows() == [["f", "1", "1", "b", "d"]] and len(builds) == 1
    monkeypatch.setattr(command_facts, "source_fingerprint", lambda: "sources v2")
    flavors.cached_listing_rows()
    assert len(builds) == 2
    (tmp_path / flavors.LISTING_CACHE_NAME).write_text("not json")
    flavors.cached_listing_rows()
    assert len(builds) == 3


def test_fingerprint_changes_with_any_source_file(tmp_path):
    module = tmp_path / "package" / "module.py"
    module.parent.mkdir()
    module.write_text("A = 1\n")
    first = command_facts.files_fingerprint([tmp_path], "torch 2.13")
    assert command_facts.files_fingerprint([tmp_path], "torch 2.13") == first
    assert command_facts.files_fingerprint([tmp_path], "torch 2.14") != first
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert command_facts.files_fingerprint([tmp_path], "torch 2.13") != first
    (tmp_path / "new_experiment.py").write_text("")
    assert len({first, command_facts.files_fingerprint([tmp_path], "torch 2.13")}) == 2


def test_show_is_concise_and_applies_toml(tmp_path, capsys):
    toml = tmp_path / "s.toml"
    toml.write_text('[moe]\ncompute_backend = "batched_mm_padded"\n[training]\nsteps = 7\n[data]\nworkers = 1\n')
    assert main(["--show", TINY, "--toml", str(toml)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{TINY}  (TOML files: {toml})"
    assert len(lines) <= 12 and "0x" not in "\n".join(lines)
    assert any("2 x (8 experts, top-2" in line and "compute_backend batched_mm_padded" in line for line in lines)
    assert any(line.split()[:3] == ["training", "steps", "7,"] for line in lines)
    (data,) = [line for line in lines if line.split()[0] == "data"]
    assert data.endswith("; workers 1 (loading batches ahead of the step)")
    assert lines[-1] == f"every field: python -m torchtitan_ext.flavors --show {TINY} --toml {toml} --full"


@pytest.mark.parametrize(
    "flavor, toml_text, says",
    [
        ("olmoe-1b-7b", "", "; routed experts outside FSDP where each lives on one rank (moe.experts_fsdp auto)"),
        (
            "olmoe-1b-7b",
            '[moe]\nexperts_fsdp = "always"\n',
            "; routed experts in FSDP on every layout (torchtitan's way)",
        ),
        ("olmoe-1b-7b-torchtitan-moe", "", "; routed experts in FSDP on every layout (torchtitan's way)"),
        ("tiny-deepseek-v3", "", "(moe.experts_fsdp auto acts on Qwen3-parallelized models)"),
    ],
)
def test_show_says_where_fsdp_wraps_the_routed_experts(flavor, toml_text, says, tmp_path, capsys):
    toml = tmp_path / "s.toml"
    toml.write_text(toml_text)
    assert main(["--show", flavor, "--toml", str(toml)]) == 0
    (parallelism,) = [line for line in capsys.readouterr().out.splitlines() if line.split()[0] == "parallelism"]
    assert parallelism.endswith(says), parallelism


def test_show_full_is_json_with_readable_functions(capsys):
    assert main(["--show", TINY, "--full"]) == 0
    out = capsys.readouterr().out
    shown = json.loads(out)
    assert shown["flavor"] == TINY and shown["training"]["steps"] > 0
    assert "0x" not in out and "<function" not in out
    assert shown["model"]["tok_embeddings"]["param_init"]["weight"] == "normal_(std=0.02)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--full"], "--full only applies together with --show NAME"),
        (["--toml", "x.toml"], "--toml only applies together with --show NAME"),
    ],
)
def test_flags_without_show_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_one_tiny_flavor_per_backend_of_the_table():
    """A backend added to the table without its tiny flavor (``flavors.py``) fails here."""
    tiny = {flavor.name: flavor for flavor in all_flavors() if flavor.name.startswith("tiny-moe-")}
    assert sorted(tiny) == sorted(tiny_flavor_name(backend) for backend in backend_names())
    for backend in backend_names():
        build = tiny[tiny_flavor_name(backend)].build
        assert build.__name__ == f"tiny_moe_{backend}"
        assert getattr(moe_backends_flavors, build.__name__) is build  # torchtitan's --config finds it
        experts = nested_configs(build(), BackendGroupedExperts.Config)
        assert {e.compute_backend for e in experts} == {backend}


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v3-16b"])
def test_stock_sibling_is_the_same_model_with_torchtitans_moe(name):
    """``<name>-torchtitan-moe``, the stock reference of the GPU runs, has the flavor's parameters and
    training settings, and none of this project's experts."""
    flavor, stock = get_flavor(name).build(), get_flavor(f"{name}-torchtitan-moe").build()
    assert nested_configs(flavor, BackendGroupedExperts.Config)
    assert not nested_configs(stock, BackendGroupedExperts.Config)
    assert parameter_counts(model_config(stock)) == parameter_counts(model_config(flavor))
    assert (
        stock.training,
        stock.optimizer,
        stock.lr_scheduler,
        stock.parallelism,
        stock.compile,
        stock.dataloader,
    ) == (
        flavor.training,
        flavor.optimizer,
        flavor.lr_scheduler,
        flavor.parallelism,
        flavor.compile,
        flavor.dataloader,
    )


FULL_SIZE_FLAVORS = ["qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b", "deepseek-v3-16b"]
STOCK_SIBLINGS = ["qwen3-30b-a3b-torchtitan-moe", "olmoe-1b-7b-torchtitan-moe", "deepseek-v3-16b-torchtitan-moe"]


@pytest.mark.parametrize("name", FULL_SIZE_FLAVORS + STOCK_SIBLINGS)
def test_full_size_flavors_compile_and_the_projects_compute_in_triton(name):
    """Full-size flavors compile as torchtitan's ``--compile.enable`` does (its default components),
    without CUDA graphs; the project's compute in triton, the stock siblings in torchtitan's layers."""
    config = get_flavor(name).build()
    assert config.compile.enable and config.compile.components == ["model", "loss"]
    assert config.compile.backend == "inductor" and config.training.disable_cuda_graphs
    backends = {experts.compute_backend for experts in nested_configs(config, BackendGroupedExperts.Config)}
    assert backends == (set() if name.endswith("-torchtitan-moe") else {"triton"})


def test_tiny_flavors_run_eager():
    tiny = [flavor for flavor in all_flavors() if flavor.name.startswith("tiny-")]
    assert len(tiny) >= len(backend_names()) + 5  # one per backend, the stock one, one per family
    assert not any(flavor.build().compile.enable for flavor in tiny)


def test_full_size_flavors_load_batches_in_one_worker_process_and_tiny_ones_in_the_training_process():
    """One worker loads the next batch while the GPU runs the step (torchtitan's text dataset gives
    every worker the whole stream, so more would repeat batches); the tiny CPU runs load their own."""
    loaders = {flavor.name: flavor.build().dataloader for flavor in all_flavors()}
    assert all(isinstance(loader, HuggingFaceTextDataLoader.Config) for loader in loaders.values())
    workers = {
        name: loader.num_workers
        for name, loader in loaders.items()
        if isinstance(loader, HuggingFaceTextDataLoader.Config)
    }
    assert {workers[name] for name in FULL_SIZE_FLAVORS + STOCK_SIBLINGS} == {1}
    assert {count for name, count in workers.items() if name.startswith("tiny-")} == {0}


def test_show_tells_whether_a_flavor_compiles(capsys, tmp_path):
    assert main(["--show", "olmoe-1b-7b"]) == 0
    (training,) = [line for line in capsys.readouterr().out.splitlines() if line.split()[0] == "training"]
    assert training.endswith(
        "params in bfloat16, compile on, activation_checkpoint selective, cuda_graphs off (on under expert "
        "parallelism where moe.ep_receive_rows = 'auto' picks static rows)"
    ), training
    exact_rows = tmp_path / "exact_rows.toml"
    exact_rows.write_text('[moe]\nep_receive_rows = "exact"\n')
    assert main(["--show", TINY, "--toml", str(exact_rows), "--toml", str(bf16(tmp_path))]) == 0
    assert "compile off, activation_checkpoint selective, cuda_graphs off\n" in capsys.readouterr().out


def bf16(tmp_path):
    """A TOML file giving the parameters in bfloat16 (fp32 grouped_mm reads its offsets on the host)."""
    path = tmp_path / "bf16.toml"
    path.write_text('[training]\nmixed_precision_param = "bfloat16"\n')
    return path


def test_show_says_what_keeps_cuda_graphs_off_whatever_the_parallelism(capsys, tmp_path):
    full_ac = tmp_path / "full_ac.toml"
    full_ac.write_text('[activation_checkpoint]\nmode = "full"\n')
    assert main(["--show", "tiny-moe-for-loop", "--toml", str(full_ac)]) == 0
    (training,) = [line for line in capsys.readouterr().out.splitlines() if line.split()[0] == "training"]
    assert "activation_checkpoint full, cuda_graphs off (compute_backend for_loop reads expert counts on the host" in (
        training
    )
