"""GPU checks of the fused MoE kernels at realistic shapes, bf16 and fp16 (skipped without CUDA).

Every output and gradient buffer the kernels allocate is poisoned with NaN first, so rows a
kernel forgets to write show up as NaN.
"""

import pytest
import torch
from helpers import assert_weight_gradient_matches

from torchtitan_ext.bench.common import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# relative-norm error against an fp32 reference on the same (rounded) inputs
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def poison_allocator():
    """Fill the caching allocator's free memory with NaN so fresh torch.empty buffers hold NaN."""
    free, _ = torch.cuda.mem_get_info()
    block = torch.empty(int(min(free * 0.5, 8 * 2**30)) // 4, device="cuda", dtype=torch.float32)
    block.fill_(float("nan"))
    del block


def make_weights(num_experts, dim, hidden, dtype):
    scale = dim**-0.5
    return [
        (torch.randn(num_experts, hidden, dim, device="cuda") * scale).to(dtype).requires_grad_(),
        (torch.randn(num_experts, dim, hidden, device="cuda") * hidden**-0.5).to(dtype).requires_grad_(),
        (torch.randn(num_experts, hidden, dim, device="cuda") * scale).to(dtype).requires_grad_(),
    ]


def fp32_copies(tensors):
    return [t.detach().float().requires_grad_() for t in tensors]


def check_all(fused, fused_inputs, reference, reference_inputs, dtype, expert_rows: int | None = None):
    """Forward and every gradient against the fp32 reference, fresh buffers poisoned with NaN. With
    ``expert_rows`` (grouped rows), the output and the row-indexed gradients (x, scores) are compared
    on the experts' rows only: the rows after them are unset (``ExpertCompute``)."""
    poison_allocator()
    out = fused(*fused_inputs)
    grad_out = torch.randn_like(out)
    differentiable = [t for t in fused_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out, differentiable, grad_out)
    expected = reference(*reference_inputs)
    reference_differentiable = [t for t in reference_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    expected_grads = torch.autograd.grad(expected, reference_differentiable, grad_out.float())
    rows = slice(expert_rows)
    assert out.dtype == dtype
    assert torch.isfinite(out[rows]).all()
    assert relative_error(out[rows], expected[rows]) < TOLERANCE[dtype]
    for grad, expected_grad, tensor in zip(grads, expected_grads, differentiable):
        assert grad.dtype == tensor.dtype
        compared = slice(None) if tensor.dim() == 3 else rows  # weights whole, x and scores by row
        assert torch.isfinite(grad[compared]).all()
        assert relative_error(grad[compared], expected_grad[compared]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("skew", [0.0, 3.0])
@pytest.mark.parametrize("tokens,dim,hidden,num_experts,top_k", [(2048, 1024, 704, 16, 4), (1000, 520, 360, 8, 2)])
def test_routed_matches_reference(dtype, skew, tokens, dim, hidden, num_experts, top_k):
    from torchtitan_ext.kernels.fused_moe import fused_moe_routed, reference_routed

    torch.manual_seed(0)
    logits = torch.randn(tokens, num_experts, device="cuda") + torch.linspace(skew, 0, num_experts, device="cuda")
    scores, ids = logits.softmax(-1).topk(top_k, dim=-1)
    x = torch.randn(tokens, dim, device="cuda").to(dtype).requires_grad_()
    scores = scores.to(dtype).requires_grad_()
    weights = make_weights(num_experts, dim, hidden, dtype)
    fused_inputs = [x, *weights, ids, scores]
    reference_inputs = [*fp32_copies([x, *weights]), ids, *fp32_copies([scores])]
    check_all(fused_moe_routed, fused_inputs, reference_routed, reference_inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts", [[700, 0, 1, 300, 129, 0, 512, 5], [0] * 7 + [1300], [100] * 8 + [0, 0]])
def test_grouped_matches_reference(dtype, counts):
    from torchtitan_ext.kernels.fused_moe import fused_moe_grouped, reference_grouped

    torch.manual_seed(1)
    num_rows, dim, hidden = 1700, 1024, 704
    counts_E = torch.tensor(counts, device="cuda")
    x = torch.randn(num_rows, dim, device="cuda").to(dtype).requires_grad_()
    weights = make_weights(len(counts), dim, hidden, dtype)
    fused_inputs = [x, *weights, counts_E]
    reference_inputs = [*fp32_copies([x, *weights]), counts_E]
    check_all(fused_moe_grouped, fused_inputs, reference_grouped, reference_inputs, dtype, expert_rows=sum(counts))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,hidden", [(1024, 704), (2048, 4096)])
def test_row_weighted_grouped_matches_reference(dtype, dim, hidden):
    """Rows weighted in the down projection (expert parallelism's path), with the one-kernel and
    the two-pass gate/up forward; trailing rows belong to no expert."""
    from torchtitan_ext.kernels.fused_moe import fused_moe_row_weighted, reference_row_weighted

    torch.manual_seed(5)
    counts = [300, 0, 1, 129, 512, 5]
    counts_E = torch.tensor(counts, device="cuda")
    num_rows = sum(counts) + 53
    x = torch.randn(num_rows, dim, device="cuda").to(dtype).requires_grad_()
    scores = torch.rand(num_rows, device="cuda").requires_grad_()
    weights = make_weights(len(counts), dim, hidden, dtype)
    fused_inputs = [x, *weights, counts_E, scores]
    reference_inputs = [*fp32_copies([x, *weights]), counts_E, *fp32_copies([scores])]
    check_all(
        fused_moe_row_weighted, fused_inputs, reference_row_weighted, reference_inputs, dtype, expert_rows=sum(counts)
    )


def test_fp32_weights_bf16_activations():
    from torchtitan_ext.kernels.fused_moe import fused_moe_routed, reference_routed

    torch.manual_seed(2)
    tokens, dim, hidden, num_experts, top_k = 512, 512, 384, 8, 2
    scores, ids = torch.randn(tokens, num_experts, device="cuda").softmax(-1).topk(top_k, dim=-1)
    x = torch.randn(tokens, dim, device="cuda").bfloat16().requires_grad_()
    w1, w2, w3 = (w.detach().float().requires_grad_() for w in make_weights(num_experts, dim, hidden, torch.bfloat16))
    scores = scores.requires_grad_()
    out = fused_moe_routed(x, w1, w2, w3, ids, scores)
    grads = torch.autograd.grad(out, [x, w1, w2, w3, scores], torch.ones_like(out))
    assert out.dtype == torch.bfloat16
    assert [g.dtype for g in grads] == [torch.bfloat16] + [torch.float32] * 4
    w1_ref, w2_ref, w3_ref = (w.bfloat16().float() for w in (w1, w2, w3))
    expected = reference_routed(x.float(), w1_ref, w2_ref, w3_ref, ids, scores)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


def test_deterministic():
    from torchtitan_ext.kernels.fused_moe import fused_moe_routed

    torch.manual_seed(3)
    tokens, dim, hidden, num_experts, top_k = 1024, 512, 384, 8, 8
    scores, ids = torch.randn(tokens, num_experts, device="cuda").softmax(-1).topk(top_k, dim=-1)
    x = torch.randn(tokens, dim, device="cuda").bfloat16().requires_grad_()
    w1, w2, w3 = make_weights(num_experts, dim, hidden, torch.bfloat16)
    scores = scores.bfloat16().requires_grad_()
    results = []
    for _ in range(2):
        out = fused_moe_routed(x, w1, w2, w3, ids, scores)
        results.append([out, *torch.autograd.grad(out, [x, w1, w2, w3, scores], torch.ones_like(out))])
    for first, second in zip(*results):
        assert torch.equal(first, second)


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts", [(8192, 8, 128), (8192, 2, 8), (3001, 6, 64), (777, 4, 1000)]
)
def test_routing_metadata_kernels_match_the_reference(num_tokens, top_k, num_experts):
    """The grouping kernels on CUDA (several programs, dropped slots, poisoned outputs) against
    the per-expert loop."""
    from torchtitan_ext.kernels.moe_permute import reference_routing_metadata, routing_metadata

    generator = torch.Generator("cuda").manual_seed(4)
    ids = torch.randint(0, num_experts + 1, (num_tokens, top_k), device="cuda", generator=generator)
    ids[: num_tokens // 3, 0] = 1
    poison_allocator()
    actual = routing_metadata(ids, num_experts)
    for got, expected in zip(actual, reference_routing_metadata(ids.cpu(), num_experts)):
        assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize(
    "dtype, out_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize("size_m, size_n", [(768, 2048), (2048, 768), (1408, 2048), (256, 200), (128, 704)])
def test_hopper_weight_gradient_is_the_triton_kernels_bit_for_bit(dtype, out_dtype, size_m, size_n, monkeypatch):
    """The Gluon weight-gradient kernel against the Triton one and an fp64 reference: partial and
    exact 64-row steps, empty and one-row experts, trailing unassigned rows, N below and past a tile,
    and an fp32 output (the gradient of fp32 weights under autocast)."""
    from torchtitan_ext.kernels import hopper_weight_gradient, swiglu_passes

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon weight-gradient kernel runs on Hopper GPUs")
    if hopper_weight_gradient.TRITON_MINOR not in hopper_weight_gradient.VERIFIED_TRITON:
        pytest.skip(
            f"triton {hopper_weight_gradient.TRITON_MINOR} is not among {hopper_weight_gradient.VERIFIED_TRITON}"
        )
    torch.manual_seed(4)
    counts = [0, 37, 512, 1, 0, 300, 64, 95, 128]
    group_end_E = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    a_RM = torch.randn(sum(counts) + 40, size_m, device="cuda").to(dtype)
    b_RN = torch.randn(sum(counts) + 40, size_n, device="cuda").to(dtype)
    a_RM[sum(counts) :] = float("nan")  # trailing rows nobody wrote may hold anything
    b_RN[sum(counts) :] = float("nan")
    gluon_out = torch.full((len(counts), size_m, size_n), float("nan"), device="cuda", dtype=out_dtype)
    assert hopper_weight_gradient.usable(a_RM, b_RN, gluon_out)
    hopper_weight_gradient.weight_gradient(a_RM, b_RN, group_end_E, gluon_out)
    monkeypatch.setattr(hopper_weight_gradient, "usable", lambda *tensors: False)
    triton_out = torch.full_like(gluon_out, float("nan"))
    swiglu_passes._weight_gradient(a_RM, b_RN, group_end_E, triton_out)
    assert torch.equal(gluon_out, triton_out)
    assert_weight_gradient_matches(gluon_out, a_RM, b_RN, counts, TOLERANCE[dtype])
