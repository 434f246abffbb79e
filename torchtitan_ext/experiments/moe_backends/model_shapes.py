"""Dimensions of MoE models: the shape records, and the public models the full-size flavors and
the benchmarks' named shapes are built from (every fact once; this module imports no torchtitan,
so the benchmarks read it without loading the Trainer)."""

from dataclasses import dataclass
from typing import Literal

ScoreFunc = Literal["softmax", "sigmoid"]
"""How a router turns logits into scores."""


@dataclass(frozen=True, kw_only=True)
class MoELayerShape:
    """Dimensions of one MoE layer's routed experts."""

    dim: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """Dimensions of a decoder-only MoE model (every layer MoE)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int
    score_func: ScoreFunc = "softmax"
    route_norm: bool = True
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    norm_eps: float = 1e-6

    @property
    def moe_layer(self) -> MoELayerShape:
        """The routed experts of each of its MoE layers."""
        return MoELayerShape(
            dim=self.dim, moe_hidden_dim=self.moe_hidden_dim, num_experts=self.num_experts, top_k=self.top_k
        )


# Public model dimensions (every layer MoE; attention as Qwen3 GQA blocks).
QWEN3_30B_A3B = MoEShape(
    vocab_size=151936,
    dim=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    moe_hidden_dim=768,
    num_experts=128,
    top_k=8,
    max_seq_len=40960,
)
MIXTRAL_8X7B = MoEShape(
    vocab_size=32000,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    moe_hidden_dim=14336,
    num_experts=8,
    top_k=2,
    max_seq_len=32768,
    norm_eps=1e-5,
)
OLMOE_1B_7B = MoEShape(
    vocab_size=50304,
    dim=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=16,
    head_dim=128,
    moe_hidden_dim=1024,
    num_experts=64,
    top_k=8,
    route_norm=False,
    rope_theta=10000.0,
    max_seq_len=4096,
    norm_eps=1e-5,
)
DEEPSEEK_V2_LITE_MOE_LAYER = MoELayerShape(dim=2048, moe_hidden_dim=1408, num_experts=64, top_k=6)
"""DeepSeek-V2-Lite's routed experts (its 2 shared experts and MLA attention aside); the MoE
layers of the ``deepseek-v3-16b`` flavor (torchtitan's 16B config) have these dimensions."""
