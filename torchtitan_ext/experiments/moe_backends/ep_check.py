"""EP equivalence: under expert parallelism, each rank's outputs and gradients equal those of
one process on the whole batch.

The one implementation of the check, run by the tests (CPU, gloo) and by the EP benchmark
(``python -m torchtitan_ext.bench ep --check``, GPUs). Ranks split the batch along B in rank
order and own a contiguous block of ``E / world`` experts each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .moe import RoutedMoE

EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
"""The expert weights of ``routed_experts.inner_experts``, sharded along E under EP."""


def seeded_layer(config: RoutedMoE.Config, device: torch.device | str = "cpu", seed: int = 0) -> RoutedMoE:
    """``config.build()`` on ``device``, every parameter drawn from a normal distribution of standard
    deviation ``fan_in ** -0.5`` by one CPU generator seeded with ``seed``, in parameter-name
    order: the same weights in every process."""
    with torch.device(device):
        layer = config.build()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(layer.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return layer


def run_forward_backward(
    layer: torch.nn.Module, x_BLD: torch.Tensor, grad_BLD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``layer(x_BLD)`` backpropagated with ``grad_BLD``: (output, x gradient, parameter gradients by name)."""
    x_BLD = x_BLD.clone().requires_grad_()
    out_BLD = layer(x_BLD)
    out_BLD.backward(grad_BLD)
    grads = {name: _gradient(param).clone() for name, param in layer.named_parameters()}
    return out_BLD.detach(), _gradient(x_BLD), grads


def _gradient(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.grad``, which backward must have set."""
    assert tensor.grad is not None, "backward left a tensor without a gradient"
    return tensor.grad


def local_expert_slice(num_experts: int, ep_mesh: DeviceMesh | None) -> slice:
    """The experts this rank owns: all of them without a mesh."""
    if ep_mesh is None:
        return slice(0, num_experts)
    rank, world = ep_mesh.get_local_rank(), ep_mesh.size()
    per_rank = num_experts // world
    return slice(rank * per_rank, (rank + 1) * per_rank)


def shard_experts(layer: RoutedMoE, experts: slice) -> None:
    """Keep only the ``experts`` block of the layer's expert weights (new parameters)."""
    inner = layer.routed_experts.inner_experts
    for name in EXPERT_WEIGHTS:
        setattr(inner, name, torch.nn.Parameter(getattr(inner, name).detach()[experts].clone()))


def compare_with_single_process(
    reference_layer: torch.nn.Module,
    layer: RoutedMoE,
    x_all_BLD: torch.Tensor,
    grad_all_BLD: torch.Tensor,
    ep_mesh: DeviceMesh | None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Run ``reference_layer`` on the whole batch and ``layer`` under EP on this rank's part.

    ``layer`` starts with every expert and the reference's weights; with ``ep_mesh`` it is
    sharded to this rank's experts, wired to the mesh, and its router losses are reduced over
    the mesh. Without a mesh it runs on the whole batch on one process.

    Returns:
        ``{quantity: (this rank's value, the reference's value for this rank)}`` for the output,
        the x gradient, the router gate gradient (summed over ranks) and each expert weight
        gradient (this rank's experts).
    """
    world = 1 if ep_mesh is None else ep_mesh.size()
    rank = 0 if ep_mesh is None else ep_mesh.get_local_rank()
    batch_per_rank = x_all_BLD.shape[0] // world
    mine = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
    experts = local_expert_slice(layer.routed_experts.inner_experts.w1_EFD.shape[0], ep_mesh)

    ref_out, ref_x_grad, ref_grads = run_forward_backward(reference_layer, x_all_BLD, grad_all_BLD)
    if ep_mesh is not None:
        shard_experts(layer, experts)
        layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
        layer.loss_scale, layer.loss_group = 1.0 / world, ep_mesh.get_group()
    out, x_grad, grads = run_forward_backward(layer, x_all_BLD[mine], grad_all_BLD[mine])
    gate_grad = grads["router.gate.weight"]
    if ep_mesh is not None:
        dist.all_reduce(gate_grad, group=ep_mesh.get_group())
    pairs = {
        "output": (out, ref_out[mine]),
        "x_grad": (x_grad, ref_x_grad[mine]),
        "gate_grad": (gate_grad, ref_grads["router.gate.weight"]),
    }
    for name in EXPERT_WEIGHTS:
        key = f"routed_experts.inner_experts.{name}"
        pairs[f"{name}_grad"] = (grads[key], ref_grads[key][experts])
    return pairs
