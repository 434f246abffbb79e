"""The ``symm_mem`` EP transport (``ep_symm_mem``) moves the same rows as the all-to-all one.

On CPU the workspace is one shared-memory file per rank and the kernels run under Triton's
interpreter; processes are spawned here with gloo. Dispatch -> per-expert compute -> combine
over ``symm_mem`` must give the same output and the same gradients (tokens, router scores,
expert weights) as over ``all_to_all``, with uneven splits, dropped slots, a rank whose experts get
no token, ``align_size`` padding, and two layers back to back (buffers reused across calls).
"""

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, fresh_buffers_hold_nan, gloo_ep_mesh, spawn_workers

from torchtitan_ext.experiments.moe_backends.dispatcher import (
    EPReceiveRows,
    EPTransport,
    RoutingDispatcher,
    symm_mem_errors,
)
from torchtitan_ext.kernels.availability import triton_available_reason
from torchtitan_ext.kernels.moe_permute import stable_expert_order
from torchtitan_ext.kernels.symm_mem_rows import publish_routing, receive_layout, route_pairs

NUM_EXPERTS, TOP_K, DIM, TOKENS = 8, 3, 12, 10

needs_triton = pytest.mark.skipif(triton_available_reason() is not None, reason="Triton cannot run here")
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the kernel checks run: CUDA when there is one, else CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest.py where there is no CUDA)."""


@needs_triton
def test_publish_routing_kernel_matches_a_direct_enumeration():
    """Each slot's expert, score and position in the stably expert-sorted slots; kept counts per
    expert (dropped slots, id E, excluded), then the token count; every region overwritten."""
    generator = torch.Generator().manual_seed(2)
    for experts, tokens, top_k in ((8, 10, 3), (5, 1, 2), (64, 300, 8), (3, 0, 2)):
        expert_S = torch.randint(0, experts + 1, (tokens * top_k,), generator=generator).to(KERNEL_DEVICE)
        scores_S = torch.rand(tokens * top_k, generator=generator, dtype=torch.float64).to(
            KERNEL_DEVICE, torch.bfloat16
        )
        slot_expert, slot_position = (
            torch.full((tokens * top_k,), -7, dtype=torch.int32, device=KERNEL_DEVICE) for _ in range(2)
        )
        slot_score = torch.full((tokens * top_k,), -7.0, device=KERNEL_DEVICE)
        counts = torch.full((experts + 1,), -7, dtype=torch.int32, device=KERNEL_DEVICE)
        order_S = stable_expert_order(expert_S, experts)
        publish_routing(order_S, expert_S, scores_S, slot_expert, slot_score, slot_position, counts, experts, tokens)
        expected_position = [0] * expert_S.numel()
        sorted_slots = sorted(range(expert_S.numel()), key=lambda slot: (int(expert_S[slot]), slot))
        for position, slot in enumerate(sorted_slots):
            expected_position[slot] = position
        assert slot_position.tolist() == expected_position
        assert torch.equal(slot_expert, expert_S.int())
        assert torch.equal(slot_score, scores_S.float())
        kept_counts = torch.bincount(expert_S, minlength=experts + 1)[:experts]
        assert counts.tolist() == [*kept_counts.tolist(), tokens]


@needs_triton
def test_receive_layout_kernel_matches_a_direct_enumeration():
    """Every rank's counts in its own tensor (the pointer table holds their addresses)."""
    generator = torch.Generator().manual_seed(0)
    for world, experts in ((2, 4), (4, 8), (3, 6), (1, 5)):
        counts_WE = torch.randint(0, 4, (world, experts), generator=generator, dtype=torch.int32)
        counts_WE[0, 1] = 0
        regions = [
            torch.cat([counts_WE[s], torch.tensor([7 + s], dtype=torch.int32)]).to(KERNEL_DEVICE) for s in range(world)
        ]
        table = torch.tensor([region.data_ptr() for region in regions], dtype=torch.int64, device=KERNEL_DEVICE)
        local = experts // world
        for rank in range(world):
            layout = receive_layout(table, experts, rank, table)
            expected = []  # (source rank, position in the source's expert-sorted list)
            for expert in range(rank * local, (rank + 1) * local):
                for source in range(world):
                    first = int(counts_WE[source, :expert].sum())
                    expected += [(source, first + i) for i in range(int(counts_WE[source, expert]))]
            got = []
            for block in range(local * world):
                start, end = layout.block_start_G1[block : block + 2].tolist()
                source = block % world
                got += [(source, int(layout.source_start_G[block]) + i) for i in range(end - start)]
            assert got == expected
            assert int(layout.block_start_G1[-1]) == len(expected)
            mine = counts_WE[:, rank * local : (rank + 1) * local]
            assert layout.rows_per_local_expert_e.tolist() == mine.sum(0).tolist()
            assert layout.tokens_per_rank_W.tolist() == [7 + s for s in range(world)]


