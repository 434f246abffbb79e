"""Local token dispatch: grouping, align_size padding, dropped slots, torch vs Triton permute.

The Triton checks run on CUDA where there is one; otherwise in a subprocess with
``TRITON_INTERPRET=1`` (the interpreter is chosen when the kernels are defined), on CPU. fp32
and fp16 either way.
"""

import os
import subprocess
import sys

import pytest
import torch
from helpers import model_config
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from torchtitan_ext.experiments.moe_backends import grouping
from torchtitan_ext.experiments.moe_backends.dispatcher import PermuteBackend, RoutingDispatcher
from torchtitan_ext.experiments.moe_backends.grouping import (
    padded_group_rows,
    padded_num_rows,
    pair_rows,
    plan_slots,
)
from torchtitan_ext.experiments.moe_backends.startup_checks import parallelism_errors
from torchtitan_ext.experiments.moe_backends.transports import (
    AllToAllTransport,
    LocalTransport,
    PaddedSymmMemTransport,
    SymmMemTransport,
)
from torchtitan_ext.kernels import moe_permute
from torchtitan_ext.registry import get_flavor

NUM_EXPERTS, TOP_K, DIM = 6, 2, 5


def routing(num_tokens: int, seed: int = 0, drop_every: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(num_tokens, DIM, generator=generator)
    ids_TK = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(num_tokens)])
    scores_TK = torch.rand(num_tokens, TOP_K, generator=generator)
    if drop_every:
        dropped = torch.arange(ids_TK.numel()).view_as(ids_TK) % drop_every == 0
        ids_TK = torch.where(dropped, NUM_EXPERTS, ids_TK)
        scores_TK = torch.where(dropped, 0.0, scores_TK)
    counts_E = torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS + 1)[:NUM_EXPERTS]
    return x_TD, scores_TK, ids_TK, counts_E


def per_expert_linear(rows_RD, rows_per_expert_E, weights_EDD):
    """A stand-in expert: row r of expert e -> rows_RD[r] @ weights_EDD[e] (zero rows stay zero); the rows
    after the groups belong to no expert and get NaN, so a combine that read one would spread it."""
    expert_G = torch.repeat_interleave(torch.arange(len(rows_per_expert_E), device=rows_RD.device), rows_per_expert_E)
    grouped_GD, after_groups_RD = rows_RD.split([expert_G.shape[0], rows_RD.shape[0] - expert_G.shape[0]])
    return torch.cat([torch.einsum("rd,rde->re", grouped_GD, weights_EDD[expert_G]), after_groups_RD * float("nan")])


def dispatch_combine(dispatcher, x_TD, scores_TK, ids_TK, counts_E, weights_EDD):
    rows_RD, rows_per_expert_E, metadata = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    out_TD = dispatcher.combine(per_expert_linear(rows_RD, rows_per_expert_E, weights_EDD), metadata, x_TD)
    return rows_RD, rows_per_expert_E, out_TD


def dispatcher(align_size: int = 1, permute_backend: PermuteBackend = "torch") -> RoutingDispatcher:
    return RoutingDispatcher(
        RoutingDispatcher.Config(
            num_experts=NUM_EXPERTS, top_k=TOP_K, align_size=align_size, permute_backend=permute_backend
        )
    )


WEIGHTS_EDD = torch.randn(NUM_EXPERTS, DIM, DIM, generator=torch.Generator().manual_seed(9))


def test_local_dispatch_equals_torchtitan():
    x_TD, scores_TK, ids_TK, counts_E = routing(11)
    titan = LocalTokenDispatcher(LocalTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K))
    titan_rows, titan_counts, titan_out = dispatch_combine(titan, x_TD, scores_TK, ids_TK, counts_E, WEIGHTS_EDD)
    rows, counts, out = dispatch_combine(dispatcher(), x_TD, scores_TK, ids_TK, counts_E, WEIGHTS_EDD)
    assert torch.equal(rows, titan_rows) and torch.equal(counts, titan_counts)
    torch.testing.assert_close(out, titan_out)


