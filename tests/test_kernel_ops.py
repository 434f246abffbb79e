"""The kernels' ``torch.library`` ops: schemas, fake (meta) implementations and autograd formulas
checked by ``torch.library.opcheck`` (every op of the namespace), and each public entry point compiled with
``torch.compile(fullgraph=True)`` giving eager's forward and gradients bit for bit.

CPU tensors run the Triton kernels through the interpreter (TRITON_INTERPRET=1, set by conftest
without CUDA); fp32, tiny shapes.
"""

import importlib

import pytest
import torch

from torchtitan_ext.experiments.moe_backends.fp8_experts import fp8_gemms_unavailable_reason
from torchtitan_ext.experiments.moe_backends.grouped_matmul import grouped_mm
from torchtitan_ext.kernels import moe_permute
from torchtitan_ext.kernels.availability import interpreter_enabled
from torchtitan_ext.kernels.fp8_grouped_gemm import fp8_grouped_gemm
from torchtitan_ext.kernels.fp8_quantize import (
    permute_quantize_rows,
    quantize_activation_rows,
    quantize_rows,
    quantize_rows_transposed,
)
from torchtitan_ext.kernels.fp8_swiglu import swiglu_backward_quantize_rows, swiglu_quantize_rows
from torchtitan_ext.kernels.fused_moe import fused_moe_grouped, fused_moe_routed
from torchtitan_ext.kernels.library_ops import NAMESPACE, kernel_op
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
FP8_OPCHECK_TESTS = OPCHECK_TESTS[1:]
"""opcheck's tests but its schema test, for ops with e4m3 outputs (``assert_no_output_aliases_an_input``)."""


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


def test_backward_ops():
    """The ops the autograd formulas call: the weighted sum's backward (every row with a slot, so no
    row is left unwritten) and the router's."""
    x, ids, scores = routing(4)
    _, dest_row, _ = moe_permute.routing_metadata(ids, NUM_EXPERTS)
    rows = torch.randn(NUM_TOKENS * TOP_K, DIM, generator=generator(5), device=DEVICE)
    torch.library.opcheck(
        torch.ops.torchtitan_ext.weighted_sum_rows_backward.default,
        (rows, dest_row, scores.detach().reshape(-1), x.detach(), TOP_K, False),
        test_utils=OPCHECK_TESTS,
    )
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=generator(6), device=DEVICE)
    grad_topk = torch.randn(NUM_TOKENS, TOP_K, generator=generator(7), device=DEVICE)
    torch.library.opcheck(
        torch.ops.torchtitan_ext.topk_routing_backward.default,
        (logits.softmax(-1), ids, grad_topk, None, "softmax", True, 2.5),
        test_utils=OPCHECK_TESTS,
    )


@pytest.mark.skipif(
    not interpreter_enabled() and fp8_gemms_unavailable_reason() is not None, reason="FP8 kernels need SM90+"
)
def test_fp8_ops():
    """The FP8 experts' quantisation, SwiGLU and GEMM ops, every row in an expert's group (the rows after the
    groups are left unwritten, which opcheck, comparing outputs, cannot take)."""
    g = generator(8)
    w_parts = [torch.randn(NUM_EXPERTS, HIDDEN, DIM, generator=g, device=DEVICE) for _ in range(2)]
    parts = [torch.randn(NUM_TOKENS, HIDDEN, generator=g, device=DEVICE) for _ in range(2)]
    group_end = torch.tensor([3, 3, 8, NUM_TOKENS], dtype=torch.int32, device=DEVICE)
    a_values, a_inverse = quantize_activation_rows([parts[0]], group_end)
    w_values, w_inverse = quantize_rows(w_parts)
    gate_up = torch.cat(parts, dim=1)
    scores = torch.rand(NUM_TOKENS, generator=g, device=DEVICE)
    dest_rows = torch.randperm(2 * NUM_TOKENS, generator=g, device=DEVICE).to(torch.int32)
    for op, args in (
        (permute_quantize_rows, (parts[0], dest_rows, 2, 2 * NUM_TOKENS)),
        (swiglu_quantize_rows, (gate_up, scores, group_end)),
        (swiglu_quantize_rows, (gate_up, None, group_end)),
        (swiglu_backward_quantize_rows, (parts[0], gate_up, scores, group_end)),
        (swiglu_backward_quantize_rows, (parts[0], gate_up, None, group_end)),
        (quantize_rows, (w_parts,)),
        (quantize_rows_transposed, (w_parts, w_inverse.amax(1, keepdim=True), parts[0])),
        (quantize_activation_rows, (parts, group_end)),
        (fp8_grouped_gemm, (a_values, a_inverse, w_values, w_inverse, group_end, torch.float32)),
    ):
        torch.library.opcheck(op, args, test_utils=FP8_OPCHECK_TESTS)
        assert_no_output_aliases_an_input(op(*args), args)


