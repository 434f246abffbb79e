"""GPU checks of the router gate's bf16 tensor-core path against torchtitan's fp32 gate
(skipped without CUDA)."""

import pytest
import torch

from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config, stock_moe_config

from helpers import assert_bf16_rounds_like

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
        our_scores.sort(dim=-1).values[same_experts], stock_scores.sort(dim=-1).values[same_experts],
        rtol=1e-5, atol=1e-6,
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
