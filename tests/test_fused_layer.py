"""The MoE layer with compute_backend "triton" (fused routed path, no dispatcher) equals the
layer with the for_loop reference (dispatch -> experts -> combine): output and every gradient.

On CPU the kernels run through Triton's interpreter (tests/conftest.py), in fp32.
"""

import pytest
import torch

from torchtitan_ext.experiments.moe_backends.experts import FusedRoutedExperts
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config
from torchtitan_ext.kernels.fused_moe import triton_available_reason

pytestmark = pytest.mark.skipif(triton_available_reason() is not None, reason="Triton cannot run here")

SHAPE = dict(dim=16, hidden_dim=24, num_experts=6, top_k=2)


def build_layer(compute_backend: str, capacity_factor: float | None):
    config = moe_layer_config(compute_backend=compute_backend, **SHAPE)
    config.router.capacity_factor = capacity_factor
    layer = config.build()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(layer.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return layer


def run(layer):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, SHAPE["dim"], generator=generator, requires_grad=True)
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=generator))
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def relative_error(actual, expected):
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_fused_layer_equals_dispatch_path(capacity_factor, monkeypatch):
    reference = build_layer("for_loop", capacity_factor)
    fused = build_layer("triton", capacity_factor)
    assert isinstance(fused.routed_experts, FusedRoutedExperts)
    monkeypatch.setattr(
        fused.routed_experts.token_dispatcher, "dispatch",
        lambda *args, **kwargs: pytest.fail("the fused single-device path must not dispatch"),
    )
    expected_out, expected_dx, expected_grads = run(reference)
    out, dx, grads = run(fused)
    assert relative_error(out, expected_out) < 1e-5
    assert relative_error(dx, expected_dx) < 1e-5
    assert expected_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) < 1e-5, name
    if capacity_factor is not None:
        assert int(fused.last_num_dropped_tokens) > 0
