"""How large a model config is: its parameters (counted on the meta device, nothing allocated) and
the memory training it takes at least (weights, gradients, optimizer state), against this machine's."""

import os
from pathlib import Path

import torch

TRAINING_COPIES_PER_PARAMETER = 4
"""Copies of every parameter training holds at least: the weight, its gradient and AdamW's two moments
(activations come on top)."""


def parameter_counts(model_config) -> tuple[int, int]:
    """(total, active per token) parameters of a model config, built on the meta device.

    Active counts each MoE layer's routed experts as top_k of num_experts.
    """
    from torchtitan.models.common.moe import MoE

    with torch.device("meta"):
        model = model_config.build()
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for _, moe, _, _ in model_config.traverse(MoE.Config):
        experts = moe.routed_experts.inner_experts
        per_expert = 3 * experts.dim * experts.hidden_dim
        inactive += per_expert * (experts.num_experts - moe.router.top_k)
    return total, total - inactive


def training_state_bytes(config) -> tuple[int, int]:
    """(parameters, bytes of ``TRAINING_COPIES_PER_PARAMETER`` copies of them in the training dtype) of a
    ``Trainer.Config``'s model: a lower bound of what training it holds, over all its ranks."""
    parameters, _ = parameter_counts(config.model_spec.model)
    element_bytes = getattr(torch, config.training.dtype).itemsize
    return parameters, parameters * element_bytes * TRAINING_COPIES_PER_PARAMETER


def machine_memory_bytes() -> int:
    """This machine's memory: its physical memory, or the memory limit of its control group when lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


def gibibytes(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def human_count(count: int) -> str:
    """``30.53B``, ``402.82K``: how listings and messages write a parameter count."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)
