"""Each fix in ``torchtitan_ext.compat``: the torch/torchtitan behaviour it answers is
still there (so the fix is still needed and still aimed right), and the fix works.

Torch-version fixes are tested on every device; CPU/gloo fixes only without CUDA.
A failure here after a torch or torchtitan upgrade means a fix must be revisited.
"""

import inspect
import os
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchtitan.components.metrics as titan_metrics
import torchtitan.distributed.fsdp as titan_fsdp
import torchtitan.distributed.utils as titan_dist_utils
import torchtitan.tools.utils as titan_utils
from helpers import free_port, model_config, nested_configs, spawn_workers
from torch._functorch import partitioners
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._random import is_rng_supported_mesh
from torch.utils.checkpoint import checkpoint
from torchtitan.components.optimizer import OptimizersContainer, default_adamw, register_moe_load_balancing_hook
from torchtitan.config.configs import ParallelismConfig
from torchtitan.distributed import compile as titan_compile
from torchtitan.models.common.attention import (
    FlexAttention,
    get_causal_mask_mod,
    get_document_mask_mod,
)
from torchtitan.models.common.decoder import Decoder
from torchtitan.protocols.module import Module

from torchtitan_ext.compat import cpu as cpu_support
from torchtitan_ext.compat import torch_versions
from torchtitan_ext.compat.cpu import (
    DocumentCausalSDPA,
    adapt_config_for_cpu,
    document_causal_mask,
    patch_torchtitan_for_cpu,
)
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config
from torchtitan_ext.registry import get_flavor

if TYPE_CHECKING:
    from torchtitan_ext.experiments.moe_backends.dispatcher import EPReceiveRows, EPTransport

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo fixes apply only without CUDA")


@pytest.fixture(scope="module", autouse=True)
def patched():
    torch_versions.apply_torch_version_fixes()
    if not torch.cuda.is_available():
        patch_torchtitan_for_cpu()


# Device type


@cpu_only
def test_torchtitan_still_defaults_device_type_to_cuda():
    assert 'or "cuda"' in inspect.getsource(titan_utils.get_device_info)
    assert titan_utils.get_device_info()[0] == "cuda"


@cpu_only
def test_device_type_is_cpu_everywhere_after_patch():
    for module in (titan_utils, titan_metrics, titan_dist_utils):
        assert module.device_type == "cpu", module.__name__
    from torchtitan.distributed import parallel_dims
    from torchtitan.models.common import token_dispatcher

    assert parallel_dims.device_type == "cpu" and token_dispatcher.device_type == "cpu"
    assert titan_metrics.device_module is cpu_support.CPU_DEVICE_MODULE


@cpu_only
def test_torchtitan_memory_monitor_works_on_cpu():
    monitor = titan_metrics.build_device_memory_monitor()
    stats = monitor.get_peak_stats()
    assert stats.max_active_gib > 0 and stats.num_ooms == 0
    monitor.reset_peak_stats()


# Attention


@cpu_only
def test_document_causal_mask_matches_torchtitan_mask_mods():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    batch, seq_len = positions.shape
    causal, document = get_causal_mask_mod(), get_document_mask_mod(positions)
    head = torch.tensor(0)
    q_idx = torch.arange(seq_len).view(-1, 1)
    kv_idx = torch.arange(seq_len).view(1, -1)
    expected = torch.stack(
        [
            causal(torch.tensor(b), head, q_idx, kv_idx) & document(torch.tensor(b), head, q_idx, kv_idx)
            for b in range(batch)
        ]
    ).unsqueeze(1)
    assert torch.equal(document_causal_mask(positions), expected)


