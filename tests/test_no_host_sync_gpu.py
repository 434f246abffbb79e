"""On a GPU, a single-device MoE layer's forward+backward makes no host sync with the backends
that promise none (``syncs_with_host`` False in the backend table): the host keeps queueing
kernels while the GPU works, as torchtitan's own layer does."""

import pytest
import torch

from torchtitan_ext.experiments.moe_backends.dispatcher import RoutingDispatcher
from torchtitan_ext.experiments.moe_backends.experts import BACKENDS, runnable_backends
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA property")

NO_SYNC_BACKENDS = [name for name, spec in BACKENDS.items() if not spec.syncs_with_host]


@pytest.mark.parametrize("align_size", [1, 8])
@pytest.mark.parametrize("compute_backend", NO_SYNC_BACKENDS)
def test_forward_backward_without_host_sync(compute_backend, align_size):
    if compute_backend not in runnable_backends():
        pytest.skip(f"{compute_backend} cannot run here")
    config = moe_layer_config(compute_backend=compute_backend, dim=256, hidden_dim=192, num_experts=16, top_k=4)
    dispatcher = config.routed_experts.token_dispatcher
    assert isinstance(dispatcher, RoutingDispatcher.Config)
    dispatcher.align_size = align_size
    with torch.device("cuda"):
        layer = config.build()
    layer = layer.to(torch.bfloat16)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.05)
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def forward_backward():
        layer(x).float().square().mean().backward()

    forward_backward()  # first use: kernel compilation and config choice may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