@pytest.mark.parametrize("align_size", [2, 4, 16])
@pytest.mark.parametrize("drop_every", [0, 3])
def test_padding_never_leaks_into_outputs_or_gradients(align_size, drop_every):
    x_TD, scores_TK, ids_TK, counts_E = routing(9, seed=1, drop_every=drop_every)
    results = []
    for size in (1, align_size):
        x = x_TD.clone().requires_grad_()
        scores = scores_TK.clone().requires_grad_()
        weights = WEIGHTS_EDD.clone().requires_grad_()
        d = dispatcher(size)
        rows, rows_per_expert_E, out = dispatch_combine(d, x, scores, ids_TK, counts_E, weights)
        out.backward(torch.ones_like(out))
        results.append((out, x.grad, scores.grad, weights.grad))
        num_rows = padded_num_rows(ids_TK.numel(), NUM_EXPERTS, size)
        grouped_rows = int(rows_per_expert_E.sum())
        assert rows.shape[0] == num_rows >= grouped_rows
        assert d.last_num_padding_rows is not None
        assert d.last_num_padding_rows.item() == grouped_rows - int(counts_E.sum())
        if size == 1:
            assert grouped_rows == int(counts_E.sum())
        if size > 1:
            assert (rows_per_expert_E % size == 0).all()
            starts = torch.cumsum(rows_per_expert_E, 0) - rows_per_expert_E
            real = torch.cat([torch.arange(s, s + c) for s, c in zip(starts.tolist(), counts_E.tolist())])
            padding = torch.ones(num_rows, dtype=torch.bool)
            padding[real] = False
            assert (rows[padding] == 0).all()
    for unpadded, padded in zip(*results):
        torch.testing.assert_close(padded, unpadded)


class TwoRankMesh:
    """What a transport reads of an EP mesh when it is built: its size."""

    def size(self) -> int:
        return 2


@pytest.mark.parametrize(
    "ep_transport, align_size, expected",
    [
        ("all_to_all", 1, AllToAllTransport),
        ("all_to_all", 4, AllToAllTransport),
        ("symm_mem", 1, SymmMemTransport),
        ("symm_mem", 4, PaddedSymmMemTransport),
    ],
)
def test_dispatcher_delegates_to_the_transport_of_its_config_and_mesh(ep_transport, align_size, expected):
    d = RoutingDispatcher(
        RoutingDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K, align_size=align_size, ep_transport=ep_transport)
    )
    assert type(d.transport) is LocalTransport and d.single_device
    # pyrefly: ignore[bad-argument-type]  # a stand-in: building a transport reads only the mesh's size
    d.wire_meshes(ep_mesh=TwoRankMesh())
    assert type(d.transport) is expected and not d.single_device
    assert (d.transport.ep_size, d.transport.num_local_experts, d.transport.align_size) == (2, 3, align_size)
    assert d.transport.row_ops is d.row_ops
    d.wire_meshes(ep_mesh=None)
    assert type(d.transport) is LocalTransport


def test_dropped_slots_are_not_dispatched():
    _, _, ids_TK, counts_E = routing(7, seed=2, drop_every=2)
    plan = plan_slots(ids_TK, counts_E, 1)
    dropped_S = ids_TK.flatten() == NUM_EXPERTS
    assert (plan.dest_row_S[dropped_S] == -1).all()
    kept_rows = plan.dest_row_S[~dropped_S]
    assert sorted(kept_rows.tolist()) == list(range(int(counts_E.sum())))
    assert plan.num_rows == ids_TK.numel()  # the dropped slots' rows lie after the groups, in no group
    assert torch.equal(plan.rows_per_expert_E, counts_E) and plan.num_padding_rows.item() == 0