@cpu_only
def test_document_causal_sdpa_forward_and_backward_on_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 9, 4, 8, requires_grad=True) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]] * 2)
    mask = document_causal_mask(positions)
    out = DocumentCausalSDPA.Config().build()(q, k, v, attention_masks=mask)
    scores = torch.einsum("blnh,bmnh->bnlm", q, k) / 8**0.5
    expected = torch.einsum("bnlm,bmnh->blnh", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@cpu_only
def test_decoder_masks_for_cpu_attention():
    config = get_flavor("tiny-moe-grouped-mm").build()
    assert nested_configs(config, FlexAttention.Config)
    adapt_config_for_cpu(config)
    assert not nested_configs(config, FlexAttention.Config)
    model = model_config(config).build()
    positions = torch.tensor([[0, 1, 0, 1, 2]])
    assert torch.equal(model.get_attention_masks(positions), document_causal_mask(positions))
    assert Decoder.get_attention_masks is cpu_support._cpu_attention_masks


# Trainer.Config settings


@cpu_only
def test_adapted_config_uses_settings_torchtitan_accepts():
    config = get_flavor("tiny-moe-for-loop").build()
    adapt_config_for_cpu(config)
    assert config.training.disable_cuda_graphs is True
    assert config.comm.trace_buf_size == 0 and config.comm.train_timeout_seconds == 30
    assert "os.makedirs(dump_dir" in inspect.getsource(titan_dist_utils.init_distributed)
    backends = typing.get_args(typing.get_type_hints(ParallelismConfig)["spmd_backend"])
    assert "partial_dtensor" in backends


# FSDP reductions and process-group timeouts under gloo


def _fsdp_worker(rank: int, world: int, port: int, results) -> None:
    from datetime import timedelta

    from torch.distributed.fsdp import fully_shard

    torch_versions.apply_torch_version_fixes()
    patch_torchtitan_for_cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        reference.load_state_dict(model.state_dict())
        fully_shard(model)
        titan_fsdp.disable_fsdp_gradient_division(model)
        inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        model(inputs[rank]).square().sum().backward()
        for x in inputs:
            reference(x).square().sum().backward()
        # pyrefly: ignore[missing-attribute]  # torch types a module's attributes as Tensor | Module
        grad = model[0].weight.grad.full_tensor()
        # pyrefly: ignore[bad-argument-type]  # torch types a module's attributes as Tensor | Module
        results[rank] = torch.allclose(grad, reference[0].weight.grad, atol=1e-5)

        class OneGroupDims:
            def get_all_one_dimensional_meshes(self):
                return {}

        # pyrefly: ignore[bad-argument-type]  # a stand-in with the one method set_pg_timeouts calls
        titan_dist_utils.set_pg_timeouts(timedelta(seconds=30), OneGroupDims())
    finally:
        dist.destroy_process_group()


def test_torchtitan_fsdp_code_still_needs_the_sum_reduction_fix():
    assert "set_gradient_divide_factor(1.0)" in inspect.getsource(cpu_support._original_disable_division)


def test_torchtitan_set_pg_timeouts_still_calls_set_timeout():
    original = inspect.getsource(torch_versions.original_set_pg_timeouts)
    assert "torch.distributed.set_timeout" in original


def test_set_timeout_fix_applies_exactly_when_torch_lacks_set_timeout():
    lacks = not hasattr(torch.distributed, "set_timeout")
    assert torch_versions.needs_set_timeout_fix() is lacks
    patched = titan_dist_utils.set_pg_timeouts is torch_versions.set_pg_timeouts_per_group
    assert patched is lacks
    if torch.__version__.startswith("2.13."):
        assert lacks, "torch 2.13 gained set_timeout: the fix is no longer needed"


def test_torchtitan_dispatcher_reads_non_strict_tracing():
    from torchtitan.models.common import token_dispatcher

    assert "torch.compiler._is_non_strict_tracing()" in inspect.getsource(token_dispatcher)
    assert callable(torch.compiler._is_non_strict_tracing)


def test_rng_state_order_fix_applies_exactly_when_torch_misorders():
    assert "functionalize_rng_ops(" in inspect.getsource(partitioners.min_cut_rematerialization_partition)
    misorders = torch_versions.needs_rng_state_order_fix()
    patched = partitioners.functionalize_rng_ops is torch_versions.functionalize_rng_ops_before_opaque_objects
    assert patched is misorders
    if torch.__version__.startswith("2.13."):
        assert misorders, "torch 2.13 saves RNG states before opaque objects itself: the fix is no longer needed"


def test_a_torch_without_opaque_objects_in_compiled_graphs_needs_no_rng_state_order_fix(monkeypatch):
    """torch 2.11 (the benchmarks' GPU image) has no ``is_opaque_node``: the module imports and fixes nothing."""
    monkeypatch.delattr(torch_versions.graph_compile, "is_opaque_node")
    assert torch_versions.needs_rng_state_order_fix.__wrapped__() is False


def _mesh_saving_block_worker(rank: int, port: int, results) -> None:
    """A compiled, checkpointed block whose backward needs a DeviceMesh (a DTensor weight's
    ``to_local``) and recomputes attention (a random op on CPU): its gradients unfixed and fixed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        generator = torch.Generator().manual_seed(0)
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8, generator=generator), mesh, [Shard(0)]))
        x = torch.randn(1, 2, 4, 8, generator=generator, requires_grad=True)

        def block(x):
            # pyrefly: ignore[missing-attribute]  # a Parameter of a DTensor is a DTensor at run time
            return F.scaled_dot_product_attention(x, x, x, is_causal=True) @ weight.to_local()

        def gradients(step) -> tuple[torch.Tensor, torch.Tensor]:
            x.grad = weight.grad = None
            step(x).square().sum().backward()
            assert x.grad is not None and isinstance(weight.grad, DTensor)
            return x.grad, weight.grad.to_local()

        def checkpointed(x):
            return checkpoint(block, x, use_reentrant=False)

        expected = gradients(checkpointed)
        try:
            gradients(torch.compile(checkpointed, backend="aot_eager", fullgraph=True))
            results["unfixed"] = "trained"
        except AssertionError as error:
            results["unfixed"] = str(error)
        torch_versions.apply_torch_version_fixes()
        torch._dynamo.reset()
        actual = gradients(torch.compile(checkpointed, backend="aot_eager", fullgraph=True))
        results["fixed"] = all(torch.allclose(a, e, rtol=1e-5, atol=1e-6) for a, e in zip(actual, expected))
    finally:
        dist.destroy_process_group()


def test_compiled_block_saving_a_device_mesh_and_recomputing_attention_trains():
    results = mp.Manager().dict()
    spawn_workers(_mesh_saving_block_worker, 1, free_port(), results)
    if torch_versions.needs_rng_state_order_fix():
        assert "expected all tensors_saved_with_vc_check to be Tensors" in results["unfixed"]
    else:
        assert results["unfixed"] == "trained"
    assert results["fixed"]


def test_torchtitan_expert_bias_update_still_halves_counts_that_its_compile_does_not_double():
    assert torch_versions.needs_expert_bias_count_fix(), "torchtitan no longer halves recomputed counts"
    assert "skip_fwd_side_effects_in_bwd_under_checkpoint = (\n        True" in inspect.getsource(
        titan_compile.apply_compile
    )


class _Block(torch.nn.Module):
    moe_enabled = True

    def __init__(self):
        super().__init__()
        self.moe = moe_layer_config(compute_backend="for_loop", dim=8, hidden_dim=8, num_experts=8, top_k=2).build()

    def forward(self, x):
        return self.moe(x)


def _expert_bias_after_update(tokens_per_expert: list[float], compiled: bool) -> torch.Tensor:
    """torchtitan's expert-bias update of one checkpointed block holding these counts."""
    inner = _Block()
    block = checkpoint_wrapper(inner)
    if compiled:
        block.compile()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": block})
    optimizers = OptimizersContainer(default_adamw(), model_parts=[model])
    no_parallelism = SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda name: None)
    # pyrefly: ignore[bad-argument-type]  # a stand-in with the ParallelDims attributes the hook reads
    register_moe_load_balancing_hook(optimizers, [model], no_parallelism)
    inner.moe.get_buffer("tokens_per_expert_E").copy_(torch.tensor(tokens_per_expert))
    optimizers.step()
    return inner.moe.get_buffer("expert_bias_E").clone()