@needs_triton
def test_pair_table_kernel_matches_a_direct_enumeration():
    """Each slot's received row, its score, and each pair's ordinal among the token's ranks."""
    generator = torch.Generator().manual_seed(1)
    for world, experts, top_k, tokens in ((3, 6, 4, 5), (2, 4, 1, 3), (4, 8, 3, 6)):
        local = experts // world
        expert_WS = torch.randint(0, experts + 1, (world, tokens * top_k), generator=generator, dtype=torch.int32)
        score_WS = torch.rand(world, tokens * top_k, generator=generator)
        position_WS = torch.full_like(expert_WS, -1)
        counts = []
        for source in range(world):
            order = torch.argsort(expert_WS[source], stable=True)
            position_WS[source, order] = torch.arange(order.numel(), dtype=torch.int32)
            kept = expert_WS[source][expert_WS[source] < experts].long()
            counts.append(torch.cat([torch.bincount(kept, minlength=experts), torch.tensor([tokens])]).int())

        expert_WS, position_WS, score_WS = (t.to(KERNEL_DEVICE) for t in (expert_WS, position_WS, score_WS))
        counts = [count.to(KERNEL_DEVICE) for count in counts]

        def table(regions):
            return torch.tensor([region.data_ptr() for region in regions], dtype=torch.int64, device=KERNEL_DEVICE)

        for rank in range(world):
            layout = receive_layout(table(counts), experts, rank, expert_WS)
            pairs = route_pairs(
                table(expert_WS), table(position_WS), table(score_WS), layout, rank, tokens, top_k, experts
            )
            received = []  # (source, slot) in expert-major order
            for expert in range(rank * local, (rank + 1) * local):
                for source in range(world):
                    received += [(source, int(slot)) for slot in (expert_WS[source] == expert).nonzero().flatten()]
            for source in range(world):
                for token in range(tokens):
                    slots = range(token * top_k, (token + 1) * top_k)
                    pair = source * tokens + token
                    for k, slot in enumerate(slots):
                        here = (source, slot) in received
                        expected_row = received.index((source, slot)) if here else -1
                        assert int(pairs.recv_row_PK[pair, k]) == expected_row
                        assert float(pairs.recv_score_PK[pair, k]) == (float(score_WS[source, slot]) if here else 0.0)
                    ranks = {
                        int(expert_WS[source, slot]) // local for slot in slots if expert_WS[source, slot] < experts
                    }
                    expected_ordinal = len([r for r in ranks if r < rank]) if rank in ranks else -1
                    assert int(pairs.ordinal_P[pair]) == expected_ordinal


def routing(rank: int, dtype: torch.dtype):
    """Per-rank tokens, scores and expert ids: uneven, some dropped (id E), none for the last rank at W=4."""
    generator = torch.Generator().manual_seed(10 + rank)
    x_TD = torch.randn(TOKENS, DIM, generator=generator, dtype=dtype)
    scores_TK = torch.rand(TOKENS, TOP_K, generator=generator)
    ids_TK = torch.multinomial(torch.tensor([4.0, 3, 2, 1, 1, 1, 0, 0]).expand(TOKENS, -1), TOP_K, generator=generator)
    ids_TK[::4, -1] = NUM_EXPERTS  # dropped by a capacity limit
    return x_TD, scores_TK, ids_TK


def moe_block(dispatcher, x_TD, scores_TK, ids_TK, weights_LDD, grouping: list, weight_rows: bool = False):
    """dispatch -> rows of local expert l times weights_LDD[l] -> combine; appends the dispatch's
    group sizes and padding row count to ``grouping``. ``weight_rows``: the rows times the
    transport's row scores, then its unweighted sum (the path of experts that weight their rows).
    Rows past the received ones (static received rows: the most a rank can receive) are unset: their
    outputs here are NaN, and so is the gradient this block sends back to them, so a combine or an
    exchange backward that read any of them would spread the NaN."""
    counts_E = torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS + 1)[:NUM_EXPERTS]
    rows_RD, rows_per_expert_L, metadata = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    grouping.append((rows_per_expert_L.tolist(), int(dispatcher.last_num_padding_rows)))
    expert_N = torch.repeat_interleave(torch.arange(weights_LDD.shape[0]), rows_per_expert_L)
    num_received = expert_N.shape[0]
    out_ND = torch.bmm(rows_RD[:num_received].unsqueeze(1), weights_LDD[expert_N]).squeeze(1)
    out_RD = torch.cat([out_ND, rows_RD[num_received:] * float("nan")])
    if weight_rows:
        row_scores_R = dispatcher.row_scores(metadata, rows_RD.shape[0])
        assert not row_scores_R[num_received:].any(), "rows past the received ones have no score"
        weighted_RD = (out_RD.float() * row_scores_R[:, None]).to(out_RD.dtype)  # fp32, as the kernels weight
        return dispatcher.sum_rows(weighted_RD, metadata, x_TD)
    return dispatcher.combine(out_RD, metadata, x_TD)


