"""The kernels' ``torch.library`` ops: schemas, fake (meta) implementations and autograd formulas
checked by ``torch.library.opcheck``, and each public entry point compiled with
``torch.compile(fullgraph=True)`` giving eager's forward and gradients bit for bit.

CPU tensors run the Triton kernels through the interpreter (TRITON_INTERPRET=1, set by conftest
without CUDA); fp32, tiny shapes.
"""

import pytest
import torch

from torchtitan_ext.kernels import moe_permute
from torchtitan_ext.kernels.availability import interpreter_enabled
from torchtitan_ext.kernels.fused_moe import fused_moe_grouped, fused_moe_routed
from torchtitan_ext.kernels.swiglu_experts import (
    swiglu_experts_backward,
    swiglu_experts_forward,
    swiglu_experts_preactivations,
)
from torchtitan_ext.kernels.topk_routing import topk_routing

pytestmark = pytest.mark.skipif(
    not (interpreter_enabled() or torch.cuda.is_available()), reason="the Triton kernels need CUDA or the interpreter"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_TOKENS, DIM, HIDDEN, NUM_EXPERTS, TOP_K = 12, 40, 24, 4, 2
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def weights(seed: int) -> list[torch.Tensor]:
    g = generator(seed)
    shapes = ((NUM_EXPERTS, HIDDEN, DIM), (NUM_EXPERTS, DIM, HIDDEN), (NUM_EXPERTS, HIDDEN, DIM))
    return [(torch.randn(*shape, generator=g, device=DEVICE) * shape[-1] ** -0.5).requires_grad_() for shape in shapes]


def routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_TD, topk_expert_ids_TK, topk_scores_TK)``; the tokens and scores require grad."""
    g = generator(seed)
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=g, device=DEVICE)
    scores, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    x = torch.randn(NUM_TOKENS, DIM, generator=g, device=DEVICE).requires_grad_()
    return x, ids, scores.detach().requires_grad_()


def routed_op_args(seed: int, keep_for_backward: bool = True) -> tuple:
    x, ids, scores = routing(seed)
    row_slot, slot_row, group_end = moe_permute.routing_metadata(ids, NUM_EXPERTS)
    return (x, *weights(seed), group_end, row_slot, slot_row, scores.reshape(-1), TOP_K, keep_for_backward)


def grouped_op_args(seed: int, keep_for_backward: bool = True) -> tuple:
    """Every row belongs to an expert: rows after the experts' have unset outputs, which opcheck,
    comparing outputs, cannot take (test_kernels_fused_moe checks them)."""
    g = generator(seed)
    counts = torch.tensor([5, 0, 9, 6], device=DEVICE)
    x = torch.randn(int(counts.sum()), DIM, generator=g, device=DEVICE).requires_grad_()
    return (x, *weights(seed), counts.cumsum(0).to(torch.int32), None, None, None, 1, keep_for_backward)


def grouped_recomputing_op_args(seed: int) -> tuple:
    """A grouped forward that keeps no pre-activations: its backward recomputes them."""
    return grouped_op_args(seed, keep_for_backward=False)


@pytest.mark.parametrize(
    "make_args",
    [routed_op_args, grouped_op_args, grouped_recomputing_op_args],
    ids=["routed", "grouped", "grouped_recomputing"],
)
def test_swiglu_experts_forward_op(make_args):
    torch.library.opcheck(swiglu_experts_forward, make_args(0), test_utils=OPCHECK_TESTS)


def test_swiglu_experts_preactivations_op():
    x, w1, _, w3, group_end, *_ = grouped_op_args(3)
    torch.library.opcheck(swiglu_experts_preactivations, (x.detach(), w1.detach(), w3.detach(), group_end))


def test_swiglu_experts_backward_op():
    _, w1, w2, w3, group_end, row_slot, slot_row, scores, top_k, _ = routed_op_args(1)
    _, x_RD, gate, up = swiglu_experts_forward(*routed_op_args(1))
    dout = torch.randn(NUM_TOKENS, DIM, device=DEVICE)
    args = (dout, x_RD, w1, w2, w3, group_end, row_slot, slot_row, scores, gate, up, top_k, [True] * 5)
    torch.library.opcheck(swiglu_experts_backward, tuple(a.detach() if torch.is_tensor(a) else a for a in args))


def test_routing_and_row_ops():
    x, ids, scores = routing(2)
    torch.library.opcheck(torch.ops.torchtitan_ext.routing_metadata.default, (ids.reshape(-1), NUM_EXPERTS, None))
    plan = moe_permute.routing_metadata(ids, NUM_EXPERTS)
    dest_row = plan[1]
    num_rows = NUM_TOKENS * TOP_K + 3
    rows = torch.randn(num_rows, DIM, device=DEVICE, requires_grad=True)
    for op, args in (
        (torch.ops.torchtitan_ext.permute_rows.default, (x, dest_row, TOP_K, num_rows, True)),
        (torch.ops.torchtitan_ext.sum_rows.default, (rows, dest_row, TOP_K)),
        (torch.ops.torchtitan_ext.weighted_sum_rows.default, (rows, dest_row, scores.reshape(-1), TOP_K, True)),
    ):
        torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_topk_routing_op(score_func):
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, device=DEVICE, requires_grad=True)
    bias = torch.randn(NUM_EXPERTS, device=DEVICE)
    torch.library.opcheck(
        torch.ops.torchtitan_ext.topk_routing.default,
        (logits, bias, TOP_K, score_func, True, 2.5),
        test_utils=OPCHECK_TESTS,
    )


def forward_and_gradients(fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    differentiable = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    loss = torch.stack(
        [(out.float() * (index + 1)).sum() for index, out in enumerate(outputs) if out.is_floating_point()]
    ).sum()
    return [*(out.detach() for out in outputs), *torch.autograd.grad(loss, differentiable)]


def routed_inputs(seed: int) -> list:
    x, ids, scores = routing(seed)
    return [x, *weights(seed), ids, scores]


def grouped_inputs(seed: int) -> list:
    x, *rest = grouped_op_args(seed)[:5]
    counts = torch.tensor([5, 0, 9, 6], device=DEVICE)
    return [x, *rest[:3], counts]


def gate_logits(seed: int) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=generator(seed), device=DEVICE).requires_grad_()


def routed_topk(logits):
    return topk_routing(logits, None, TOP_K, "softmax", True, 1.0)


def permute_round_trip(x, scores):
    ids = torch.arange(NUM_TOKENS * TOP_K, device=x.device).remainder(NUM_EXPERTS).view(NUM_TOKENS, TOP_K)
    _, dest_row, _ = moe_permute.routing_metadata(ids, NUM_EXPERTS)
    rows = moe_permute.permute_tokens(x, dest_row, TOP_K, NUM_TOKENS * TOP_K)
    return moe_permute.unpermute_tokens(rows * 2, dest_row, scores.reshape(-1), TOP_K) + moe_permute.sum_token_rows(
        rows, dest_row, TOP_K
    )


CASES = {
    "fused_moe_routed": (fused_moe_routed, routed_inputs),
    "fused_moe_grouped": (fused_moe_grouped, grouped_inputs),
    "topk_routing": (
        routed_topk,
        lambda seed: [gate_logits(seed)],
    ),
    "permute_round_trip": (permute_round_trip, lambda seed: [routing(seed)[0], routing(seed)[2]]),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_equals_eager(case, backend):
    """fullgraph=True: no graph break anywhere in the entry point; the compiled forward and gradients
    are eager's bit for bit (the ops run the same kernels)."""
    fn, make_inputs = CASES[case]
    torch._dynamo.reset()
    eager = forward_and_gradients(fn, make_inputs(3))
    compiled = forward_and_gradients(torch.compile(fn, backend=backend, fullgraph=True), make_inputs(3))
    assert len(eager) == len(compiled)
    for expected, actual in zip(eager, compiled):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