def test_compiled_checkpointed_block_gets_the_expert_bias_update_of_eager():
    """Eager recomputation counts every token twice, a compiled block once; same update either way."""
    single = [3.0, 1.0, 2.0, 2.0, 5.0, 0.0, 1.0, 2.0]
    eager = _expert_bias_after_update([2 * count for count in single], compiled=False)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        compiled = _expert_bias_after_update(single, compiled=True)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        counted_as_eager = _expert_bias_after_update(single, compiled=True)
    assert torch.equal(compiled, eager)
    assert not torch.equal(counted_as_eager, eager), "torchtitan's update no longer halves: the fix is unneeded"


@cpu_only
def test_fsdp_sum_reductions_and_timeouts_work_with_gloo():
    results = mp.Manager().dict()
    spawn_workers(_fsdp_worker, 2, 2, free_port(), results)
    assert dict(results) == {0: True, 1: True}


# Parameter init of sharded DTensors on a CPU mesh


def test_torchtitan_inits_each_parameter_on_its_dtensor_and_torch_has_no_cpu_dtensor_rng():
    assert "self._init_param(name, param)" in inspect.getsource(Module._init_self_parameters)
    assert "self._param_init[name](param)" in inspect.getsource(cpu_support._original_init_param)
    with pytest.warns(UserWarning, match="DTensor random operators may not have complete support on cpu"):
        # pyrefly: ignore[bad-argument-type]  # a stand-in with the one attribute the check reads
        supported = is_rng_supported_mesh(SimpleNamespace(device_type="cpu"))
    assert not supported, "torch's DTensor RNG supports CPU meshes now: the init fix may be unneeded"


