"""Compiled training equals eager training, compiled as torchtitan compiles: ``--compile.enable``
(``apply_compile``: each block ``torch.compile(fullgraph=True)``) under the flavors' selective
activation checkpointing (and one case under full checkpointing), in fp32.

Training (through the train entry, five steps, at expert parallel degree 1 and 2 over gloo with the
``all_to_all`` transport): the tiny flavor of every backend but ``triton`` (below) and of every
model family, the stock flavor (torchtitan's own MoE layers), ``grouped_mm`` under full
checkpointing, and FP8 rowwise experts (``fp8_rowwise_emulated``), each compiled by Inductor
(torchtitan's default ``compile.backend``), data-dependent sizes of ``for_loop`` and
``batched_mm_padded`` included: losses within rel 1e-4 of eager's and the MoE metrics of the
observer equal to eager's. The ``symm_mem`` transport is not covered here.

``triton`` runs Triton's interpreter on CPU, about 50 s a training step at these shapes, so it is
compiled at the layer level instead: one MoE layer as a block under torchtitan's selective
checkpointing and ``apply_compile`` (Inductor), at EP 1 and at EP 2 over both transports with
``experts_apply_scores`` (its experts weight their rows and the transport sums them unweighted); its
kernels' entry points are compiled in ``tests/test_kernel_ops.py``. ``grouped_mm``'s block with
``experts_apply_scores`` (the down projection's input rows weighted) is compiled the same way at EP 2
over ``all_to_all``.
"""

import os
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from helpers import free_port, gloo_ep_mesh, spawn_workers
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config.configs import CompileConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.distributed.compile import apply_compile

from torchtitan_ext.compat.torch_versions import apply_torch_version_fixes
from torchtitan_ext.experiments.moe_backends.activation_checkpoint import MoESelectiveAC
from torchtitan_ext.experiments.moe_backends.dispatcher import EPTransport, RoutingDispatcher
from torchtitan_ext.experiments.moe_backends.ep_check import local_expert_slice, seeded_layer, shard_experts
from torchtitan_ext.experiments.moe_backends.experts import backend_names
from torchtitan_ext.experiments.moe_backends.flavors import TINY_HF_FLAVORS, tiny_flavor_name
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config
from torchtitan_ext.kernels.fused_moe import triton_available_reason
from torchtitan_ext.metrics.observer import MoERoutingObserver, summarize
from torchtitan_ext.metrics.processor import MoEMetricsProcessor
from torchtitan_ext.run_training import FlavorConfigManager
from torchtitan_ext.train import main

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo, fp32 runs")

STEPS = 5
FP8_CASE = "tiny-moe-grouped-mm-fp8"
FULL_AC_CASE = "tiny-moe-grouped-mm-full-ac"
CASE_ARGS = {
    **{tiny_flavor_name(b): ["--flavor", tiny_flavor_name(b)] for b in backend_names() if b != "triton"},
    **{flavor: ["--flavor", flavor] for flavor in TINY_HF_FLAVORS},
    "tiny-torchtitan-moe": ["--flavor", "tiny-torchtitan-moe"],
    FP8_CASE: ["--flavor", "tiny-moe-grouped-mm", "--moe.expert_precision", "fp8_rowwise_emulated"],
    FULL_AC_CASE: ["--flavor", "tiny-moe-grouped-mm"],
}
"""Each case trained eager and compiled: a flavor of every backend of the table but ``triton``
(below), the tiny flavor of every model family (Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3 with MLA,
shared experts and sigmoid routing with a correction bias; ``grouped_mm``), the stock flavor, FP8
rowwise experts (emulated in fp32), and ``grouped_mm`` under full checkpointing (``SUBCOMMANDS``)."""
SUBCOMMANDS = {FULL_AC_CASE: ["activation-checkpoint:full"]}
"""torchtitan's subcommands of a case, given after every option."""
ROUTING_MAY_DRIFT = {"tiny-torchtitan-moe"}
"""torchtitan's experts compute in bf16 even with fp32 parameters; Inductor's fused kernels round
them differently, so after the first update a token near a routing tie may go to another expert:
past step 1 only the routed totals are compared (each forward counted once)."""
MODES = ("eager", "compiled")


def train_args(case: str, mode: str, ep: int, dump_folder: str) -> list[str]:
    args = [*CASE_ARGS[case], "--parallelism.expert_parallel_degree", str(ep), "--training.steps", str(STEPS)]
    args += ["--training.seq_len", "32", "--training.local_batch_size", "2", "--dump_folder", dump_folder]
    if mode == "compiled":
        args += ["--compile.enable"]
    return args + SUBCOMMANDS.get(case, [])


