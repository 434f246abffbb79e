"""Expert-parallel dispatch + combine on GPUs: equivalence check and bandwidth benchmark.

    torchrun --nproc_per_node=4 -m torchtitan_ext.bench ep --check --json results.json

Per (tokens per rank T, model dim D, top_k 8, balanced or skewed routing), on every rank:

- ``raw_a2a``: two NCCL ``all_to_all_single`` calls (dispatch and combine) with one row per
  routed slot, the bytes a dispatcher that sends every slot moves (torchtitan's does), in the
  same run: the reference.
- ``raw_a2a_unique``: the same with one row per (token, destination rank): the bytes both EP
  transports move, since each sends a token to a rank once however many of its experts there
  the token is routed to.
- ``dispatch_combine``: ``RoutingDispatcher.dispatch`` + ``combine`` (no expert compute),
  forward, once per EP transport.
- parts, each timed alone. ``all_to_all``: ``dispatch`` and ``combine`` alone,
  ``counts_and_host_sync`` (all-to-all of the per-expert and per-rank counts, read on the host),
  ``sender_rows`` (tokens -> one row per (token, rank) pair, and the sum of the returned rows per
  token), ``receiver_rows`` (received rows -> expert-grouped rows, and the weighted sum per
  received row). ``symm_mem``: ``dispatch`` (publish, barrier, layout, pair table, host
  sync, pull, expansion) and ``combine`` (push, barrier, owner's sum) alone, ``publish`` (token
  copy, sort, routing kernel), ``barrier``, ``layout_pairs_and_host_sync`` (the receive layout
  from every rank's counts, the pair table from every rank's routing, the layout copied to the
  host), ``owner_sum`` (the owner adding its tokens' partial sums), the ``pull_kernel`` (one row
  per arriving (token, rank) pair) and ``push_kernel`` alone (every rank running them at once,
  as inside dispatch and combine), and ``expand_rows`` (the pairs copied to their expert rows,
  local).

Bandwidth is the bytes of the routed slots a rank would send to other ranks (both directions) over
the time, max over ranks; ``fraction_of_raw`` is ``raw_a2a`` time over dispatch + combine time,
``fraction_of_raw_unique`` the same against ``raw_a2a_unique``.

Timed back to back, dispatch + combine measures the host (its launches and its one host sync)
more than the GPU. ``ms_host_ahead`` times the same calls (the raw all-to-all, dispatch +
combine, every part) queued behind ``HOST_AHEAD_MS`` of other GPU work (a spin kernel, then the
call, per iteration, less the spin kernel's time), as in a training step, where the host issues
a layer's kernels while the GPU still runs earlier ones: what remains is the call's GPU time
plus what a host sync exposes (the launches between the sync and the first kernel after it).
``fraction_of_raw_host_ahead`` compares raw and dispatch + combine that way.

Two more rows per case have static received rows (``--moe.ep_receive_rows static``, no host sync):
``all_to_all`` (``T`` rows to every rank, grouped on the device), launched by the host; and
``symm_mem`` (``launch`` ``"cuda_graph"``), its dispatch + combine captured in one CUDA graph and
replayed, as under torchtitan's CUDA graphs: the exchange's GPU time with no host launch in the
way. The latter runs on a process group of its own, so its exchange (which then fences every move,
``EPExchange.replayable``) leaves the exact-rows rows' fences as they are.

``--check`` first runs the EP layer equivalence (EP = world vs one GPU, every compute backend,
both transports and both permute backends, and for the backends that weight their rows the layer the
defaults train under CUDA graphs: ``symm_mem``, static received rows, ``experts_apply_scores``) and
records the largest errors.
"""

import json

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torchtitan.distributed.utils import set_spmd_backend

