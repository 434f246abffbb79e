"""Which torchtitan Trainer features the project's MoE flavors accept at start-up: compile for every
backend, CUDA graphs only where nothing is read on the host (and the reason where something is)."""

import logging

import pytest
import torch

from torchtitan_ext.config import ConfigError
from torchtitan_ext.experiments.moe_backends.experts import backend_names
from torchtitan_ext.experiments.moe_backends.flavors import tiny_flavor_name
from torchtitan_ext.experiments.moe_backends.layer import routing_dispatchers
from torchtitan_ext.run_training import FlavorConfigManager

CUDA_GRAPHS = "--training.no-disable-cuda-graphs"


def parse(monkeypatch, *args: str, world: int = 1):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return FlavorConfigManager().parse_args([*args, "--training.steps", "1"])


@pytest.mark.parametrize("flavor", [*(tiny_flavor_name(b) for b in backend_names()), "tiny-torchtitan-moe"])
def test_compile_is_accepted_for_every_backend(monkeypatch, flavor):
    config = parse(monkeypatch, "--flavor", flavor, "--compile.enable")
    assert config.compile.enable and "model" in config.compile.components


@pytest.mark.parametrize("backend", ["for_loop", "batched_mm_padded"])
def test_cuda_graphs_refused_for_backends_that_read_counts_on_the_host(monkeypatch, backend):
    with pytest.raises(ConfigError, match=f"compute_backend {backend} reads expert counts on the host"):
        parse(monkeypatch, "--flavor", tiny_flavor_name(backend), CUDA_GRAPHS)


def test_cuda_graphs_under_ep_need_a_sync_free_dispatch(monkeypatch):
    """Static received rows make either EP transport read nothing on the host: exact rows are refused
    under CUDA graphs, and "auto" (the default) picks static rows there."""
    flavor = ["--flavor", "tiny-moe-triton", "--parallelism.ep", "2", CUDA_GRAPHS]
    for transport in ("all_to_all", "symm_mem"):
        with pytest.raises(ConfigError, match=r"row counts on the host \(set moe\.ep_receive_rows = 'static'\)"):
            parse(monkeypatch, *flavor, "--moe.ep_transport", transport, "--moe.ep_receive_rows", "exact", world=2)
        config = parse(monkeypatch, *flavor, "--moe.ep_transport", transport, world=2)
        assert {dispatcher.ep_receive_rows for dispatcher in routing_dispatchers(config)} == {"static"}


def test_cuda_graphs_accepted_without_ep_for_backends_that_never_wait(monkeypatch):
    parse(monkeypatch, "--flavor", "tiny-moe-triton", CUDA_GRAPHS)
    parse(monkeypatch, "--flavor", "tiny-moe-grouped-mm", "--training.mixed_precision_param", "bfloat16", CUDA_GRAPHS)


def test_cuda_graphs_refuse_grouped_mm_where_torch_reads_its_offsets_on_the_host(monkeypatch):
    """torch._grouped_mm runs group by group from offsets copied to the host outside bf16 and off
    Hopper / Blackwell: a capture would fail mid-step, so the start-up check says why first."""
    host_read = r"compute_backend grouped_mm in float32( on compute capability \d+\.\d+)?: torch._grouped_mm reads"
    with pytest.raises(ConfigError, match=host_read):
        parse(monkeypatch, "--flavor", "tiny-moe-grouped-mm", CUDA_GRAPHS)
    bf16 = ["--flavor", "tiny-moe-grouped-mm", "--training.mixed_precision_param", "bfloat16", CUDA_GRAPHS]
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(
        ConfigError, match=r"grouped_mm in bfloat16 on compute capability 8\.0: torch._grouped_mm reads its group"
    ):
        parse(monkeypatch, *bf16)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: (9, 0))
    parse(monkeypatch, *bf16)


def test_cuda_graphs_refuse_fp8_experts_where_their_gemms_read_offsets_on_the_host(monkeypatch):
    """The FP8 experts' weight gradients run torch._grouped_mm in the activations' dtype, and the emulated
    FP8 GEMMs in fp32: both read the group offsets on the host there, which a capture cannot replay."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: (9, 0))
    fp8 = ["--flavor", "tiny-moe-triton", "--moe.expert_precision", "fp8_rowwise", CUDA_GRAPHS]
    with pytest.raises(ConfigError, match=r"FP8 weight gradients in float32 on compute capability 9\.0: torch"):
        parse(monkeypatch, *fp8)
    bf16 = ["--training.mixed_precision_param", "bfloat16"]
    parse(monkeypatch, *fp8, *bf16)
    emulated = ["--flavor", "tiny-moe-triton", "--moe.expert_precision", "fp8_rowwise_emulated", CUDA_GRAPHS, *bf16]
    with pytest.raises(ConfigError, match="expert_precision fp8_rowwise_emulated computes its GEMMs with"):
        parse(monkeypatch, *emulated)


def test_the_start_up_line_names_static_received_rows(monkeypatch, caplog):
    """On a host without CUDA (on a GPU host "auto" picks symm_mem and logs its receive rows' choice)."""
    import logging

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO):
        parse(monkeypatch, "--flavor", "tiny-moe-triton", "--parallelism.ep", "2", world=2)
    assert "ep_transport=all_to_all, compile" in caplog.text and "ep_receive_rows" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        parse(
            monkeypatch,
            "--flavor",
            "tiny-moe-triton",
            "--parallelism.ep",
            "2",
            "--moe.ep_receive_rows",
            "static",
            world=2,
        )
    assert "ep_transport=all_to_all, ep_receive_rows=static, compile" in caplog.text