@pytest.mark.parametrize("align_size", [1, 2, 4])
@pytest.mark.parametrize("drop_every", [0, 3])
@pytest.mark.parametrize("exact_size", [False, True])
def test_slot_plan_matches_definition(align_size, drop_every, exact_size):
    """Expert e's group starts after the earlier groups, each rounded up to align_size rows; its
    slots fill it in token order; dropped slots get row -1; the rows after the groups are in none."""
    _, _, ids_TK, counts_E = routing(13, seed=4, drop_every=drop_every)
    num_kept = int(counts_E.sum())
    plan = plan_slots(ids_TK, counts_E, align_size, num_kept=num_kept if exact_size else None)
    expected_rows, start = [-1] * ids_TK.numel(), 0
    expected_sizes = []
    for expert in range(NUM_EXPERTS):
        slots = [slot for slot, e in enumerate(ids_TK.flatten().tolist()) if e == expert]
        for place, slot in enumerate(slots):
            expected_rows[slot] = start + place
        size = -(-len(slots) // align_size) * align_size
        expected_sizes.append(size)
        start += size
    assert plan.num_rows >= start
    assert plan.num_rows == padded_num_rows(num_kept if exact_size else ids_TK.numel(), NUM_EXPERTS, align_size)
    assert plan.dest_row_S.tolist() == expected_rows
    assert plan.rows_per_expert_E.tolist() == expected_sizes
    assert plan.num_padding_rows.item() == start - num_kept


@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_pair_rows_match_definition(num_tokens):
    """Pairs (token, rank) reached by a kept slot get consecutive rows, rank-major and in token
    order within a rank; other pairs (no slot there, or only dropped slots) get -1."""
    ep_size, top_k = 3, 2
    generator = torch.Generator().manual_seed(num_tokens)
    rank_TK = torch.randint(0, ep_size + 1, (num_tokens, top_k), generator=generator)  # ep_size: dropped
    if num_tokens:
        rank_TK[0] = ep_size  # a token whose slots are all dropped
    pair_row_TW, sent_rows_W = pair_rows(rank_TK, ep_size)
    expected_TW = [[-1] * ep_size for _ in range(num_tokens)]
    next_row = 0
    for rank in range(ep_size):
        for token in range(num_tokens):
            if rank in rank_TK[token].tolist():
                expected_TW[token][rank] = next_row
                next_row += 1
    assert pair_row_TW.tolist() == expected_TW
    assert sent_rows_W.tolist() == [sum(rank in row for row in rank_TK.tolist()) for rank in range(ep_size)]


def test_reference_permute_matches_definition():
    x_TD, scores_TK, ids_TK, counts_E = routing(5, seed=3, drop_every=4)
    plan = plan_slots(ids_TK, counts_E, 4)
    rows = moe_permute.permute_tokens_reference(x_TD, plan.dest_row_S, TOP_K, plan.num_rows)
    for slot, dest in enumerate(plan.dest_row_S.tolist()):
        if dest >= 0:
            assert torch.equal(rows[dest], x_TD[slot // TOP_K])
    out = moe_permute.unpermute_tokens_reference(rows, plan.dest_row_S, scores_TK.flatten(), TOP_K)
    expected = torch.stack(
        [
            sum((scores_TK[t, k] * x_TD[t] for k in range(TOP_K) if ids_TK[t, k] < NUM_EXPERTS), torch.zeros(DIM))
            for t in range(5)
        ]
    )
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("align_size", [1, 4])
def test_padded_group_rows_keep_each_group_in_order(align_size):
    counts_e = torch.tensor([3, 6, 5])
    arrivals = [(e, i) for e in range(3) for i in range(int(counts_e[e]))]
    dest_row_N, rows_per_expert_e, num_rows = padded_group_rows(counts_e, len(arrivals), align_size)
    assert num_rows == padded_num_rows(len(arrivals), 3, align_size) >= int(rows_per_expert_e.sum())
    assert len(set(dest_row_N.tolist())) == len(arrivals)
    buffer: list[tuple[int, int] | None] = [None] * num_rows
    for arrival, dest in zip(arrivals, dest_row_N.tolist()):
        buffer[dest] = arrival
    start = 0
    for expert, size in enumerate(rows_per_expert_e.tolist()):
        group = [row for row in buffer[start : start + size] if row is not None]
        assert group == [row for row in arrivals if row[0] == expert]  # arrival order
        assert buffer[start : start + len(group)] == group  # real rows first, padding after
        assert size % align_size == 0
        start += size
    assert all(row is None for row in buffer[start:])  # the rows after the groups: in none


def test_parallelism_misconfiguration_is_reported():
    config = get_flavor("tiny-moe-for-loop").build()
    moes = [layer.moe for layer in model_config(config).layers]
    config.parallelism.expert_parallel_degree = 3
    errors = "\n".join(parallelism_errors(config, moes, world_size=4))
    assert "does not divide the world size (4)" in errors
    assert "does not divide the number of experts (8)" in errors
    config.parallelism.expert_parallel_degree = 4
    config.parallelism.tensor_parallel_degree = 2
    errors = "\n".join(parallelism_errors(config, moes, world_size=8))
    assert errors == ""
    config.parallelism.data_parallel_shard_degree = 1
    errors = "\n".join(parallelism_errors(config, moes, world_size=8))
    assert "!= world size 8" in errors
    config.parallelism.data_parallel_shard_degree = -1
    config.parallelism.tensor_parallel_degree = 1
    config.parallelism.context_parallel_degree = 8
    config.parallelism.expert_parallel_degree = 16
    assert "needs at least 16 processes" in "\n".join(parallelism_errors(config, moes, world_size=8))
    assert parallelism_errors(get_flavor("tiny-moe-for-loop").build(), moes, world_size=2) == []


def test_ep_misconfiguration_exits_before_training():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_ext.train",
            "--flavor",
            "tiny-moe-for-loop",
            "--parallelism.expert_parallel_degree",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        "command line: parallelism.expert_parallel_degree = 3: does not divide the number of experts (8)"
        in result.stderr
    )


def triton_checks(device: torch.device) -> None:
    """Triton permute / unpermute / token sum (and as a gather) vs the torch references, and the dispatcher
    with each backend, on ``device``."""

    def on_device(*tensors):
        return [t.to(device) for t in tensors]

    def ramp(out):
        return torch.linspace(-1, 1, out.numel(), device=device).view_as(out)

    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for align_size, drop_every in ((1, 0), (4, 3)):
            x_TD, scores_TK, ids_TK, counts_E = on_device(*routing(7, seed=5, drop_every=drop_every))
            plan = plan_slots(ids_TK, counts_E, align_size)
            grads = []
            for permute, unpermute in (
                (moe_permute.permute_tokens_reference, moe_permute.unpermute_tokens_reference),
                (moe_permute.permute_tokens, moe_permute.unpermute_tokens),
            ):
                x = x_TD.to(dtype).requires_grad_()
                scores = scores_TK.flatten().clone().requires_grad_()
                rows = permute(x, plan.dest_row_S, TOP_K, plan.num_rows)
                rows = rows * 2 + 1  # padding rows become nonzero: they must still not leak
                out = unpermute(rows, plan.dest_row_S, scores, TOP_K)
                out.backward(ramp(out).to(dtype))
                grads.append((rows, out, x.grad, scores.grad))
            for expected, actual in zip(*grads):
                torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)

            grads = []
            for sum_rows in (moe_permute.sum_token_rows_reference, moe_permute.sum_token_rows):
                rows = (torch.arange(plan.num_rows * DIM, dtype=torch.float32, device=device).view(-1, DIM) / 7).to(
                    dtype
                )
                rows.requires_grad_()
                out = sum_rows(rows, plan.dest_row_S, TOP_K)
                out.backward(ramp(out).to(dtype))
                grads.append((out, rows.grad))
            for expected, actual in zip(*grads):
                torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)

        x_TD, _, ids_TK, counts_E = on_device(*routing(7, seed=8, drop_every=3))
        plan = plan_slots(ids_TK, counts_E, 1)
        written_R = plan.dest_row_S[plan.dest_row_S >= 0].long()
        zeroed, unzeroed = (
            moe_permute.permute_tokens(x_TD.to(dtype), plan.dest_row_S, TOP_K, plan.num_rows, zero_padding)
            for zero_padding in (True, False)
        )
        assert torch.equal(unzeroed[written_R], zeroed[written_R])
        scores_S = torch.rand(plan.dest_row_S.shape[0], generator=torch.Generator().manual_seed(3)).to(device)
        rows_grads = []
        for zero_padding in (True, False):
            rows_RD = zeroed.detach().clone().requires_grad_()
            out = moe_permute.unpermute_tokens(rows_RD, plan.dest_row_S, scores_S, TOP_K, zero_padding)
            out.backward(ramp(out).to(dtype))
            rows_grads.append(rows_RD.grad)
        zeroed_grad, unzeroed_grad = rows_grads
        assert zeroed_grad is not None and unzeroed_grad is not None
        assert torch.equal(unzeroed_grad[written_R], zeroed_grad[written_R])
        unwritten_R = torch.ones(plan.num_rows, dtype=torch.bool, device=device)
        unwritten_R[written_R] = False
        assert unwritten_R.any() and not zeroed_grad[unwritten_R].any()

        rows_RD = torch.randn(9, DIM, generator=torch.Generator().manual_seed(7)).to(device, dtype).requires_grad_()
        index_N = torch.tensor([4, 0, 8, 2, 7, 1], device=device)  # one row each, no repeats: a gather
        out = moe_permute.sum_token_rows(rows_RD, index_N, 1)
        out.backward(ramp(out).to(dtype))
        assert torch.equal(out, rows_RD[index_N])
        expected_grad = torch.zeros_like(rows_RD).index_copy(0, index_N, ramp(out).to(dtype))
        assert rows_RD.grad is not None and torch.equal(rows_RD.grad, expected_grad)

    x_TD, scores_TK, ids_TK, counts_E, weights_EDD = on_device(*routing(8, seed=6, drop_every=5), WEIGHTS_EDD)
    results = [
        dispatch_combine(dispatcher(4, backend), x_TD, scores_TK, ids_TK, counts_E, weights_EDD)
        for backend in ("torch", "triton")
    ]
    for expected, actual in zip(*results):
        torch.testing.assert_close(actual, expected)