def run_two_layers(
    mesh,
    transport: EPTransport,
    align_size: int,
    dtype: torch.dtype,
    receive_rows: EPReceiveRows = "exact",
    weight_rows: bool = False,
):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = NUM_EXPERTS // world
    dispatcher = RoutingDispatcher(
        RoutingDispatcher.Config(
            num_experts=NUM_EXPERTS,
            top_k=TOP_K,
            permute_backend="triton",
            align_size=align_size,
            ep_transport=transport,
            ep_receive_rows=receive_rows,
        )
    )
    dispatcher.wire_meshes(ep_mesh=mesh)
    x_TD, scores_TK, ids_TK = routing(rank, dtype)
    generator = torch.Generator().manual_seed(99)
    all_weights = torch.randn(2, NUM_EXPERTS, DIM, DIM, generator=generator, dtype=dtype) * DIM**-0.5
    weights = all_weights[:, rank * local : (rank + 1) * local].clone().requires_grad_()
    x = x_TD.clone().requires_grad_()
    scores = scores_TK.clone().requires_grad_()
    grouping = []
    hidden = moe_block(dispatcher, x, scores, ids_TK, weights[0], grouping, weight_rows)
    out = moe_block(dispatcher, hidden, scores.flip(0), ids_TK.flip(0), weights[1], grouping, weight_rows)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out))
    return (out.detach(), x.grad, scores.grad, weights.grad), grouping


