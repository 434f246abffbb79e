"""Expert parallelism trains the same layer as EP=1, on CPU with gloo.

Layer level: EP = 1, 2 and 4 processes (spawned here), over either EP transport, each run
their share of one batch through the MoE layer; outputs and every gradient (input, router
gate, each expert's weights) equal a single-process run on the whole batch, for every
compute backend, with uneven splits and a rank whose experts receive no token, and with the aux / z losses on;
over ``all_to_all`` each token is sent once to each rank that owns one of its experts.

Training level: a tiny flavor trained for a few steps with torchrun on 2 (4) processes gives the
same loss curve with EP=2 (EP=4), over each EP transport, as with EP=1 (data parallel only) on as
many processes, so all see the same data.
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from helpers import cpu_tensor_backends, free_port, gloo_ep_mesh, spawn_workers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchtitan_ext.experiments.moe_backends.activation_checkpoint import MoESelectiveAC
from torchtitan_ext.experiments.moe_backends.dispatcher import EPReceiveRows, EPTransport, RoutingDispatcher
from torchtitan_ext.experiments.moe_backends.ep_check import compare_with_single_process, seeded_layer
from torchtitan_ext.experiments.moe_backends.experts import row_weighting_unsupported_reason
from torchtitan_ext.experiments.moe_backends.grouping import RowOps
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config
from torchtitan_ext.experiments.moe_backends.transports import AllToAllTransport
from torchtitan_ext.kernels.availability import interpreter_enabled

NUM_EXPERTS, TOP_K, DIM, HIDDEN = 8, 2, 16, 24
LAYER_SHAPE = dict(dim=DIM, hidden_dim=HIDDEN, num_experts=NUM_EXPERTS, top_k=TOP_K)
BATCH_PER_RANK, SEQ_LEN = 2, 6
MAX_WORLD = 4
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CPU_TRITON_SKIP = (
    "CPU tensors over gloo reach the Triton kernels only through Triton's interpreter (TRITON_INTERPRET=1, "
    "set by conftest.py where there is no CUDA); on GPUs `scripts/measure_on_gpu.sh ep2` checks EP "
    "equivalence of every backend and transport on CUDA tensors"
)
# Every backend that runs on CPU tensors here: the fused Triton one only through the interpreter.
BACKENDS = cpu_tensor_backends()

LOSS_CASES: list[dict[str, Any]] = [  # keyword arguments of build_layer
    dict(aux_loss_coeff=0.0, z_loss_coeff=0.0, aux_loss_type="batch"),
    dict(aux_loss_coeff=0.1, z_loss_coeff=0.01, aux_loss_type="global"),
    dict(aux_loss_coeff=0.1, z_loss_coeff=0.0, aux_loss_type="seq"),
]


def build_layer(
    compute_backend: str,
    *,
    aux_loss_coeff,
    z_loss_coeff,
    aux_loss_type,
    ep_transport: EPTransport = "all_to_all",
    ep_receive_rows: EPReceiveRows = "exact",
    experts_apply_scores: bool = False,
):
    """A RoutedMoE layer with deterministic weights (identical in every process)."""
    config = moe_layer_config(compute_backend=compute_backend, load_balance_coeff=None, **LAYER_SHAPE)
    config.aux_loss_coeff, config.z_loss_coeff, config.aux_loss_type = aux_loss_coeff, z_loss_coeff, aux_loss_type
    dispatcher = config.routed_experts.token_dispatcher
    assert isinstance(dispatcher, RoutingDispatcher.Config)
    dispatcher.ep_transport, dispatcher.ep_receive_rows = ep_transport, ep_receive_rows
    dispatcher.experts_apply_scores = experts_apply_scores
    layer = seeded_layer(config)
    with torch.no_grad():
        # Feature 0 of every token is large (see ``batch``): experts 6 and 7 (the last
        # rank's at EP=4) get no token, and experts 0 and 1 get more than the others.
        layer.router.gate.weight[6:, 0] = -10.0
        layer.router.gate.weight[:2, 0] = 1.0
    return layer


def batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x_BLD = torch.randn(world * BATCH_PER_RANK, SEQ_LEN, DIM, generator=generator)
    x_BLD[..., 0] = 2.0
    grad_BLD = torch.randn(x_BLD.shape, generator=generator)
    return x_BLD, grad_BLD


def check_layer_shard(ep_mesh, ep_transport: EPTransport = "all_to_all") -> None:
    """This rank's outputs and gradients equal the single-process run on the whole batch, for every
    backend; under EP with exact and with static received rows (the latter with the first losses),
    and for the backends that weight their rows with ``experts_apply_scores`` (exact and static)."""
    world = 1 if ep_mesh is None else ep_mesh.size()
    x_all, grad_all = batch(world)
    cases: list[tuple[dict[str, Any], EPReceiveRows, bool]] = [(losses, "exact", False) for losses in LOSS_CASES]
    if ep_mesh is not None:
        ep_cases: list[tuple[dict[str, Any], EPReceiveRows, bool]] = [
            (LOSS_CASES[0], "static", False),
            (LOSS_CASES[1], "exact", True),
            (LOSS_CASES[0], "static", True),
        ]
        cases += ep_cases
    for losses, receive_rows, apply_scores in cases:
        backends = [b for b in BACKENDS if not apply_scores or row_weighting_unsupported_reason(b, "native") is None]
        for backend in backends:
            layer = build_layer(
                backend,
                **losses,
                ep_transport=ep_transport,
                ep_receive_rows=receive_rows,
                experts_apply_scores=apply_scores,
            )
            pairs = compare_with_single_process(build_layer("for_loop", **losses), layer, x_all, grad_all, ep_mesh)
            rank = 0 if ep_mesh is None else ep_mesh.get_local_rank()
            for quantity, (actual, expected) in pairs.items():
                scores_by = "experts" if apply_scores else "combine"
                what = (
                    f"rank {rank}/{world} {ep_transport} {receive_rows} rows {backend} {losses} {scores_by} {quantity}"
                )
                torch.testing.assert_close(actual, expected, msg=lambda m, what=what: f"{what}: {m}")


class AllToAllCounter(TorchDispatchMode):
    """Counts the all-to-all ops that run (functional or c10d)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (
            torch.ops._c10d_functional.all_to_all_single,
            torch.ops.c10d.alltoall_base_,
        )
        return func(*args, **(kwargs or {}))