from torchtitan_ext.bench.common import environment, relative_error
from torchtitan_ext.experiments.moe_backends.dispatcher import (
    EP_TRANSPORTS,
    EPReceiveRows,
    EPTransport,
    PermuteBackend,
    RoutingDispatcher,
)
from torchtitan_ext.experiments.moe_backends.ep_check import compare_with_single_process, seeded_layer
from torchtitan_ext.experiments.moe_backends.experts import (
    backend_names,
    get_backend,
    grouped_mm_experts,
    row_weighting_unsupported_reason,
)
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config
from torchtitan_ext.experiments.moe_backends.transports import AllToAllTransport, SymmMemTransport
from torchtitan_ext.place_in_launch import local_rank

NUM_EXPERTS, TOP_K = 64, 8
HOST_AHEAD_MS = 3.0
"""GPU work queued before each call in the ``*_host_ahead`` timings (more than a dispatch's host time)."""


def cuda_time_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    elapsed = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def spin_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the GPU busy for about ``ms`` (the same on every rank)."""
    cycles = 1_000_000
    return int(cycles * ms / cuda_time_ms(lambda: torch.cuda._sleep(cycles)))


def host_ahead_ms(fn, cycles: int, spin_ms: float) -> float:
    """``fn``'s time on the GPU's timeline when the host queues it behind ``cycles`` of spinning
    (``spin_ms``, timed alone): the host's launches before a sync overlap the spin."""

    def run():
        torch.cuda._sleep(cycles)
        fn()

    return cuda_time_ms(run) - spin_ms