def test_auto_permute_takes_the_kernels_for_cuda_tokens_only(monkeypatch):
    calls = []
    for name in ("torch", "triton"):
        monkeypatch.setitem(grouping.ROW_OPS[name], "permute_tokens", lambda *args, name=name: calls.append(name))

    class CudaRows:
        is_cuda = True

    auto = dispatcher(permute_backend="auto")
    assert RoutingDispatcher.Config(num_experts=2, top_k=1).permute_backend == "auto"
    # pyrefly: ignore[bad-argument-type]  # stand-ins: the patched permutes record the call and read nothing
    auto.row_ops.permute_rows(torch.zeros(2, 4), None, 1, 2)
    # pyrefly: ignore[bad-argument-type]  # stand-ins: the patched permutes record the call and read nothing
    auto.row_ops.permute_rows(CudaRows(), None, 1, 2)
    # pyrefly: ignore[bad-argument-type]  # stand-ins: the patched permutes record the call and read nothing
    dispatcher(permute_backend="torch").row_ops.permute_rows(CudaRows(), None, 1, 2)
    assert calls == ["torch", "triton", "torch"]


def test_triton_permute_matches_torch():
    if torch.cuda.is_available():
        triton_checks(torch.device("cuda"))
        return
    result = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "triton checks passed" in result.stdout


if __name__ == "__main__":
    triton_checks(torch.device("cpu"))
    print("triton checks passed")