def check_selective_checkpointing_saves_the_all_to_alls(ep_mesh) -> None:
    """Under selective checkpointing with torchtitan's list of saved ops (the flavors' default), the
    backward recomputes dispatch and combine without sending again: only the three gradient
    all-to-alls run (rows and weights back through dispatch, rows back through combine)."""
    generator = torch.Generator().manual_seed(30 + ep_mesh.get_local_rank())
    num_tokens = 7
    ids_TK = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(num_tokens)])
    counts_E = torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS)
    dispatcher = RoutingDispatcher(RoutingDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K))
    dispatcher.wire_meshes(ep_mesh=ep_mesh)
    x_TD = torch.randn(num_tokens, DIM, generator=generator, requires_grad=True)
    scores_TK = torch.rand(num_tokens, TOP_K, generator=generator, requires_grad=True)

    def block(x_TD, scores_TK):
        rows_RD, _, metadata = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
        return dispatcher.combine(rows_RD.sin(), metadata, x_TD)

    save_ops = MoESelectiveAC(MoESelectiveAC.Config()).get_save_ops()  # what the flavors' checkpointing saves

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    out_TD = checkpoint(
        block,
        x_TD,
        scores_TK,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(policy),
    )
    with AllToAllCounter() as counter:
        out_TD.sum().backward()
    assert counter.count == 3, counter.count