def captured(fn):
    """``fn`` captured in a CUDA graph (after warm-up runs on a side stream); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return graph.replay


def routing(num_tokens: int, skewed: bool, world: int, generator: torch.Generator):
    """top-k expert ids ``(T, K)``: uniform, or rank r's experts weighted linspace(2, 0.5)[r]."""
    weights_E = torch.ones(NUM_EXPERTS)
    if skewed:
        weights_E = torch.linspace(2.0, 0.5, world).repeat_interleave(NUM_EXPERTS // world)
    ids_TK = torch.multinomial(weights_E.expand(num_tokens, -1), TOP_K, generator=generator)
    return ids_TK.cuda()


def raw_all_to_all(rows_to_rank_W: torch.Tensor, dim: int):
    """Two NCCL ``all_to_all_single`` calls, there and back, moving ``rows_to_rank_W[r]`` bf16 rows of
    width ``dim`` to each rank ``r``. Returns ``(call, input_splits, output_splits)``."""
    rows_from_rank_W = torch.empty_like(rows_to_rank_W)
    dist.all_to_all_single(rows_from_rank_W, rows_to_rank_W)
    input_splits, output_splits = rows_to_rank_W.tolist(), rows_from_rank_W.tolist()
    send = torch.empty(sum(input_splits), dim, device="cuda", dtype=torch.bfloat16)
    receive = torch.empty(sum(output_splits), dim, device="cuda", dtype=torch.bfloat16)

    def call():
        dist.all_to_all_single(receive, send, output_splits, input_splits)
        dist.all_to_all_single(send, receive, input_splits, output_splits)

    return call, input_splits, output_splits


def wired_dispatcher(
    mesh: DeviceMesh, transport: EPTransport, permute_backend: PermuteBackend, receive_rows: EPReceiveRows = "exact"
) -> RoutingDispatcher:
    config = RoutingDispatcher.Config(
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        permute_backend=permute_backend,
        ep_transport=transport,
        ep_receive_rows=receive_rows,
    )
    dispatcher = RoutingDispatcher(config)
    dispatcher.wire_meshes(ep_mesh=mesh)
    return dispatcher


def bench_case(
    mesh: DeviceMesh,
    graph_mesh: DeviceMesh,
    num_tokens: int,
    dim: int,
    skewed: bool,
    permute_backend: PermuteBackend,
) -> list[dict]:
    """One routing case: raw all-to-all, then dispatch + combine over each EP transport, over
    ``all_to_all`` with static received rows, and over ``symm_mem`` with static received rows
    replayed from a CUDA graph (on ``graph_mesh``'s group)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    ids_TK = routing(num_tokens, skewed, world, generator)
    x_TD = torch.randn(num_tokens, dim, device="cuda", dtype=torch.bfloat16)
    scores_TK = torch.rand(num_tokens, TOP_K, device="cuda")
    counts_E = torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS)
    dispatchers = {transport: wired_dispatcher(mesh, transport, permute_backend) for transport in EP_TRANSPORTS}
    static_all_to_all = wired_dispatcher(mesh, "all_to_all", permute_backend, receive_rows="static")
    static_symm_mem = wired_dispatcher(graph_mesh, "symm_mem", permute_backend, receive_rows="static")

    raw_a2a, input_splits, output_splits = raw_all_to_all(counts_E.view(world, -1).sum(1), dim)
    ranks_per_token_TW = torch.zeros(num_tokens, world, dtype=torch.int64, device="cuda")
    ranks_per_token_TW.scatter_(1, ids_TK // (NUM_EXPERTS // world), 1)
    raw_a2a_unique, unique_in_splits, unique_out_splits = raw_all_to_all(ranks_per_token_TW.sum(0), dim)

    a2a = dispatchers["all_to_all"]
    grouped_RD, _, a2a_metadata = a2a.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    a2a_transport = a2a.transport
    assert isinstance(a2a_transport, AllToAllTransport), "wire_meshes installs the all_to_all transport"
    group = a2a_transport.group()
    counts_Wc = torch.zeros(world, NUM_EXPERTS // world + 1, dtype=torch.int64, device="cuda")
    num_sent = sum(a2a_metadata.input_splits)
    received_UD = torch.randn(sum(a2a_metadata.output_splits), dim, device="cuda", dtype=torch.bfloat16)

    def sender_rows():  # as in dispatch: the send buffer holds the static bound of pairs
        rows_PD = a2a_transport.send_rows(x_TD, a2a_metadata.pair_row_S)
        a2a_transport.sum_returned_rows(rows_PD[:num_sent], a2a_metadata)

    def receiver_rows():
        rows_RD = a2a_transport.group_received_rows(received_UD, a2a_metadata.received_plan)
        a2a_transport.weight_received_rows(rows_RD, a2a_metadata)

    symm = dispatchers["symm_mem"]
    symm_transport = symm.transport
    assert isinstance(symm_transport, SymmMemTransport), "wire_meshes installs the symm_mem transport"
    rows_RD, _, symm_metadata = symm.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    route = symm_metadata.route
    exchange = route.exchange
    pairs_PD = x_TD.new_empty(world * num_tokens, dim)

    def symm_layout_pairs_and_host_sync():
        layout, _ = exchange.read_routing(NUM_EXPERTS, num_tokens, TOP_K)
        layout.packed.cpu()

    def dispatch_combine(dispatcher: RoutingDispatcher):
        def run():
            rows, _, meta = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
            dispatcher.combine(rows, meta, x_TD)

        return run

    parts = {
        "all_to_all": {
            "dispatch": lambda: a2a.dispatch(x_TD, scores_TK, ids_TK, counts_E),
            "combine": lambda: a2a.combine(grouped_RD, a2a_metadata, x_TD),
            "counts_and_host_sync": lambda: a2a_transport.exchange_counts(counts_Wc, group),
            "sender_rows": sender_rows,
            "receiver_rows": receiver_rows,
        },
        "symm_mem": {
            "dispatch": lambda: symm.dispatch(x_TD, scores_TK, ids_TK, counts_E),
            "combine": lambda: symm.combine(rows_RD, symm_metadata, x_TD),
            "publish": lambda: exchange.publish(x_TD, scores_TK.reshape(-1), ids_TK.reshape(-1), NUM_EXPERTS),
            "barrier": exchange.barrier,
            "layout_pairs_and_host_sync": symm_layout_pairs_and_host_sync,
            "owner_sum": lambda: exchange.sum_landing(route),
            "pull_kernel": lambda: exchange.pull_rows(route, pairs_PD),
            "expand_rows": lambda: symm_transport.expand_rows(pairs_PD, route, rows_RD.shape[0]),
            "push_kernel": lambda: exchange.push_rows(rows_RD, route, weighted=True),
        },
    }
    raw_ms = cuda_time_ms(raw_a2a)
    raw_unique_ms = cuda_time_ms(raw_a2a_unique)
    cycles = spin_cycles(HOST_AHEAD_MS)
    spin_ms = cuda_time_ms(lambda: torch.cuda._sleep(cycles))
    raw_ahead_ms = host_ahead_ms(raw_a2a, cycles, spin_ms)

    def remote_bytes_max(sent: list[int], received: list[int]) -> float:
        remote = torch.tensor([(sum(sent) - sent[rank] + sum(received) - received[rank]) * dim * 2.0], device="cuda")
        dist.all_reduce(remote, op=dist.ReduceOp.MAX)
        return remote.item()

    remote_bytes = remote_bytes_max(input_splits, output_splits)
    remote_unique_bytes = remote_bytes_max(unique_in_splits, unique_out_splits)
    variants = [
        (transport, "exact", "host", dispatch_combine(dispatchers[transport]), parts[transport])
        for transport in EP_TRANSPORTS
    ]
    variants.append(("all_to_all", "static", "host", dispatch_combine(static_all_to_all), {}))
    variants.append(("symm_mem", "static", "cuda_graph", captured(dispatch_combine(static_symm_mem)), {}))
    rows = []
    for transport, receive_rows, launch, call, transport_parts in variants:
        total_ms = cuda_time_ms(call)
        ahead_ms = host_ahead_ms(call, cycles, spin_ms)
        rows.append(
            {
                "world": world,
                "tokens_per_rank": num_tokens,
                "dim": dim,
                "top_k": TOP_K,
                "num_experts": NUM_EXPERTS,
                "routing": "skewed" if skewed else "balanced",
                "transport": transport,
                "receive_rows": receive_rows,
                "launch": launch,
                "permute_backend": permute_backend,
                "ms": {
                    "dispatch_combine": round(total_ms, 4),
                    "raw_a2a": round(raw_ms, 4),
                    "raw_a2a_unique": round(raw_unique_ms, 4),
                }
                | {name: round(cuda_time_ms(fn), 4) for name, fn in transport_parts.items()},
                "ms_host_ahead": {"dispatch_combine": round(ahead_ms, 4), "raw_a2a": round(raw_ahead_ms, 4)}
                | {name: round(host_ahead_ms(fn, cycles, spin_ms), 4) for name, fn in transport_parts.items()},
                "remote_MB_per_rank_max": round(remote_bytes / 1e6, 1),
                "remote_unique_MB_per_rank_max": round(remote_unique_bytes / 1e6, 1),
                "dispatch_combine_GBps": round(remote_bytes / total_ms / 1e6, 1),
                "raw_a2a_GBps": round(remote_bytes / raw_ms / 1e6, 1),
                "fraction_of_raw": round(raw_ms / total_ms, 3),
                "fraction_of_raw_unique": round(raw_unique_ms / total_ms, 3),
                "fraction_of_raw_host_ahead": round(raw_ahead_ms / ahead_ms, 3),
            }
        )
    return rows


def build_layer(
    compute_backend: str,
    transport: EPTransport,
    permute_backend: PermuteBackend,
    dim: int = 256,
    hidden: int = 384,
    receive_rows: EPReceiveRows = "exact",
    experts_apply_scores: bool = False,
):
    """The project's MoE layer (sigmoid routing, aux and z losses on) with uneven expert loads."""
    config = moe_layer_config(
        compute_backend=compute_backend,
        dim=dim,
        hidden_dim=hidden,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        score_func="sigmoid",
        load_balance_coeff=None,
    )
    dispatcher = config.routed_experts.token_dispatcher
    assert isinstance(dispatcher, RoutingDispatcher.Config), "moe_layer_config installs the project's dispatcher"
    dispatcher.permute_backend, dispatcher.ep_transport = permute_backend, transport
    dispatcher.ep_receive_rows, dispatcher.experts_apply_scores = receive_rows, experts_apply_scores
    config.aux_loss_coeff, config.aux_loss_type, config.z_loss_coeff = 0.01, "global", 1e-3
    layer = seeded_layer(config, "cuda")
    with torch.no_grad():
        layer.router.gate.weight[-NUM_EXPERTS // 8 :] -= 0.2  # uneven splits
    return layer


def check_equivalence(mesh, compute_backends: list[str]) -> list[dict]:
    """EP=world vs a single GPU on the whole batch: output and every gradient (``ep_check``); rank 0
    prints each case's result as a JSON line when it is done, so a run cut short keeps the ones done."""
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    x_all = torch.randn(world * 2, 512, 256, generator=generator).cuda()
    grad_all = torch.randn(x_all.shape, generator=generator).cuda()
    results = []
    exact_cases: list[tuple[EPTransport, PermuteBackend, EPReceiveRows, bool]] = [
        ("all_to_all", "torch", "exact", False),
        ("all_to_all", "triton", "exact", False),
        ("symm_mem", "triton", "exact", False),
    ]
    for compute_backend in compute_backends:
        cases = list(exact_cases)
        if row_weighting_unsupported_reason(compute_backend, "native") is None:
            cases.append(("symm_mem", "triton", "static", True))
        for transport, permute_backend, receive_rows, apply_scores in cases:
            # torch._grouped_mm is checked in bf16, the dtype it runs in on GPUs; the rest in fp32.
            dtype = torch.bfloat16 if get_backend(compute_backend).grouped is grouped_mm_experts else torch.float32
            reference, layer = (
                build_layer(
                    compute_backend,
                    transport,
                    permute_backend,
                    receive_rows=receive_rows,
                    experts_apply_scores=apply_scores,
                ).to(dtype)
                for _ in range(2)
            )
            pairs = compare_with_single_process(reference, layer, x_all.to(dtype), grad_all.to(dtype), mesh)
            errors = {quantity: relative_error(actual, expected) for quantity, (actual, expected) in pairs.items()}
            worst = torch.tensor(list(errors.values()), device="cuda")
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            results.append(
                {
                    "world": world,
                    "compute_backend": compute_backend,
                    "transport": transport,
                    "permute_backend": permute_backend,
                    "receive_rows": receive_rows,
                    "experts_apply_scores": apply_scores,
                    "dtype": str(dtype).removeprefix("torch."),
                    "max_rel_err_over_ranks": dict(zip(errors, [float(f"{v:.3g}") for v in worst.tolist()])),
                }
            )
            if dist.get_rank() == 0:
                print(json.dumps({"equivalence": results[-1]}), flush=True)
    return results


def run(
    token_counts: list[int],
    dims: list[int],
    check: bool,
    permute_backends: list[PermuteBackend],
    command: str,
    check_backends: list[str] | None = None,
) -> dict:
    """Under torchrun: NCCL process group, optional equivalence check, every case; the report
    (``common.environment`` with the world size, NCCL version and symmetric-memory backend).

    Every rank returns the same report; the caller destroys the process group.
    """
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(local_rank())
    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    graph_group = dist.new_group(list(range(world)))
    assert isinstance(graph_group, dist.ProcessGroup), "every rank is a member of the group it creates"
    graph_mesh = DeviceMesh.from_group(graph_group, "cuda", mesh_dim_names=("ep",))
    report = {
        **environment(command, torch.device("cuda"), torch.bfloat16),
        "world": world,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "symm_mem_backend": symm_mem.get_backend(torch.device("cuda")),
    }
    if check:
        try:
            report["equivalence"] = check_equivalence(mesh, list(check_backends or backend_names()))
        except Exception as e:  # recorded, so the benchmark still runs
            report["equivalence_error"] = f"{type(e).__name__}: {e}"
            if rank == 0:
                print(json.dumps({"equivalence_error": report["equivalence_error"]}), flush=True)
    report["bench"] = []
    for num_tokens in token_counts:
        for dim in dims:
            for skewed in (False, True):
                for permute_backend in permute_backends:
                    for row in bench_case(mesh, graph_mesh, num_tokens, dim, skewed, permute_backend):
                        report["bench"].append(row)
                        if rank == 0:
                            print(json.dumps(row), flush=True)
    return report
