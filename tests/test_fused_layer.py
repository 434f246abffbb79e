"""The MoE layer with compute_backend "triton" (fused routed path, no dispatcher) equals the
layer with the for_loop reference (dispatch -> experts -> combine): output and every gradient.

On CPU the kernels run through Triton's interpreter (tests/conftest.py) in fp32; on a GPU the
layers run in bf16 at a larger shape (both layers, so that they route identically).
"""

import pytest
import torch

from torchtitan_ext.bench.common import relative_error
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts, FusedRoutedExperts
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config
from torchtitan_ext.kernels.fused_moe import triton_available_reason

pytestmark = pytest.mark.skipif(triton_available_reason() is not None, reason="Triton cannot run here")

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SHAPE = (
    dict(dim=256, hidden_dim=192, num_experts=16, top_k=4)
    if ON_GPU
    else dict(dim=16, hidden_dim=24, num_experts=6, top_k=2)
)
TOKENS = (4, 96) if ON_GPU else (2, 7)
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOLERANCE = 2e-2 if ON_GPU else 1e-5


def build_layer(
    compute_backend: str, capacity_factor: float | None, dtype: torch.dtype, recompute_preactivations: bool = False
):
    config = moe_layer_config(compute_backend=compute_backend, **SHAPE)
    config.router.capacity_factor = capacity_factor
    (experts,) = [experts for _, experts, _, _ in config.traverse(BackendGroupedExperts.Config)]
    assert isinstance(experts, BackendGroupedExperts.Config)
    experts.recompute_preactivations = recompute_preactivations
    with torch.device(DEVICE):
        layer = config.build()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(layer.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return layer.to(dtype)


def run(layer, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(*TOKENS, SHAPE["dim"], generator=generator).to(DEVICE, dtype).requires_grad_()
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=generator).to(DEVICE, dtype))
    grads = {name: p.grad.float() for name, p in layer.named_parameters()}
    assert x.grad is not None
    return out.detach().float(), x.grad.float(), grads


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_fused_layer_equals_dispatch_path(capacity_factor, monkeypatch):
    reference = build_layer("for_loop", capacity_factor, DTYPE)
    fused = build_layer("triton", capacity_factor, DTYPE)
    assert isinstance(fused.routed_experts, FusedRoutedExperts)
    monkeypatch.setattr(
        fused.routed_experts.token_dispatcher,
        "dispatch",
        lambda *args, **kwargs: pytest.fail("the fused single-device path must not dispatch"),
    )
    expected_out, expected_dx, expected_grads = run(reference, DTYPE)
    out, dx, grads = run(fused, DTYPE)
    assert relative_error(out, expected_out) < TOLERANCE
    assert relative_error(dx, expected_dx) < TOLERANCE
    assert expected_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) < TOLERANCE, name
    if capacity_factor is not None:
        assert int(fused.last_router_statistics.num_dropped_slots) > 0


def test_experts_that_recompute_their_preactivations_take_the_dispatch_path_and_equal_the_reference():
    """The fused routed path keeps its pre-activations; with ``recompute_preactivations`` the layer
    dispatches grouped rows to experts that keep none, with the reference's output and gradients."""
    reference = build_layer("for_loop", None, DTYPE)
    recomputing = build_layer("triton", None, DTYPE, recompute_preactivations=True)
    assert recomputing.routed_experts._routed_path() is None
    assert "recompute_preactivations=True" in repr(recomputing.routed_experts.inner_experts)
    expected_out, expected_dx, expected_grads = run(reference, DTYPE)
    out, dx, grads = run(recomputing, DTYPE)
    assert relative_error(out, expected_out) < TOLERANCE
    assert relative_error(dx, expected_dx) < TOLERANCE
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) < TOLERANCE, name