def _trainer_init_worker(rank: int, world: int, expert_parallel_degree: int, port: int, folder: str) -> None:
    """torchtitan's Trainer builds ``tiny-moe-for-loop`` on ``world`` gloo processes; rank 0 saves every
    parameter gathered whole, and whether torch's own ``normal_`` on the router gate (split over
    FSDP) draws the same numbers in every shard."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    torch_versions.apply_torch_version_fixes()
    patch_torchtitan_for_cpu()
    config = get_flavor("tiny-moe-for-loop").build()
    adapt_config_for_cpu(config)
    config.parallelism.expert_parallel_degree = expert_parallel_degree
    config.dump_folder = os.path.join(folder, f"{world}x-ep{expert_parallel_degree}")
    trainer = config.build()
    try:
        params = {
            name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
            for name, param in trainer.model_parts[0].named_parameters()
        }
        gate = next(p for name, p in trainer.model_parts[0].named_parameters() if name.endswith("router.gate.weight"))
        torch.nn.init.normal_(gate)
        torch_init_repeats = repeats_every_shard(gate.full_tensor(), world)
        if rank == 0:
            torch.save((params, torch_init_repeats), os.path.join(folder, f"{world}x-ep{expert_parallel_degree}.pt"))
    finally:
        trainer.close()
        dist.destroy_process_group()


def repeats_every_shard(full: torch.Tensor, shards: int) -> bool:
    """Whether ``full`` split in ``shards`` pieces along dim 0 is one piece repeated."""
    pieces = full.chunk(shards)
    return len(pieces) == shards and all(torch.equal(pieces[0], piece) for piece in pieces[1:])


def trainer_init(folder: Path, world: int, expert_parallel_degree: int) -> tuple[dict[str, torch.Tensor], bool]:
    """What ``_trainer_init_worker`` saves: ``({name: full parameter}, torch's init repeats every shard)``."""
    spawn_workers(_trainer_init_worker, world, world, expert_parallel_degree, free_port(), str(folder))
    return torch.load(folder / f"{world}x-ep{expert_parallel_degree}.pt")


@pytest.fixture(scope="module")
def single_process_init(tmp_path_factory) -> dict[str, torch.Tensor]:
    params, _ = trainer_init(tmp_path_factory.mktemp("init"), 1, 1)
    return params


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel_degree", [2, 4])
def test_trainer_on_four_processes_initialises_every_parameter_as_one_process(
    tmp_path, single_process_init, expert_parallel_degree
):
    """FSDP over 4 ranks for dense weights; experts over EP (and FSDP of 2 ranks at EP=2)."""
    params, torch_init_repeats = trainer_init(tmp_path, 4, expert_parallel_degree)
    assert torch_init_repeats, "torch's DTensor init on a CPU mesh no longer repeats shards: the fix may be unneeded"
    assert params.keys() == single_process_init.keys()
    repeated = [name for name, full in params.items() if full.unique().numel() > 1 and repeats_every_shard(full, 4)]
    assert not repeated, f"parameters repeated in every shard: {repeated}"
    differ = [name for name, full in params.items() if not torch.equal(full, single_process_init[name])]
    assert not differ, f"parameters initialised otherwise than in a single-process run: {differ}"
    assert Module._init_param is cpu_support._init_param_unsharded


@cpu_only
def test_cpu_training_exit_keeps_code_and_flushes_output():
    program = (
        "import logging, sys\n"
        "from torchtitan_ext.compat.cpu import exit_after_cpu_training\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "print('buffered output', end='')\n"
        "logging.getLogger('t').warning('logged')\n"
        "exit_after_cpu_training(3)\n"
        "print('not reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert result.stdout == "buffered output"
    assert "logged" in result.stderr


# torchtitan's CUDA-graph check and dispatchers that say whether they wait for the host


def cuda_graph_config(ep_transport: "EPTransport", receive_rows: "EPReceiveRows"):
    from torchtitan_ext.experiments.moe_backends.dispatcher import RoutingDispatcher

    config = get_flavor("tiny-moe-grouped-mm").build()
    config.training.disable_cuda_graphs = False
    config.parallelism.expert_parallel_degree = 2
    for dispatcher in nested_configs(config, RoutingDispatcher.Config):
        dispatcher.ep_transport, dispatcher.ep_receive_rows = ep_transport, receive_rows
    return config


def test_torchtitan_refuses_cuda_graphs_with_an_ep_dispatcher_it_does_not_know():
    from torchtitan.trainer import Trainer

    from torchtitan_ext.compat import cuda_graph_dispatchers

    with pytest.raises(ValueError, match="CUDA graphs support only expert parallel token dispatcher"):
        cuda_graph_dispatchers.original_validate_cuda_graphs(cuda_graph_config("symm_mem", "static"))
    cuda_graph_dispatchers.apply_cuda_graph_dispatcher_fix()
    assert Trainer.Config._validate_cuda_graphs is cuda_graph_dispatchers.validate_cuda_graphs_with_declared_dispatchers


def test_dispatchers_that_say_whether_they_wait_pass_torchtitans_check_and_others_do_not():
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from torchtitan_ext.compat.cuda_graph_dispatchers import validate_cuda_graphs_with_declared_dispatchers

    validate_cuda_graphs_with_declared_dispatchers(cuda_graph_config("symm_mem", "static"))
    config = cuda_graph_config("all_to_all", "exact")
    moe = model_config(config).layers[0].moe
    moe.routed_experts.token_dispatcher = AllToAllTokenDispatcher.Config(num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="CUDA graphs support only expert parallel token dispatcher"):
        validate_cuda_graphs_with_declared_dispatchers(config)


# What the train entry says and waits for (every device)


def test_torchtitan_still_logs_its_version_first_and_waits_for_other_ranks():
    import torchtitan.train as titan_train
    from torchtitan.trainer import Trainer

    main_source = inspect.getsource(titan_train.main)
    assert main_source.index('"torchtitan version: %s') < main_source.index("config_manager.parse_args()")
    train_source = inspect.getsource(Trainer.train)
    assert 'logger.info("Sleeping 2 seconds for other ranks to complete")' in train_source
    assert "time.sleep(2)" in train_source


@pytest.mark.parametrize("world", ["1", "2"])
def test_run_noise_drops_the_version_line_and_the_wait_of_a_run_of_one(monkeypatch, caplog, world):
    import logging
    import time

    import torchtitan.trainer as titan_trainer
    from torchtitan.tools.logging import logger

    from torchtitan_ext.compat.run_noise import quiet_run_noise

    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(titan_trainer, "time", time)
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    caplog.set_level(logging.INFO)
    quiet_run_noise()
    quiet_run_noise()
    logger.info("torchtitan version: %s (0.0.0 means __version__ is not defined correctly).", "0.3.0")
    logger.info("Sleeping 2 seconds for other ranks to complete")
    titan_trainer.time.sleep(2)
    assert titan_trainer.time.perf_counter() > 0
    waits = world != "1"
    assert [r.getMessage() for r in caplog.records] == ["Sleeping 2 seconds for other ranks to complete"] * waits
    assert slept == [2] * waits


def test_a_resumed_schedule_warns_nothing(monkeypatch):
    import warnings

    import torchtitan.trainer as titan_trainer
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.tools.logging import logger

    from torchtitan_ext.compat.run_noise import quiet_run_noise

    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(titan_trainer, "time", titan_trainer.time)

    assert "scheduler.get_lr()" in inspect.getsource(LRSchedulersContainer.load_state_dict)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        scheduler.get_lr()
        assert len(recorded) == 1  # torch still warns where torchtitan calls it
        quiet_run_noise()
        scheduler.get_lr()
    assert len(recorded) == 1


def test_torchtitans_pipeline_step_hands_torch_microbatches_its_schedule_does_not_take():
    """torchtitan 0.3.0 passes ``PipelineSchedule.step`` its microbatches (``arg_mbs=``); torch 2.13's
    ``step`` takes the whole batch. When a torch takes microbatches, the fix must go (this fails)."""
    assert "arg_mbs=" in inspect.getsource(torch_versions.original_pp_forward_backward_step())
    assert "arg_mbs" not in inspect.signature(PipelineScheduleSingle.step).parameters
    assert torch_versions.needs_pipeline_step_fix()


def test_the_pipeline_fix_joins_microbatch_inputs_the_schedule_splits_back():
    first, second = torch.arange(6).view(2, 3), torch.arange(6, 12).view(2, 3)
    joined = torch_versions._joined([first, second], "positions")
    assert joined is not None and torch.equal(joined, torch.cat([first, second]))
    assert [torch.equal(a, b) for a, b in zip(joined.tensor_split(2), (first, second), strict=True)] == [True, True]
    assert torch_versions._joined([None, None], "mask") is None
    with pytest.raises(NotImplementedError, match="'mask' differs between microbatches"):
        torch_versions._joined([None, first], "mask")