def record_steps(steps: list) -> None:
    """Append ``(step, loss, MoE scalars)`` to ``steps`` at every step the metrics processor logs."""
    collect = MoEMetricsProcessor.collect_moe_metrics
    log = MoEMetricsProcessor.log
    scalars_of_step = {}

    def collect_and_keep(self, step):
        scalars, rich = collect(self, step)
        scalars_of_step[step] = scalars
        return scalars, rich

    def log_and_keep(self, step, global_avg_loss, *args, **kwargs):
        log(self, step, global_avg_loss, *args, **kwargs)
        steps.append((step, global_avg_loss, scalars_of_step.pop(step)))

    MoEMetricsProcessor.collect_moe_metrics = collect_and_keep
    MoEMetricsProcessor.log = log_and_keep


def record_checkpointing(kinds: list) -> None:
    """Append the activation-checkpointing config class of every config the train entry parses to
    ``kinds`` (``FullAC.Config``, ``MoESelectiveAC.Config``, ...)."""
    parse_args = FlavorConfigManager.parse_args

    def parse_and_keep(self, args=None):
        config = parse_args(self, args)
        kinds.append(type(config.activation_checkpoint).__qualname__)
        return config

    FlavorConfigManager.parse_args = parse_and_keep


def agreed_port(rank: int, shared, run: int) -> int:
    """The rendezvous port of run ``run``: rank 0 picks a free one just before the run and shares it
    (picked minutes ahead, a port could meanwhile be taken by another test's rendezvous, whose ranks
    would then meet these), the others wait for it."""
    key = ("port", run)
    if rank == 0:
        shared[key] = free_port()
    while key not in shared:
        time.sleep(0.05)
    return shared[key]


def _train_cases_worker(rank: int, world: int, dump_folder: str, results) -> None:
    """Rank ``rank`` of ``world``: every case, eager then compiled; rank 0 keeps each run's steps."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    steps, checkpointing = [], []
    record_steps(steps)
    record_checkpointing(checkpointing)
    runs = [(case, mode) for case in CASE_ARGS for mode in MODES]
    for run, (case, mode) in enumerate(runs):
        os.environ["MASTER_PORT"] = str(agreed_port(rank, results, run))
        torch._dynamo.reset()
        steps.clear()
        checkpointing.clear()
        exit_code = main(train_args(case, mode, world, os.path.join(dump_folder, f"{case}-{mode}")))
        if rank == 0:
            results[(case, mode)] = (exit_code, list(steps), list(checkpointing))


def train_every_case(world: int, dump_folder) -> dict:
    """Each process trains every case in turn (one import of torch and torchtitan for all)."""
    results = mp.Manager().dict()
    spawn_workers(_train_cases_worker, world, world, str(dump_folder), results)
    return dict(results)


def assert_compiled_trains_like_eager(results: dict) -> None:
    for case in CASE_ARGS:
        (eager_code, eager, eager_ac), (compiled_code, compiled, compiled_ac) = (results[case, mode] for mode in MODES)
        assert eager_code == compiled_code == 0, case
        assert eager_ac == compiled_ac == ["FullAC.Config" if case == FULL_AC_CASE else "MoESelectiveAC.Config"], case
        assert [s for s, _, _ in compiled] == [s for s, _, _ in eager] == list(range(1, STEPS + 1)), case
        for (step, eager_loss, eager_scalars), (_, loss, scalars) in zip(eager, compiled):
            assert loss == pytest.approx(eager_loss, rel=1e-4), (case, step)
            assert scalars.keys() == eager_scalars.keys(), (case, step)
            compared = eager_scalars
            if case in ROUTING_MAY_DRIFT and step > 1:
                compared = {key: value for key, value in eager_scalars.items() if key.endswith("/routed_tokens")}
            for key, value in compared.items():
                assert scalars[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (case, step, key)


@pytest.mark.slow
def test_compiled_training_equals_eager_with_ep1(tmp_path):
    assert_compiled_trains_like_eager(train_every_case(1, tmp_path))


@pytest.mark.slow
def test_compiled_training_equals_eager_with_ep2(tmp_path):
    assert_compiled_trains_like_eager(train_every_case(2, tmp_path))


# The triton backend, at the layer level

LAYER_SHAPE = dict(dim=16, hidden_dim=24, num_experts=4, top_k=2)


class MoEBlock(torch.nn.Module):
    """A residual MoE layer: the block torchtitan checkpoints and compiles."""

    moe_enabled = True

    def __init__(
        self, compute_backend: str, ep_mesh: DeviceMesh | None = None, ep_transport: EPTransport = "all_to_all"
    ):
        super().__init__()
        config = moe_layer_config(compute_backend=compute_backend, **LAYER_SHAPE)
        dispatcher = config.routed_experts.token_dispatcher
        assert isinstance(dispatcher, RoutingDispatcher.Config)
        dispatcher.ep_transport = ep_transport
        dispatcher.experts_apply_scores = ep_mesh is not None
        self.moe = seeded_layer(config)
        if ep_mesh is not None:
            shard_experts(self.moe, local_expert_slice(LAYER_SHAPE["num_experts"], ep_mesh))
            self.moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return x_BLD + self.moe(x_BLD)


def block_step(
    compute_backend: str,
    compile_backend: str | None,
    ep_mesh: DeviceMesh | None = None,
    ep_transport: EPTransport = "all_to_all",
) -> tuple:
    """One forward and backward of the block under selective checkpointing (torchtitan's, or the
    flavors' ``MoESelectiveAC`` under EP; compiled by ``apply_compile`` unless ``compile_backend`` is
    None): output, gradients, observer summary. Under EP each rank feeds its own tokens."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": MoEBlock(compute_backend, ep_mesh, ep_transport)})
    checkpointing = SelectiveAC.Config() if ep_mesh is None else MoESelectiveAC.Config()
    checkpointing.build().apply(model)
    if compile_backend is not None:
        config = CompileConfig(enable=True, backend=compile_backend)
        # pyrefly: ignore[bad-argument-type]  # a stand-in with the ParallelDims attribute apply_compile reads
        apply_compile(model, compile_config=config, parallel_dims=SimpleNamespace(tp_enabled=False))
    observer = MoERoutingObserver([model], expert_parallel=None)
    seed = 1 if ep_mesh is None else 1 + ep_mesh.get_local_rank()
    x_BLD = torch.randn(2, 6, LAYER_SHAPE["dim"], generator=torch.Generator().manual_seed(seed)).requires_grad_()
    out_BLD = model.get_submodule("layers.0")(x_BLD)
    out_BLD.square().sum().backward()
    gradients = {name: param.grad for name, param in model.named_parameters()}
    return out_BLD.detach(), x_BLD.grad, gradients, summarize(observer, num_steps=1, reduce_groups=[])[0]