def test_static_receive_rows_need_groups_without_padding(monkeypatch):
    parse(monkeypatch, "--flavor", "tiny-moe-grouped-mm", "--moe.ep_receive_rows", "static")
    with pytest.raises(ConfigError, match="ep_receive_rows = 'static' needs align_size = 1"):
        parse(
            monkeypatch,
            "--flavor",
            "tiny-moe-grouped-mm",
            "--moe.ep_transport",
            "symm_mem",
            "--moe.ep_receive_rows",
            "static",
            "--moe.align_size",
            "8",
        )


def test_full_size_defaults_switch_off_and_the_start_up_line_says_so(monkeypatch, caplog):
    """olmoe-1b-7b compiles and computes in triton unless the command line says otherwise (and, on one
    NVIDIA GPU, replays its compiled step as a CUDA graph); the start-up line names what the run does."""
    import logging

    import torchtitan_ext.model_size

    monkeypatch.setattr(torchtitan_ext.model_size, "machine_memory_bytes", lambda: 2**50)
    with caplog.at_level(logging.INFO):
        config = parse(monkeypatch, "--flavor", "olmoe-1b-7b")
    assert config.compile.enable
    graphs = "on" if torch.cuda.is_available() and torch.version.hip is None else "off"  # one NVIDIA GPU: on
    assert (
        f"flavor olmoe-1b-7b: compute_backend=triton, expert_parallel_degree=1, compile=on, cuda_graphs={graphs}"
        in (caplog.text)
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        config = parse(
            monkeypatch, "--flavor", "olmoe-1b-7b", "--compile.no-enable", "--moe.compute_backend", "grouped_mm"
        )
    assert not config.compile.enable
    assert "compute_backend=grouped_mm, expert_parallel_degree=1, compile=off, cuda_graphs=off" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        parse(monkeypatch, "--flavor", "tiny-moe-grouped-mm", "--compile.enable", "--compile.components", "loss")
    assert "expert_parallel_degree=1, compile=loss only, cuda_graphs=off" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA graphs asked for on a machine without CUDA")
def test_the_start_up_line_says_cuda_graphs_stay_off_on_cpu(monkeypatch, caplog):
    """On CPU the run turns CUDA graphs off whatever was asked; the start-up line must not say on."""
    import logging

    with caplog.at_level(logging.INFO):
        parse(monkeypatch, "--flavor", "tiny-moe-triton", CUDA_GRAPHS)
    assert "cuda_graphs=off (no CUDA device" in caplog.text and "cuda_graphs=on" not in caplog.text


def test_experts_apply_scores_needs_a_backend_and_transport_that_can(monkeypatch, caplog):
    """Under EP the start-up check refuses the switch with the reason where the backend (after "auto")
    or the transport cannot apply it, and names it in the start-up line where it is on."""
    on = ["--moe.experts_apply_scores", "true", "--parallelism.ep", "2"]
    with pytest.raises(ConfigError, match=r"experts_apply_scores = true: compute_backend 'for_loop' with "):
        parse(monkeypatch, "--flavor", "tiny-moe-grouped-mm", "--moe.compute_backend", "for_loop", *on, world=2)
    fp8 = ["--moe.expert_precision", "fp8_rowwise_emulated"]
    for flavor in ("tiny-moe-grouped-mm", "tiny-moe-triton"):
        parse(monkeypatch, "--flavor", flavor, *on, world=2)
        parse(monkeypatch, "--flavor", flavor, *fp8, *on, world=2)
    padded = ["--moe.ep_transport", "symm_mem", "--moe.align_size", "4"]
    with pytest.raises(ConfigError, match=r"symm_mem transport pads its expert groups \(align_size = 4\)"):
        parse(monkeypatch, "--flavor", "tiny-moe-triton", *padded, *on, world=2)
    with caplog.at_level(logging.INFO):
        parse(monkeypatch, "--flavor", "tiny-moe-triton", "--moe.ep_transport", "all_to_all", *on, world=2)
    assert "ep_transport=all_to_all, experts_apply_scores=True" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA-graph refusal of fp32 grouped_mm on CPU")
def test_the_cuda_graph_refusal_names_where_cuda_graphs_were_turned_on(monkeypatch):
    args = ["--flavor", "tiny-moe-grouped-mm", "--parallelism.expert_parallel_degree", "2"]
    with pytest.raises(
        ConfigError, match=r"cuda_graphs\.toml:\d+: training\.disable_cuda_graphs = false: a CUDA graph cannot replay"
    ):
        parse(monkeypatch, *args, "--toml", "examples/cuda_graphs.toml", world=2)