def assert_no_output_aliases_an_input(outputs, args) -> None:
    """The schemas' aliasing rule, checked directly where opcheck's schema test cannot run (it computes on
    the outputs, and torch has no arithmetic on e4m3 tensors)."""
    inputs = [t for arg in args for t in (arg if isinstance(arg, list) else [arg]) if torch.is_tensor(t)]
    input_storages = {t.untyped_storage().data_ptr() for t in inputs}
    for out in outputs if isinstance(outputs, tuple) else (outputs,):
        assert out.untyped_storage().data_ptr() not in input_storages


def test_grouped_mm_op():
    """``torch._grouped_mm`` as the differentiable op every dtype compiles through, in both forms."""
    g = generator(9)
    a = torch.randn(NUM_TOKENS, DIM, generator=g, device=DEVICE, requires_grad=True)
    b = torch.randn(NUM_EXPERTS, DIM, HIDDEN, generator=g, device=DEVICE, requires_grad=True)
    offsets = torch.tensor([3, 3, 8, NUM_TOKENS], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(grouped_mm, (a, b, offsets), test_utils=OPCHECK_TESTS)
    grad_y = torch.randn(NUM_TOKENS, HIDDEN, generator=g, device=DEVICE)
    torch.library.opcheck(grouped_mm, (a.detach().T, grad_y, offsets), test_utils=OPCHECK_TESTS)


OPCHECKED_HERE = {
    "swiglu_experts_forward", "swiglu_experts_backward", "swiglu_experts_preactivations", "routing_metadata",
    "permute_rows", "sum_rows", "weighted_sum_rows", "weighted_sum_rows_backward", "topk_routing",
    "topk_routing_backward", "quantize_rows", "quantize_rows_transposed", "quantize_activation_rows",
    "fp8_grouped_gemm", "permute_quantize_rows", "swiglu_quantize_rows", "swiglu_backward_quantize_rows", "grouped_mm",
}  # fmt: skip
"""The ops the tests above hold to ``opcheck``."""
SYMM_MEM_OPS = {
    "symm_mem_dispatch", "symm_mem_combine", "symm_mem_combine_backward", "symm_mem_sum_rows_backward",
    "symm_mem_row_scores", "symm_mem_row_scores_backward",
}  # fmt: skip
"""The ``symm_mem`` transport's ops, which need a process group of GPUs with symmetric memory: held to
the plain-torch exchange on gloo and GPUs by test_ep_symm_mem.py instead."""


TEST_OP_PREFIX = "test_only_"
"""Ops the tests define themselves, which the namespace check leaves out."""


def test_every_op_of_the_namespace_is_checked():
    """``kernel_op`` registers the functions themselves as kernels, with no per-call check that an output
    aliases no input (``custom_op``'s): opcheck's schema test holds that rule, so every op of the
    namespace must be opchecked here (or be named as tested elsewhere)."""
    importlib.import_module("torchtitan_ext.experiments.moe_backends.ep_symm_mem")
    defined = {
        name.removeprefix(f"{NAMESPACE}::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith(f"{NAMESPACE}::") and not name.startswith(f"{NAMESPACE}::{TEST_OP_PREFIX}")
    }
    assert defined == OPCHECKED_HERE | SYMM_MEM_OPS


def test_kernel_op_defines_an_op_from_the_type_hints():
    """The schema from the hints (defaults included), the pt2-compliant tag, the function as the kernel,
    and torch.library's fake and autograd registrations working on the op, eager and compiled."""

    @kernel_op(f"{TEST_OP_PREFIX}scaled")
    def scaled(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    torch.library.register_fake(scaled, lambda x, factor: torch.empty_like(x))
    torch.library.register_autograd(scaled, lambda ctx, grad: (grad * ctx.factor, None), setup_context=setup_context)
    assert str(scaled._schema) == f"{NAMESPACE}::{TEST_OP_PREFIX}scaled(Tensor x, float factor=2.) -> Tensor"
    assert torch.Tag.pt2_compliant_tag in scaled.tags
    x = torch.randn(5, device=DEVICE, requires_grad=True)
    torch.library.opcheck(scaled, (x, 3.0), test_utils=OPCHECK_TESTS)
    compiled = torch.compile(lambda t: scaled(t, 3.0), backend="aot_eager", fullgraph=True)(x)
    (grad,) = torch.autograd.grad(compiled.sum(), x)
    assert torch.equal(compiled, x * 3.0) and torch.equal(grad, torch.full_like(x, 3.0))


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