def assert_dispatch_outputs_aligned_and_per_pair(mesh) -> None:
    """Each output of the dispatch op starts on a 16-byte boundary, as Inductor asserts of a custom
    op's outputs when it compiles around one. Selective activation checkpointing keeps these
    outputs: the tokens among them are one row per (source rank, token) pair, never one per expert
    row (rank 0, whose experts are the most routed to, receives more expert rows than pairs)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_TD, scores_TK, ids_TK = routing(rank, torch.float32)
    group_name = mesh.get_group().group_name
    outputs = torch.ops.torchtitan_ext.symm_mem_dispatch(x_TD, scores_TK, ids_TK, group_name, NUM_EXPERTS, TOP_K, False)
    offsets = [output.storage_offset() * output.element_size() for output in outputs]
    assert all(offset % 16 == 0 for offset in offsets), offsets
    pairs_PD, row_count_R0, *_ = outputs
    assert pairs_PD.shape == (world * TOKENS, DIM)
    assert row_count_R0.numel() == 0
    assert all(output.numel() <= pairs_PD.numel() for output in outputs)
    if rank == 0:
        assert row_count_R0.shape[0] > world * TOKENS, row_count_R0.shape


def assert_unweighted_combine_keeps_no_expert_rows(mesh, transport: EPTransport) -> None:
    """The combine of rows the experts weighted keeps no expert output for backward; the weighted
    combine keeps it (for the score gradient), so the check can tell them apart."""
    dispatcher = RoutingDispatcher(
        RoutingDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K, permute_backend="triton", ep_transport=transport)
    )
    dispatcher.wire_meshes(ep_mesh=mesh)
    x_TD, scores_TK, ids_TK = routing(dist.get_rank(), torch.float32)
    scores_TK.requires_grad_()
    counts_E = torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS + 1)[:NUM_EXPERTS]
    rows_RD, _, metadata = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    expert_out_RD = rows_RD.detach().clone().requires_grad_()

    def kept_for_backward(combine) -> set[int]:
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            combine(expert_out_RD, metadata, x_TD)
        return {t.untyped_storage().data_ptr() for t in kept if t.numel()}

    expert_rows = expert_out_RD.untyped_storage().data_ptr()
    kept_by_combine, kept_by_sum_rows = kept_for_backward(dispatcher.combine), kept_for_backward(dispatcher.sum_rows)
    if expert_out_RD.numel():  # every rank exchanges; the last rank's experts at W=4 receive no row
        assert expert_rows in kept_by_combine, f"{transport}: the weighted combine keeps its rows"
        assert expert_rows not in kept_by_sum_rows, f"{transport}: sum_rows keeps the expert rows"


def exchange_worker(rank: int, world: int, port: int) -> None:
    with gloo_ep_mesh(rank, world, port) as mesh:
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            for align_size in (1, 4):
                expected, expected_grouping = run_two_layers(mesh, "all_to_all", align_size, dtype)
                actual, grouping = run_two_layers(mesh, "symm_mem", align_size, dtype)
                # the same groups (padding included) and padding rows: last_num_padding_rows
                assert grouping == expected_grouping, (rank, align_size, grouping, expected_grouping)
                assert all(size % align_size == 0 for sizes, _ in grouping for size in sizes), grouping
                assert align_size > 1 or not any(padding for _, padding in grouping), grouping
                for name, e, a in zip(("output", "x grad", "score grad", "weight grad"), expected, actual):
                    what = f"rank {rank}/{world} {dtype} align {align_size} {name}"
                    torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m, what=what: f"{what}: {m}")
            for transport in ("symm_mem", "all_to_all"):
                exact, _ = run_two_layers(mesh, transport, 1, dtype)
                for receive_rows, weight_rows in (("static", False), ("exact", True), ("static", True)):
                    with fresh_buffers_hold_nan():  # what nobody writes (static rows past the received ones) is NaN
                        other, _ = run_two_layers(mesh, transport, 1, dtype, receive_rows, weight_rows)
                    for name, e, a in zip(("output", "x grad", "score grad", "weight grad"), exact, other):
                        what = f"{transport} {receive_rows} rows{' weighted by the experts' * weight_rows} {name}"
                        torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m, what=what: f"{what}: {m}")
        assert_dispatch_outputs_aligned_and_per_pair(mesh)
        for transport in ("symm_mem", "all_to_all"):
            assert_unweighted_combine_keeps_no_expert_rows(mesh, transport)


@needs_triton
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the CPU stand-in of symm_mem (shared-memory files, Triton's interpreter, gloo); on GPUs "
    "`torchrun --nproc_per_node=N -m torchtitan_ext.bench ep --check` checks both transports "
    "(scripts/measure_on_gpu.sh ep2)",
)
@pytest.mark.parametrize("world", [2, 4])
def test_symm_mem_transport_equals_nccl_transport(world):
    spawn_workers(exchange_worker, world, world, free_port())


def test_symm_mem_start_up_errors(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert symm_mem_errors(1) == [] and symm_mem_errors(4) == []
    (error,) = symm_mem_errors(8)
    assert "needs every rank of an EP group on one host" in error and "(4)" in error
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")  # ranks 4-7 of an EP group of 4 would span two hosts
    (error,) = symm_mem_errors(4)
    assert "processes per host (6) are not a multiple of expert_parallel_degree (4)" in error
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")
        (error,) = symm_mem_errors(2)
        assert error.startswith("moe.ep_transport = 'symm_mem': its exchange runs Triton kernels"), error
        assert "needs CUDA GPUs (not available here), or CPU processes with TRITON_INTERPRET=1" in error
        assert error.endswith("on CPU use moe.ep_transport = 'all_to_all'")


def test_unknown_ep_transport_is_rejected():
    with pytest.raises(
        ValueError, match="ep_transport = 'nvlink': not one of the valid choices: auto, all_to_all, symm_mem"
    ):
        # pyrefly: ignore[bad-argument-type]  # an invalid transport on purpose: the test checks it is refused
        RoutingDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K, ep_transport="nvlink")


def test_gpus_that_cannot_map_each_others_memory_name_the_nccl_transport(monkeypatch):
    from torch.distributed import _symmetric_memory

    from torchtitan_ext.experiments.moe_backends.ep_symm_mem import CudaSymmetricWorkspace

    def refuse(tensor, group):
        raise RuntimeError("CUDA driver error: peer access is not supported between these two devices")

    monkeypatch.setattr(_symmetric_memory, "empty", lambda nbytes, dtype, device: torch.empty(nbytes, dtype=dtype))
    monkeypatch.setattr(_symmetric_memory, "rendezvous", refuse)
    workspace = object.__new__(CudaSymmetricWorkspace)
    with pytest.raises(
        RuntimeError, match=r"could not map the EP peers' GPU memory .*peer access.*ep_transport all_to_all"
    ):
        workspace._map(None, 64, torch.device("cpu"))
