"""The top-k routing kernels against the plain-torch routing (Triton's interpreter on CPU, or CUDA).

Forward outputs and the gradient of the logits through both differentiable outputs, for
softmax and sigmoid scores, with and without the expert bias, normalisation and scale, on
random logits; plus ties, and the counts.
"""

import pytest
import torch

from torchtitan_ext.kernels.fused_moe import triton_available_reason
from torchtitan_ext.kernels.topk_routing import (
    MAX_EXPERTS,
    topk_routing,
    topk_routing_reference,
    topk_routing_unsupported_reason,
)

pytestmark = pytest.mark.skipif(triton_available_reason() is not None, reason="needs CUDA or TRITON_INTERPRET=1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed_pair(num_tokens, num_experts, top_k, score_func, route_norm, route_scale, with_bias, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_tokens, num_experts, generator=generator) * 2).to(DEVICE)
    bias = (torch.randn(num_experts, generator=generator) * 0.1).to(DEVICE) if with_bias else None
    grads = (
        torch.randn(num_tokens, top_k, generator=generator).to(DEVICE),
        torch.randn(num_tokens, num_experts, generator=generator).to(DEVICE),
    )
    results = []
    for route in (topk_routing, topk_routing_reference):
        leaf = logits.clone().requires_grad_()
        outputs = route(leaf, bias, top_k, score_func, route_norm, route_scale)
        results.append((leaf, outputs))
    return results, grads


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, route_norm, route_scale, with_bias",
    [
        (37, 8, 2, True, 1.0, False),
        (19, 64, 6, False, 2.5, True),
        (5, 130, 8, True, 1.0, True),
        (3, 4, 4, True, 0.5, False),
    ],
)
def test_routing_and_gradients_match_the_reference(
    score_func, num_tokens, num_experts, top_k, route_norm, route_scale, with_bias
):
    (fused, reference), (grad_topk, grad_scores) = routed_pair(
        num_tokens, num_experts, top_k, score_func, route_norm, route_scale, with_bias
    )
    (fused_logits, (f_topk, f_ids, f_scores, f_counts)) = fused
    (ref_logits, (r_topk, r_ids, r_scores, r_counts)) = reference
    assert torch.equal(f_ids, r_ids)
    assert torch.equal(f_counts, r_counts)
    assert f_ids.dtype == f_counts.dtype == torch.int64
    torch.testing.assert_close(f_scores, r_scores, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(f_topk, r_topk, rtol=1e-6, atol=1e-7)
    for _, (topk, _, scores, _) in (fused, reference):
        torch.autograd.backward([topk, scores], [grad_topk, grad_scores])
    torch.testing.assert_close(fused_logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("used", ["topk_scores", "scores"])
def test_gradient_through_one_output(used):
    (fused, reference), (grad_topk, grad_scores) = routed_pair(23, 16, 3, "softmax", True, 1.0, True)
    for _, (topk, _, scores, _) in (fused, reference):
        if used == "topk_scores":
            topk.backward(grad_topk)
        else:
            scores.backward(grad_scores)
    torch.testing.assert_close(fused[0].grad, reference[0].grad, rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lowest_expert_id_and_counts_sum_to_the_slots():
    logits = torch.zeros(6, 8, device=DEVICE)
    logits[:, 5] = 1.0
    topk, ids, _, counts = topk_routing(logits, None, 3, "softmax", True, 1.0)
    assert ids.tolist() == [[5, 0, 1]] * 6
    assert counts.tolist() == [6, 6, 0, 0, 0, 6, 0, 0]
    torch.testing.assert_close(topk.sum(dim=-1), torch.ones(6, device=DEVICE))


def test_the_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], device=DEVICE)
    topk, ids, scores, _ = topk_routing(logits, bias, 1, "sigmoid", False, 1.0)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(topk, scores[:, 3:])


def test_unsupported_inputs_are_named():
    def reason(num_experts: int, score_func: str, dtype: torch.dtype) -> str:
        unsupported = topk_routing_unsupported_reason(num_experts, 2, score_func, dtype)
        assert unsupported is not None
        return unsupported

    assert "score function" in reason(8, "relu", torch.float32)
    assert "fp32" in reason(8, "softmax", torch.bfloat16)
    assert str(MAX_EXPERTS) in reason(MAX_EXPERTS + 1, "softmax", torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        topk_routing(torch.zeros(2, 4, device=DEVICE), None, 5, "softmax", True, 1.0)
