"""Activation checkpointing of the MoE layer: selective recomputation stays aligned with the
forward, and training with selective or full checkpointing gives the losses of no checkpointing.

Selective checkpointing matches the outputs it saved to the recomputation by each op's call
count. Anything that runs ops in a forward but not in its recomputation (the metrics hooks do)
would shift that match; the layer test saves every dtype/device copy and ``max``, as a policy on a
GPU saves the EP split sizes' device-to-host copies, and runs in bf16 (whose casts are copies), so
such a shift shows on CPU.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from torchtitan_ext.experiments.moe_backends.activation_checkpoint import MoESelectiveAC
from torchtitan_ext.experiments.moe_backends.experts import BACKENDS, backend_names
from torchtitan_ext.experiments.moe_backends.fp8_experts import ExpertPrecision, fp8_unavailable_reason
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config, with_expert_precision
from torchtitan_ext.metrics.observer import MoERoutingObserver

SHAPE = dict(dim=16, hidden_dim=24, num_experts=6, top_k=2)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SAVED_OPS = {torch.ops.aten._to_copy.default, torch.ops.aten.max.default, torch.ops.aten.mm.default}


def _save_copies_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def build_layer(compute_backend: str, precision: ExpertPrecision = "native") -> torch.nn.Module:
    layer = with_expert_precision(moe_layer_config(compute_backend=compute_backend, **SHAPE), precision).build()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(layer.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return layer.to(DEVICE, torch.bfloat16).train()


def gradients(layer, x, grad_out, policy=None) -> dict[str, torch.Tensor]:
    """Every gradient of one forward+backward, under selective checkpointing with ``policy`` when given."""
    x = x.clone().requires_grad_()
    if policy is not None:
        out = checkpoint(
            layer,
            x,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(policy),
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
    expected = gradients(layer, x, grad_out)
    actual = gradients(layer, x, grad_out, _save_copies_policy)
    observer.remove()
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)


def test_flavors_save_the_experiments_expert_routing_and_ep_ops():
    """The flavors' selective checkpointing keeps the outputs of the expert block, top-k routing and
    EP moves for backward, as torchtitan's keeps its matrix products and all-to-alls."""
    from torchtitan_ext.experiments.moe_backends.activation_checkpoint import SAVED_OPS
    from torchtitan_ext.registry import get_flavor

    config = get_flavor("tiny-moe-triton").build()
    assert isinstance(config.activation_checkpoint, MoESelectiveAC.Config)
    save_ops = config.activation_checkpoint.build().get_save_ops()
    assert set(SAVED_OPS) <= save_ops
    assert torch.ops._c10d_functional.all_to_all_single.default in save_ops


GEMM_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._grouped_mm.default,
        torch.ops.aten._scaled_grouped_mm.default,
        torch.ops.torchtitan_ext.grouped_mm.default,
        torch.ops.torchtitan_ext.fp8_grouped_gemm.default,
        torch.ops.torchtitan_ext.swiglu_experts_forward.default,
        torch.ops.torchtitan_ext.swiglu_experts_backward.default,
        torch.ops.torchtitan_ext.swiglu_experts_preactivations.default,
    }
)
"""Every op through which a backend computes its expert GEMMs (forward and backward)."""


class _GemmCalls(TorchDispatchMode):
    """Counts the calls of ``GEMM_OPS`` while active."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMM_OPS:
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _flavor_policy(ctx, func, *args, **kwargs):
    """The flavors' selective checkpointing: keep the outputs of the ops ``MoESelectiveAC`` saves."""
    saved = func in _FLAVOR_SAVE_OPS
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


_FLAVOR_SAVE_OPS = MoESelectiveAC.Config().build().get_save_ops()

PRECISION_CASES = [(backend, "native") for backend in backend_names()] + [
    ("grouped_mm", "fp8_rowwise_emulated"),
    ("grouped_mm", "fp8_rowwise"),
    ("triton", "fp8_rowwise"),
]


def unavailable_reason(compute_backend: str, precision: str) -> str | None:
    """Why the layer cannot compute here: its backend cannot run, or its FP8 GEMMs need a GPU
    (``torch._scaled_grouped_mm``; the Triton FP8 kernel runs wherever the backend does)."""
    reason = BACKENDS[compute_backend].unavailable_reason()
    if reason is None and compute_backend == "grouped_mm":
        return fp8_unavailable_reason(precision)
    return reason


@pytest.mark.parametrize("compute_backend, precision", PRECISION_CASES)
def test_flavors_selective_checkpointing_computes_every_expert_gemm_once(compute_backend, precision):
    """Under the flavors' selective checkpointing a forward+backward calls the expert GEMMs exactly as
    often as without checkpointing: backward recomputes none of them (FP8's included)."""
    reason = unavailable_reason(compute_backend, precision)
    if reason is not None:
        pytest.skip(reason)
    layer = build_layer(compute_backend, precision)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, SHAPE["dim"], generator=generator).to(DEVICE, torch.bfloat16)
    grad_out = torch.randn(2, 7, SHAPE["dim"], generator=generator).to(DEVICE, torch.bfloat16)
    calls = {}
    for name, policy in (("plain", None), ("selective", _flavor_policy)):
        with _GemmCalls() as counter:
            gradients(layer, x, grad_out, policy)
        calls[name] = counter.calls
    assert calls["plain"], "no expert GEMM op was counted"
    assert calls["selective"] == calls["plain"]
