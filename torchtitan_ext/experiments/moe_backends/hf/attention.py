"""Attention with QK-norm over the whole projection (OLMoE), from torchtitan's ``GQAttention``.

Qwen3 normalises every head of the query and key projections on its own (an RMSNorm of
width ``head_dim``); OLMoE normalises the query projection and the key projection as a whole
(RMSNorms of width ``n_heads * head_dim`` and ``n_kv_heads * head_dim``), before RoPE.
``HeadsRMSNorm`` is that norm applied to ``(..., N, H)`` tensors, and
``ProjectionQKNormAttention`` gives the key its own norm width, so torchtitan's
``GQAttention.forward`` computes OLMoE's attention unchanged.
"""

from dataclasses import dataclass

import torch
from torchtitan.models.common.attention import GQAttention
from torchtitan.models.common.nn_modules import RMSNorm


class HeadsRMSNorm(RMSNorm):
    """RMSNorm over the last two dims of ``(..., N, H)`` together (``normalized_shape = N * H``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(..., N, H)`` (the parent's argument name, so that calls by keyword still work)."""
        return super().forward(x.flatten(-2)).view_as(x)


class ProjectionQKNormAttention(GQAttention):
    """torchtitan's ``GQAttention`` whose query norm is ``qk_norm`` and key norm ``k_norm``.

    With ``HeadsRMSNorm`` configs of widths ``n_heads * head_dim`` and ``n_kv_heads * head_dim``
    this is OLMoE's attention. Under tensor parallelism a rank would normalise only its own
    heads, so these models are refused there (``startup_checks.parallelism_errors``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GQAttention.Config):
        k_norm: RMSNorm.Config
        """The key projection's norm (``qk_norm`` is the query projection's)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.k_norm = config.k_norm.build()