def assert_compiled_block_equals_eager(
    compute_backend: str, ep_mesh: DeviceMesh | None = None, ep_transport: EPTransport = "all_to_all"
) -> None:
    apply_torch_version_fixes()
    torch._dynamo.reset()
    step = partial(block_step, compute_backend, ep_mesh=ep_mesh, ep_transport=ep_transport)
    eager_out, eager_grad_x, eager_grads, eager_summary = step(None)
    settings = ("capture_scalar_outputs", "skip_fwd_side_effects_in_bwd_under_checkpoint")
    with torch._dynamo.config.patch({name: getattr(torch._dynamo.config, name) for name in settings}):
        out, grad_x, grads, summary = step("inductor")
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_x, eager_grad_x, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert (summary.tokens_per_expert_E == eager_summary.tokens_per_expert_E).all()
    assert summary.num_tokens == eager_summary.num_tokens
    assert summary.router_entropy == pytest.approx(eager_summary.router_entropy, rel=1e-6)
    assert summary.optional_per_step == pytest.approx(eager_summary.optional_per_step, rel=1e-5)


@pytest.mark.skipif(triton_available_reason() is not None, reason="Triton cannot run here")
def test_compiled_triton_block_equals_eager():
    assert_compiled_block_equals_eager("triton")


def compiled_ep_worker(rank: int, world: int, port: int, compute_backend: str, ep_transport: EPTransport) -> None:
    with gloo_ep_mesh(rank, world, port) as ep_mesh:
        assert_compiled_block_equals_eager(compute_backend, ep_mesh, ep_transport)


@pytest.mark.slow
@pytest.mark.skipif(triton_available_reason() is not None, reason="Triton cannot run here")
@pytest.mark.parametrize("ep_transport", ["all_to_all", "symm_mem"])
def test_compiled_triton_block_under_ep2_equals_eager(ep_transport):
    """The experts weight their rows under EP (``experts_apply_scores``): one graph per block with the
    transport's ops, equal to eager."""
    spawn_workers(compiled_ep_worker, 2, 2, free_port(), "triton", ep_transport)


@pytest.mark.slow
def test_compiled_grouped_mm_block_weighting_its_rows_under_ep2_equals_eager():
    """``grouped_mm`` weights the down projection's input rows under EP (``experts_apply_scores``): one
    graph per block, output, gradients and metrics equal to eager."""
    spawn_workers(compiled_ep_worker, 2, 2, free_port(), "grouped_mm", "all_to_all")
