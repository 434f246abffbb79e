"""GPU checks of the router against torchtitan's: the gate's bf16 tensor-core path against the
fp32 gate, and the top-k routing kernels against torchtitan's routing (skipped without CUDA)."""

import pytest
import torch
from helpers import assert_bf16_rounds_like

from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config, stock_moe_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def layer_pair(dim: int, num_experts: int, top_k: int):
    """torchtitan's MoE layer and ours in bf16 on CUDA, same router weight."""
    shape = dict(dim=dim, hidden_dim=64, num_experts=num_experts, top_k=top_k)
    with torch.device("cuda"):
        stock = stock_moe_config(**shape).build().bfloat16()
        ours = moe_layer_config(compute_backend="grouped_mm", **shape).build().bfloat16()
    with torch.no_grad():
        ours.router.gate.weight.copy_(stock.router.gate.weight)
    return stock, ours


@pytest.mark.parametrize("dim, num_experts, top_k", [(2048, 128, 8), (4096, 8, 2)])
def test_gate_logits_and_gradients_match_the_fp32_gate(dim, num_experts, top_k):
    _, ours = layer_pair(dim, num_experts, top_k)
    generator = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(2, 2048, dim, device="cuda", generator=generator).bfloat16().requires_grad_()
    weight = ours.router.gate.weight
    with torch.autocast("cuda", dtype=torch.float32):
        logits = ours.router.gate(x)
    assert type(logits.grad_fn.next_functions[0][0]).__name__ == "_Bf16GateLogitsBackward"
    expected = x.detach().float() @ weight.detach().float().T
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)

    grad_logits = torch.randn(logits.shape, device="cuda", generator=generator) * 1e-3
    logits.backward(grad_logits)
    grad_NE = grad_logits.reshape(-1, num_experts)
    assert_bf16_rounds_like(x.grad, (grad_NE @ weight.detach().float()).view_as(x))
    assert_bf16_rounds_like(weight.grad, grad_NE.T @ x.detach().float().reshape(-1, dim))


def test_routing_matches_torchtitans_router():
    stock, ours = layer_pair(2048, 128, 8)
    x = torch.randn(2, 4096, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
    with torch.no_grad():
        stock_scores, stock_ids, _ = stock.router(x, stock.expert_bias_E)
        our_scores, our_ids, _ = ours.router(x, ours.expert_bias_E)
    same_experts = (stock_ids.sort(dim=-1).values == our_ids.sort(dim=-1).values).all(dim=-1)
    assert same_experts.float().mean() >= 0.999
    torch.testing.assert_close(
        our_scores.sort(dim=-1).values[same_experts],
        stock_scores.sort(dim=-1).values[same_experts],
        rtol=1e-5,
        atol=1e-6,
    )


def grad_fns(tensor):
    """Names of every autograd node ``tensor`` depends on."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack += [next_node for next_node, _ in node.next_functions]
    return names


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_routing_kernels_route_and_differentiate_like_torchtitans_router(score_func):
    stock, ours = layer_pair(2048, 128, 8)
    for layer in (stock, ours):
        layer.router.score_func = score_func
        layer.expert_bias_E.copy_(torch.linspace(0.01, 0, 128, device="cuda"))
    generator = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(2, 2048, 2048, device="cuda", generator=generator).bfloat16()
    expert_weight_E = torch.randn(128, device="cuda", generator=generator)
    results = []
    for layer in (stock, ours):
        leaf = x.clone().requires_grad_()
        topk_scores, ids, scores = layer.router(leaf, layer.expert_bias_E)
        # A loss that does not depend on the order of the K slots (torchtitan's top-k is unsorted).
        loss = (topk_scores * expert_weight_E[ids]).sum() + (scores * expert_weight_E).sum()
        loss.backward()
        assert leaf.grad is not None
        results.append((ids.sort(dim=-1).values, scores, leaf.grad, grad_fns(topk_scores)))
    (stock_ids, stock_scores, stock_grad, _), (our_ids, our_scores, our_grad, our_nodes) = results
    # The custom op torchtitan_ext::topk_routing differentiates the routing (its autograd node is
    # torch's GeneratedBackwardFor_torchtitan_ext_topk_routing_defaultBackward).
    assert any("torchtitan_ext_topk_routing" in name for name in our_nodes), our_nodes
    same_experts = (stock_ids == our_ids).all(dim=-1)
    assert same_experts.float().mean() >= 0.999
    torch.testing.assert_close(our_scores, stock_scores, rtol=1e-4, atol=1e-6)
    expected = stock_grad[same_experts].float()
    torch.testing.assert_close(
        our_grad[same_experts].float(), expected, rtol=0.05, atol=0.02 * float(expected.abs().max())
    )


@pytest.mark.parametrize("weight_dtype, autocast", [(torch.float32, True), (torch.bfloat16, False)])
def test_other_cases_keep_torchtitans_linear(weight_dtype, autocast):
    """fp32 weights (one GPU under autocast) or no fp32 autocast: the gate is ``Linear`` unchanged."""
    _, ours = layer_pair(256, 8, 2)
    gate = ours.router.gate.to(weight_dtype)
    x = torch.randn(4, 256, device="cuda").bfloat16()
    with torch.autocast("cuda", dtype=torch.float32, enabled=autocast):
        logits = gate(x)
        expected = torch.nn.functional.linear(x, gate.weight)
    assert "Bf16GateLogits" not in type(logits.grad_fn).__name__
    assert torch.equal(logits, expected)