def check_one_row_per_token_and_rank(ep_mesh) -> None:
    """Over ``all_to_all`` a rank sends each token once to each rank that owns one of its
    experts, however many of them (dropped slots go nowhere), in three all-to-alls (counts,
    rows, routing rows) and one host read of the counts."""
    rank, world = ep_mesh.get_local_rank(), ep_mesh.size()
    generator = torch.Generator().manual_seed(20 + rank)
    num_tokens = 9
    ids_TK = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(num_tokens)])
    ids_TK[::3, 0] = NUM_EXPERTS  # dropped by a capacity limit
    dispatcher = RoutingDispatcher(RoutingDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K))
    dispatcher.wire_meshes(ep_mesh=ep_mesh)
    counts_E = torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS + 1)[:NUM_EXPERTS]
    host_reads = []
    tolist = torch.Tensor.tolist
    with (
        mock.patch.object(torch.Tensor, "tolist", lambda t: host_reads.append(t) or tolist(t)),
        AllToAllCounter() as counter,
    ):
        _, _, metadata = dispatcher.dispatch(
            torch.randn(num_tokens, DIM), torch.rand(num_tokens, TOP_K), ids_TK, counts_E
        )
    assert (counter.count, len(host_reads)) == (3, 1), (counter.count, len(host_reads))
    local = NUM_EXPERTS // world
    expected = [
        sum(any(e < NUM_EXPERTS and e // local == owner for e in ids_TK[t].tolist()) for t in range(num_tokens))
        for owner in range(world)
    ]
    assert metadata.input_splits == expected, (metadata.input_splits, expected)


def ep_worker(rank: int, world: int, port: int, ep_transport: EPTransport) -> None:
    with gloo_ep_mesh(rank, world, port) as ep_mesh:
        check_layer_shard(ep_mesh, ep_transport)
        if ep_transport == "all_to_all":
            check_one_row_per_token_and_rank(ep_mesh)
            check_selective_checkpointing_saves_the_all_to_alls(ep_mesh)


def check_counts_reach_the_host_in_one_copy(rank: int, world: int, port: int) -> None:
    """The exact all_to_all dispatch's host sync: traced as torchtitan compiles a block, the counts the
    host needs leave the device in one copy (``tolist()`` of a device tensor under compile reads each
    element with a sync of its own: 68 a layer on olmoe-1b-7b at EP 2)."""
    with gloo_ep_mesh(rank, world, port) as ep_mesh:
        transport = AllToAllTransport(RowOps("torch"), 1, NUM_EXPERTS, TOP_K, ep_mesh)
        local = NUM_EXPERTS // world
        send_counts_Wc = torch.arange(world * (local + 1)).view(world, local + 1) + rank
        graphs = []

        def capture(graph_module, _):
            graphs.append(graph_module.graph)
            return graph_module.forward

        def host_counts(counts):
            return transport.exchange_counts(counts, transport.group())[1:]

        torch._dynamo.reset()
        with mock.patch.object(torch._dynamo.config, "capture_scalar_outputs", True):
            compiled = torch.compile(host_counts, fullgraph=True, backend=capture)
            assert compiled(send_counts_Wc) == host_counts(send_counts_Wc)
        input_splits, output_splits, num_received_slots = host_counts(send_counts_Wc)
        assert input_splits == send_counts_Wc[:, -1].tolist()
        received = [[rank * (local + 1) + i + peer for i in range(local + 1)] for peer in range(world)]
        assert output_splits == [row[-1] for row in received]
        assert num_received_slots == sum(sum(row[:-1]) for row in received)
        (graph,) = graphs
        copies = [node for node in graph.nodes if node.op == "call_method" and node.target == "cpu"]
        reads = [node for node in graph.nodes if node.op == "call_method" and node.target == "item"]
        assert len(copies) == 1 and len(reads) == 2 * world + 1, graph
        assert all(read.args[0].args[0] is copies[0] for read in reads), graph


@pytest.mark.parametrize("world", [2, 4])
def test_exact_all_to_all_reads_its_counts_on_the_host_in_one_copy(world):
    spawn_workers(check_counts_reach_the_host_in_one_copy, world, world, free_port())


def test_moe_layer_ep1_local_dispatch_equals_reference():
    check_layer_shard(None)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ep_transport", ["all_to_all", "symm_mem"])
def test_moe_layer_under_ep_equals_single_process(world, ep_transport):
    if ep_transport == "symm_mem" and not interpreter_enabled():
        pytest.skip(f"the CPU stand-in of symm_mem runs its kernels on CPU tensors. {CPU_TRITON_SKIP}")
    spawn_workers(ep_worker, world, world, free_port(), ep_transport)


def test_skewed_router_leaves_last_experts_empty():
    layer = build_layer("for_loop", **LOSS_CASES[0])
    x_all, _ = batch(MAX_WORLD)
    layer(x_all)
    assert layer.last_router_statistics is not None
    counts_E = layer.last_router_statistics.tokens_per_expert_E
    assert counts_E[6:].sum() == 0 and counts_E[:6].min() >= 0
    assert len(set(counts_E[:6].tolist())) > 1, "splits should be uneven"


def train_losses(
    tmp_path: Path,
    expert_parallel_degree: int,
    toml: Path | None = None,
    processes: int = 2,
    flavor: str = "tiny-moe-for-loop",
    tensor_parallel_degree: int = 1,
) -> list[float]:
    """Losses of the first steps of a torchrun training run of ``flavor`` on ``processes`` processes on CPU
    (rank 0's log); CUDA is hidden from it, so it runs over gloo on any machine."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={processes}",
        f"--master_port={free_port()}",
        "--local-ranks-filter=0",
        "-m",
        "torchtitan_ext.train",
        "--flavor",
        flavor,
        "--training.steps",
        "3",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--parallelism.expert_parallel_degree",
        str(expert_parallel_degree),
        "--parallelism.tensor_parallel_degree",
        str(tensor_parallel_degree),
        "--dump_folder",
        str(
            tmp_path / f"{flavor}-{processes}x-ep{expert_parallel_degree}-tp{tensor_parallel_degree}-"
            f"{toml.stem if toml else 'default'}"
        ),
        "--metrics.disable_color_printing",
    ] + (["--toml", str(toml)] if toml else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    losses = [float(v) for v in re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", log)]
    assert len(losses) == 3, log[-4000:]
    return losses


@pytest.fixture(scope="module")
def ep1_losses(tmp_path_factory) -> list[float]:
    return train_losses(tmp_path_factory.mktemp("ep1"), 1)


@pytest.mark.slow
def test_training_loss_curve_ep2_equals_ep1(tmp_path, ep1_losses):
    ep2 = train_losses(tmp_path, 2)
    assert ep1_losses == pytest.approx(ep2, rel=1e-4), (ep1_losses, ep2)


@pytest.mark.slow
@pytest.mark.skipif(
    not interpreter_enabled(), reason=f"the CPU stand-in of symm_mem runs its kernels on CPU tensors. {CPU_TRITON_SKIP}"
)
def test_training_loss_curve_ep2_over_symm_mem_equals_ep1(tmp_path, ep1_losses):
    ep2_symm_mem = train_losses(tmp_path, 2, EXAMPLES / "ep_symm_mem.toml")
    assert ep1_losses == pytest.approx(ep2_symm_mem, rel=1e-4), (ep1_losses, ep2_symm_mem)


@pytest.mark.slow
def test_training_loss_curve_ep2_over_all_to_all_with_static_rows_equals_ep1(tmp_path, ep1_losses):
    """No host sync: T rows to every rank, grouped into the most rows a rank can receive."""
    toml = tmp_path / "static_rows.toml"
    toml.write_text('[moe]\nep_receive_rows = "static"\n')
    ep2_static = train_losses(tmp_path, 2, toml)
    assert ep1_losses == pytest.approx(ep2_static, rel=1e-4), (ep1_losses, ep2_static)


@pytest.mark.slow
def test_deepseek_v3_training_loss_curve_ep2_equals_ep1(tmp_path):
    """DeepSeek-V3's routing under EP: sigmoid scores with the expert bias (updated after every step from
    the counts of all ranks), normalised and scaled top-k scores, shared experts, a dense first layer."""
    ep1 = train_losses(tmp_path, 1, flavor="tiny-deepseek-v3")
    ep2 = train_losses(tmp_path, 2, flavor="tiny-deepseek-v3")
    assert ep1 == pytest.approx(ep2, rel=1e-4), (ep1, ep2)


@pytest.mark.slow
def test_training_loss_curve_ep4_equals_ep1(tmp_path):
    ep1 = train_losses(tmp_path, 1, processes=4)
    ep4 = train_losses(tmp_path, 4, processes=4)
    assert ep1 == pytest.approx(ep4, rel=1e-4), (ep1, ep4)
    if interpreter_enabled():  # the CPU stand-in of symm_mem runs its kernels on CPU tensors
        ep4_symm_mem = train_losses(tmp_path, 4, EXAMPLES / "ep_symm_mem.toml", processes=4)
        assert ep1 == pytest.approx(ep4_symm_mem, rel=1e-4), (ep1, ep4_symm_mem)


@pytest.mark.slow
def test_training_loss_curve_tp2_equals_one_process(tmp_path):
    """Tensor parallelism: every TP rank routes the same tokens (the router's DTensors replicated), the
    experts' hidden dimension sharded; with the capacity limit, whose counts are the local tokens'."""
    toml = tmp_path / "capacity.toml"
    toml.write_text("[moe]\ncapacity_factor = 1.0\n")
    for flavor in ("tiny-moe-for-loop", "tiny-deepseek-v3"):
        one = train_losses(tmp_path, 1, toml, processes=1, flavor=flavor)
        tp2 = train_losses(tmp_path, 1, toml, processes=2, flavor=flavor, tensor_parallel_degree=2)
        assert one == pytest.approx(tp2, rel=1e-4), (flavor, one, tp2)


@pytest.mark.slow
def test_training_loss_curve_ep2_tp2_equals_ep1(tmp_path, ep1_losses):
    """EP 2 x TP 2 on 4 ranks (dp_shard 2): expert parallelism shards the sequence over the TP ranks, so
    each routes a part of the tokens and the counts are Partial over TP."""
    ep2_tp2 = train_losses(tmp_path, 2, processes=4, tensor_parallel_degree=2)
    assert ep1_losses == pytest.approx(ep2_tp2, rel=1e-4), (ep1_losses, ep2_tp2)
