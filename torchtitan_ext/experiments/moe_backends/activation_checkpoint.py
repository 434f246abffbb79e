"""Selective activation checkpointing that knows this experiment's ops.

torchtitan's ``SelectiveAC`` saves the outputs of the compute-heavy and communication ops it
knows (matrix products, attention, all-to-alls, ``aten.topk``) and recomputes the rest in
backward. The expert block, top-k routing and EP moves of this experiment are ``torch.library``
ops of their own, and the FP8 experts' GEMMs are ``aten._scaled_grouped_mm`` or this project's
``fp8_grouped_gemm``, none of which it knows: it would recompute the expert GEMMs a second time
(for FP8 with their operands' quantisation), and the EP exchange a second time (barriers and
pulls across ranks; the received rows' scores, a few bytes a row, are kept rather than read again).
``MoESelectiveAC`` saves them as torchtitan saves its own equivalents (``aten.linear``,
``aten.topk``, ``all_to_all_single``), through the ``get_save_ops`` hook torchtitan offers for
this.
"""

from dataclasses import dataclass

import torch
from torchtitan.distributed.activation_checkpoint import SelectiveAC

import torchtitan_ext.experiments.moe_backends.ep_symm_mem
import torchtitan_ext.experiments.moe_backends.grouped_matmul
import torchtitan_ext.kernels.fp8_grouped_gemm
import torchtitan_ext.kernels.swiglu_experts
import torchtitan_ext.kernels.topk_routing  # noqa: F401  (registers the routing op)

SAVED_OPS = (
    torch.ops.torchtitan_ext.swiglu_experts_forward.default,
    torch.ops.torchtitan_ext.grouped_mm.default,
    torch.ops.aten._scaled_grouped_mm.default,
    torch.ops.torchtitan_ext.fp8_grouped_gemm.default,
    torch.ops.torchtitan_ext.topk_routing.default,
    torch.ops.torchtitan_ext.symm_mem_dispatch.default,
    torch.ops.torchtitan_ext.symm_mem_combine.default,
    torch.ops.torchtitan_ext.symm_mem_row_scores.default,
)
"""This experiment's ops whose outputs selective checkpointing keeps for backward."""


class MoESelectiveAC(SelectiveAC):
    """torchtitan's selective AC, saving ``SAVED_OPS`` as well."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return super().get_save_ops() | set(SAVED_OPS)
