"""Model configs for the MoE backends experiment, built from torchtitan's modules.

``qwen3_style_moe`` turns the dimensions of a decoder-only MoE model (``model_shapes.MoEShape``)
into a torchtitan ``ModelSpec`` made of Qwen3 blocks (GQA attention with QK-norm, token-choice
top-k MoE) whose MoE layers are this experiment's (see ``layer``).
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import nn
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import (
    get_attention_config,
    make_gqa_config,
)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from .experts import ComputeBackend
from .layer import stock_moe_config, use_backend_experts, use_routing
from .model_shapes import MoEShape
from .parallelize import moe_parallelize


@dataclass(frozen=True)
class ParamInits:
    """torchtitan ``param_init`` dicts of a decoder: N(0, 0.02) projections, the residual
    outputs (attention ``wo``, experts' ``w2``) scaled by ``1 / sqrt(2 * n_layers)``."""

    linear: dict[str, Callable]
    residual: dict[str, Callable]
    experts: dict[str, Callable]

    @classmethod
    def for_depth(cls, n_layers: int) -> "ParamInits":
        linear = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
        residual_std = 0.02 / (2 * n_layers) ** 0.5
        residual = {"weight": partial(nn.init.normal_, std=residual_std), "bias": nn.init.zeros_}
        experts = {"w1_EFD": linear["weight"], "w2_EDF": residual["weight"], "w3_EFD": linear["weight"]}
        return cls(linear=linear, residual=residual, experts=experts)

    @staticmethod
    def norm(size: int, eps: float) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=eps, param_init={"weight": nn.init.ones_})


def qwen3_style_moe(
    name: str,
    shape: MoEShape,
    *,
    compute_backend: ComputeBackend | None,
    attn_backend: str = "flex",
) -> ModelSpec:
    """A torchtitan ``ModelSpec`` of Qwen3 blocks with the given MoE ``shape``.

    ``compute_backend`` None keeps torchtitan's own MoE layers (the stock reference).
    """
    init = ParamInits.for_depth(shape.n_layers)
    linear_init, residual_init, experts_init = init.linear, init.residual, init.experts

    def norm(size: int) -> RMSNorm.Config:
        return init.norm(size, shape.norm_eps)

    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(shape.dim),
            ffn_norm=norm(shape.dim),
            attention=make_gqa_config(
                dim=shape.dim,
                n_heads=shape.n_heads,
                n_kv_heads=shape.n_kv_heads,
                head_dim=shape.head_dim,
                wqkv_param_init=linear_init,
                wo_param_init=residual_init,
                inner_attention=get_attention_config(attn_backend),
                fuse_qkv=True,
                rope=CosSinRoPE.Config(dim=shape.head_dim, max_seq_len=shape.max_seq_len, theta=shape.rope_theta),
                qk_norm=norm(shape.head_dim),
            ),
            moe=stock_moe_config(
                dim=shape.dim,
                hidden_dim=shape.moe_hidden_dim,
                num_experts=shape.num_experts,
                top_k=shape.top_k,
                score_func=shape.score_func,
                route_norm=shape.route_norm,
                gate_param_init=linear_init,
                experts_param_init=experts_init,
            ),
        )
        for _ in range(shape.n_layers)
    ]
    model = Qwen3Model.Config(
        vocab_size=shape.vocab_size,
        dim=shape.dim,
        norm=norm(shape.dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size,
            embedding_dim=shape.dim,
            param_init={"weight": partial(nn.init.normal_, std=0.02)},
        ),
        lm_head=Linear.Config(in_features=shape.dim, out_features=shape.vocab_size, param_init=linear_init),
        layers=layers,
    )
    return ModelSpec(
        name="qwen3",
        flavor=name,
        model=model if compute_backend is None else use_routing(use_backend_experts(model, compute_backend)),
        parallelize_fn=moe_parallelize(parallelize_qwen3),
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=Qwen3StateDictAdapter,
    )
