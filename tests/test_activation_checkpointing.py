"""Activation checkpointing of the MoE layer: selective recomputation stays aligned with the
forward, and training with selective or full checkpointing gives the losses of no checkpointing.

Selective checkpointing matches the outputs it saved to the recomputation by each op's call
count. Anything that runs ops in a forward but not in its recomputation (the metrics hooks do)
would shift that match; the layer test saves every dtype/device copy and ``max``, as a policy on a
GPU saves the EP split sizes' device-to-host copies, and runs in bf16 (whose casts are copies), so
such a shift shows on CPU.
"""

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from torchtitan_ext.experiments.moe_backends.experts import BACKENDS, backend_names
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config
from torchtitan_ext.metrics.observer import MoERoutingObserver

SHAPE = dict(dim=16, hidden_dim=24, num_experts=6, top_k=2)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SAVED_OPS = {torch.ops.aten._to_copy.default, torch.ops.aten.max.default, torch.ops.aten.mm.default}


def _save_copies_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def build_layer(compute_backend: str) -> torch.nn.Module:
    layer = moe_layer_config(compute_backend=compute_backend, **SHAPE).build()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(layer.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return layer.to(DEVICE, torch.bfloat16).train()


def gradients(layer, x, grad_out, selective: bool) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    if selective:
        out = checkpoint(
            layer,
            x,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(_save_copies_policy),
        )
    else:
        out = layer(x)
    out.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    grads["x"] = x.grad
    layer.zero_grad()
    return grads


@pytest.mark.parametrize("compute_backend", backend_names())
def test_selective_recompute_with_metrics_hooks_matches_plain_backward(compute_backend):
    reason = BACKENDS[compute_backend].unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    layer = build_layer(compute_backend)
    observer = MoERoutingObserver([torch.nn.ModuleList([layer])], expert_parallel=None)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, SHAPE["dim"], generator=generator).to(DEVICE, torch.bfloat16)
    grad_out = torch.randn(2, 7, SHAPE["dim"], generator=generator).to(DEVICE, torch.bfloat16)
    expected = gradients(layer, x, grad_out, selective=False)
    actual = gradients(layer, x, grad_out, selective=True)
    observer.remove()
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)


def test_flavors_save_the_experiments_expert_routing_and_ep_ops():
    """The flavors' selective checkpointing keeps the outputs of the expert block, top-k routing and
    EP moves for backward, as torchtitan's keeps its matrix products and all-to-alls."""
    from torchtitan_ext.experiments.moe_backends.activation_checkpoint import SAVED_OPS, MoESelectiveAC
    from torchtitan_ext.registry import get_flavor

    config = get_flavor("tiny-moe-triton").build()
    assert isinstance(config.activation_checkpoint, MoESelectiveAC.Config)
    save_ops = config.activation_checkpoint.build().get_save_ops()
    assert set(SAVED_OPS) <= save_ops
    assert torch.ops._c10d_functional.all_to_all_single.default in save_ops
