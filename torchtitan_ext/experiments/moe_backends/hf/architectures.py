"""Model families of Hugging Face transformers, as torchtitan model configs.

``model_spec_from_hf_config(name, hf_config)`` builds the torchtitan ``ModelSpec`` of a
Hugging Face ``config.json`` (a dict) whose ``model_type`` is one of ``ARCHITECTURES``; its
forward computes what transformers computes for that config (up to floating-point
rounding), with this experiment's MoE layers (``compute_backend``) or torchtitan's own
(``compute_backend=None``). A flag this project cannot compute is refused with
``UnsupportedArchitecture`` naming it, never approximated.

How each family maps onto torchtitan's modules:

- ``qwen3_moe`` (Qwen3-MoE): Qwen3 blocks (GQA, fused QKV projection, per-head RMS
  QK-norm before rotate-half RoPE), softmax top-k routing in fp32 with ``norm_topk_prob``
  as ``route_norm``; ``mlp_only_layers`` / ``decoder_sparse_step`` give dense SwiGLU layers
  of ``intermediate_size``. Refused: a sliding window, RoPE scaling, attention biases.
- ``olmoe`` (OLMoE): the same blocks with QK-norm over the whole query / key projection
  (``attention.ProjectionQKNormAttention``); ``intermediate_size`` is the expert width.
  Refused: ``clip_qkv``, RoPE scaling, attention biases.
- ``mixtral`` (Mixtral): the same blocks without QK-norm; the top-k weights are always
  renormalised. Refused: a sliding window, router jitter noise, RoPE scaling.
- ``deepseek_v3`` (DeepSeek-V3, and Moonlight): torchtitan's DeepSeek-V3 blocks (MLA with
  or without a query LoRA, interleaved or rotate-half RoPE after ``rope_interleave``, YaRN
  with its softmax ``mscale``), ``first_k_dense_replace`` dense layers, sigmoid routing with
  ``e_score_correction_bias`` (torchtitan's ``expert_bias_E``, updated by its auxiliary-loss-free
  balancing), group-limited top-k (``n_group`` / ``topk_group``, groups scored by their two
  best experts), ``norm_topk_prob``, ``routed_scaling_factor`` and ``n_shared_experts`` shared
  experts. Refused: attention biases, tied embeddings, YaRN whose cos/sin carry an
  attention factor other than 1.

For every family: ``hidden_act`` must be ``silu``; RMSNorm epsilons, RoPE base and length,
vocabulary and tied embeddings follow the config (MLA's latent norms use transformers'
fixed 1e-6). The routers of Qwen3-MoE, OLMoE and Mixtral carry no bias (torchtitan's
``load_balance_coeff`` is off), so the model stays one that transformers can load; the
published models' auxiliary losses are off too, as in transformers' training by default
(``output_router_logits = false``); ``[moe]`` TOML keys turn either on.

``PUBLISHED`` holds the architecture fields of the published ``config.json`` files the
full-size flavors carry; ``scaled_down`` makes a small model of the same family and flags.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.config.override import derive
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers, parallelize_deepseekv3
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec

from ..experts import ComputeBackend
from ..layer import stock_moe_config, use_backend_experts, use_routing
from ..model import ParamInits
from ..parallelize import moe_parallelize
from .attention import HeadsRMSNorm, ProjectionQKNormAttention
from .state_dict_adapters import DeepSeekV3Adapter, HFConfigAdapter, MixtralAdapter, Qwen3StyleAdapter, with_hf_config

MLA_LATENT_NORM_EPS = 1e-6
"""transformers' DeepSeek-V3 attention normalises its query and key-value latents with this
epsilon whatever ``rms_norm_eps`` says."""


class UnsupportedArchitecture(ValueError):
    """A Hugging Face config this project cannot compute; the message names every reason."""


SYNONYMS: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_local_experts",),
    "num_local_experts": ("num_experts",),
    "n_routed_experts": ("num_local_experts",),
}
"""Other names a config file may give a field: transformers 5 writes every family's expert count
as ``num_local_experts`` (its ``attribute_map``), the published files use the family's own name."""


class ConfigReader:
    """Fields of one Hugging Face config, with transformers' defaults for the optional ones."""

    def __init__(self, hf_config: Mapping[str, Any], defaults: Mapping[str, Any]):
        self.hf_config = hf_config
        self.defaults = defaults

    def __call__(self, key: str) -> Any:
        """The value of ``key``; its default when the config omits it; raises when it has none."""
        return self._value(key)

    def _value(self, key: str) -> Any:
        for name in (key, *SYNONYMS.get(key, ())):
            if name in self.hf_config:
                return self.hf_config[name]
        if key in self.defaults:
            return self.defaults[key]
        raise UnsupportedArchitecture(f"config.json has no {key!r}")

    def rope(self) -> dict[str, Any]:
        """``{"rope_theta", "rope_type", ...scaling fields}``, from transformers 5's
        ``rope_parameters`` or from the ``rope_theta`` / ``rope_scaling`` of older files."""
        if isinstance(self.hf_config.get("rope_parameters"), Mapping):
            rope = dict(self.hf_config["rope_parameters"])
        else:
            rope = dict(self.hf_config.get("rope_scaling") or {})
            rope["rope_theta"] = self._value("rope_theta")
        legacy_type = rope.pop("type", None)
        rope["rope_type"] = rope.get("rope_type") or legacy_type or "default"
        return rope


@dataclass(frozen=True)
class Architecture:
    """One transformers model family: how to build it and what of it is refused."""

    model_type: str
    hf_class: str
    """transformers' causal-LM class (``architectures`` in ``config.json``)"""
    defaults: Mapping[str, Any]
    """transformers' values of the optional fields this project reads"""
    refusals: Callable[[ConfigReader], list[str]]
    """flags of a config this project cannot compute"""
    build: Callable[[ConfigReader, str], tuple[Any, Callable]]
    """``build(read, attn_backend) -> (model config with torchtitan's MoE layers, parallelize_fn)``"""
    adapter: type[HFConfigAdapter]
    titan_name: str
    """torchtitan's model name (``ModelSpec.name``)"""
    has_correction_bias: bool = False
    """the router adds a per-expert bias for top-k selection (torchtitan's ``expert_bias_E``)"""
    ignored_tensors: Callable[[ConfigReader, str], bool] = field(default=lambda read, name: False)
    """checkpoint tensors transformers does not load either (e.g. multi-token-prediction layers)"""


def _common_refusals(read: ConfigReader, *, rope_types: tuple[str, ...] = ("default",)) -> list[str]:
    refusals = []
    if read("hidden_act") != "silu":
        refusals.append(f"hidden_act = {read('hidden_act')!r} (the experts compute SwiGLU: only 'silu')")
    if read("attention_bias"):
        refusals.append("attention_bias = true (the attention projections have no biases)")
    rope_type = read.rope()["rope_type"]
    if rope_type not in rope_types:
        refusals.append(f"RoPE scaling {rope_type!r} (supported: {', '.join(rope_types)})")
    return refusals


def _qwen3_moe_refusals(read: ConfigReader) -> list[str]:
    refusals = _common_refusals(read)
    if read("use_sliding_window"):
        refusals.append("use_sliding_window = true (attention is full causal)")
    return refusals


def _olmoe_refusals(read: ConfigReader) -> list[str]:
    refusals = _common_refusals(read)
    if read("clip_qkv") is not None:
        refusals.append(f"clip_qkv = {read('clip_qkv')} (query/key/value clipping is not implemented)")
    return refusals


def _mixtral_refusals(read: ConfigReader) -> list[str]:
    refusals = _common_refusals(read)
    if read("sliding_window") is not None:
        refusals.append(f"sliding_window = {read('sliding_window')} (attention is full causal)")
    if read("router_jitter_noise"):
        refusals.append(f"router_jitter_noise = {read('router_jitter_noise')} (not implemented)")
    return refusals


def _yarn_attention_factor(rope: Mapping[str, Any]) -> float:
    """The factor transformers' YaRN multiplies cos and sin by (``attention_factor``)."""

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return mscale(rope["factor"], rope["mscale"]) / mscale(rope["factor"], rope["mscale_all_dim"])
    return mscale(rope["factor"])


def _deepseek_v3_refusals(read: ConfigReader) -> list[str]:
    refusals = _common_refusals(read, rope_types=("default", "yarn"))
    if read("tie_word_embeddings"):
        refusals.append("tie_word_embeddings = true (not supported for DeepSeek-V3)")
    rope = read.rope()
    if rope["rope_type"] == "yarn" and not math.isclose(_yarn_attention_factor(rope), 1.0, rel_tol=1e-9):
        refusals.append(
            f"YaRN with attention factor {_yarn_attention_factor(rope):.6g} on cos/sin (supported: 1, "
            "i.e. mscale = mscale_all_dim, whose softmax scale torchtitan's MLA applies)"
        )
    if not read("n_shared_experts"):
        refusals.append("n_shared_experts = 0 (supported: at least 1 shared expert)")
    return refusals


def _norm(size: int, eps: float) -> RMSNorm.Config:
    return ParamInits.norm(size, eps)


def _decoder_parts(read: ConfigReader, init: ParamInits) -> dict[str, Any]:
    """Embedding, final norm, output layer and weight tying of a decoder config."""
    vocab_size, dim = read("vocab_size"), read("hidden_size")
    return dict(
        vocab_size=vocab_size,
        dim=dim,
        norm=_norm(dim, read("rms_norm_eps")),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init={"weight": init.linear["weight"]}
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=init.linear),
        enable_weight_tying=bool(read("tie_word_embeddings")),
    )


def _gqa_decoder(
    read: ConfigReader,
    *,
    qk_norm: str | None,
    num_experts: int,
    expert_width: int,
    route_norm: bool,
    dense_layers: set[int],
    attn_backend: str,
) -> Qwen3Model.Config:
    """Qwen3 blocks: GQA with ``qk_norm`` ``"per_head"``, ``"projection"`` or None; MoE layers
    (softmax top-k) except ``dense_layers`` (SwiGLU of ``intermediate_size``)."""
    dim, n_layers, n_heads = read("hidden_size"), read("num_hidden_layers"), read("num_attention_heads")
    n_kv_heads = read("num_key_value_heads") or n_heads
    head_dim = read("head_dim") or dim // n_heads
    eps = read("rms_norm_eps")
    init = ParamInits.for_depth(n_layers)
    norm_init = {"weight": nn.init.ones_}

    def query_norm() -> RMSNorm.Config | None:
        if qk_norm == "per_head":
            return _norm(head_dim, eps)
        if qk_norm == "projection":
            return HeadsRMSNorm.Config(normalized_shape=n_heads * head_dim, eps=eps, param_init=norm_init)
        return None

    def attention():
        config = make_gqa_config(
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            wqkv_param_init=init.linear,
            wo_param_init=init.residual,
            inner_attention=get_attention_config(attn_backend),
            fuse_qkv=True,
            rope=CosSinRoPE.Config(
                dim=head_dim, max_seq_len=read("max_position_embeddings"), theta=read.rope()["rope_theta"]
            ),
            qk_norm=query_norm(),
        )
        if qk_norm != "projection":
            return config
        key_norm = HeadsRMSNorm.Config(normalized_shape=n_kv_heads * head_dim, eps=eps, param_init=norm_init)
        return derive(config, ProjectionQKNormAttention.Config, k_norm=key_norm)

    def block(layer_id: int) -> Qwen3TransformerBlock.Config:
        dense = layer_id in dense_layers
        return Qwen3TransformerBlock.Config(
            attention_norm=_norm(dim, eps),
            ffn_norm=_norm(dim, eps),
            attention=attention(),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=read("intermediate_size"), w1_param_init=init.linear, w2w3_param_init=init.residual
            )
            if dense
            else None,
            moe=None
            if dense
            else stock_moe_config(
                dim=dim,
                hidden_dim=expert_width,
                num_experts=num_experts,
                top_k=read("num_experts_per_tok"),
                score_func="softmax",
                route_norm=route_norm,
                load_balance_coeff=None,
                gate_param_init=init.linear,
                experts_param_init=init.experts,
            ),
        )

    return Qwen3Model.Config(**_decoder_parts(read, init), layers=[block(i) for i in range(n_layers)])


def _qwen3_moe_dense_layers(read: ConfigReader) -> set[int]:
    """Qwen3-MoE's dense layers: ``mlp_only_layers``, and those off the ``decoder_sparse_step`` grid."""
    step, listed = read("decoder_sparse_step"), set(read("mlp_only_layers") or [])
    return {i for i in range(read("num_hidden_layers")) if i in listed or (i + 1) % step}


def _gqa_build(
    *,
    qk_norm: str | None,
    experts: str,
    expert_width: str,
    route_norm: str | None,
    dense_layers: Callable[[ConfigReader], set[int]] = lambda read: set(),
) -> Callable[[ConfigReader, str], tuple[Any, Callable]]:
    """An ``Architecture.build`` of Qwen3 blocks reading the expert count, expert width and
    top-k normalisation (None: always on) from the config fields named here."""

    def build(read: ConfigReader, attn_backend: str):
        model = _gqa_decoder(
            read,
            qk_norm=qk_norm,
            num_experts=read(experts),
            expert_width=read(expert_width),
            route_norm=True if route_norm is None else bool(read(route_norm)),
            dense_layers=dense_layers(read),
            attn_backend=attn_backend,
        )
        return model, parallelize_qwen3

    return build


def _build_deepseek_v3(read: ConfigReader, attn_backend: str):
    n_layers, dim, eps = read("num_hidden_layers"), read("hidden_size"), read("rms_norm_eps")
    init = ParamInits.for_depth(n_layers)
    rope = read.rope()
    rope_class = ComplexRoPE if read("rope_interleave") is not False else CosSinRoPE
    rope_fields = dict(
        dim=read("qk_rope_head_dim"), max_seq_len=read("max_position_embeddings"), theta=rope["rope_theta"]
    )
    mscale = 1.0
    if rope["rope_type"] == "yarn":
        rope_fields.update(
            scaling="yarn",
            rope_factor=rope["factor"],
            beta_fast=rope.get("beta_fast") or 32.0,
            beta_slow=rope.get("beta_slow") or 1.0,
            original_seq_len=rope["original_max_position_embeddings"],
            truncate=rope.get("truncate", True),
        )
        mscale = rope.get("mscale_all_dim") or 0.0  # transformers scales the softmax only when it is set
    n_group = read("n_group") or 1
    layers = build_mla_moe_layers(
        n_layers=n_layers,
        n_dense_layers=read("first_k_dense_replace"),
        dim=dim,
        n_heads=read("num_attention_heads"),
        q_lora_rank=read("q_lora_rank") or 0,
        kv_lora_rank=read("kv_lora_rank"),
        qk_nope_head_dim=read("qk_nope_head_dim"),
        qk_rope_head_dim=read("qk_rope_head_dim"),
        v_head_dim=read("v_head_dim"),
        mscale=mscale,
        dense_hidden_dim=read("intermediate_size"),
        moe_hidden_dim=read("moe_intermediate_size"),
        num_experts=read("n_routed_experts"),
        num_shared_experts=read("n_shared_experts"),
        router_top_k=read("num_experts_per_tok"),
        router_score_func="sigmoid",
        router_num_expert_groups=n_group if n_group > 1 else None,
        router_num_limited_groups=read("topk_group") if n_group > 1 else None,
        router_route_scale=read("routed_scaling_factor"),
        router_route_norm=bool(read("norm_topk_prob")),
        attn_backend=attn_backend,
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=init.linear,
        norm_init={"weight": nn.init.ones_},
        depth_init=lambda layer_id: init.residual,
        depth_experts_init=lambda layer_id: init.experts,
        rope=rope_class.Config(**rope_fields),
    )
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = eps
        # pyrefly: ignore[missing-attribute]  # torchtitan types it BaseAttention.Config; MLA's has both norms
        layer.attention.q_norm.eps = layer.attention.kv_norm.eps = MLA_LATENT_NORM_EPS
    return DeepSeekV3Model.Config(**_decoder_parts(read, init), layers=layers), parallelize_deepseekv3


def _deepseek_v3_ignored(read: ConfigReader, name: str) -> bool:
    """Multi-token-prediction layers (indices from ``num_hidden_layers``): transformers skips them."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= read("num_hidden_layers")


_GQA_DEFAULTS = {
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_key_value_heads": None,
    "head_dim": None,
}

ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        Architecture(
            model_type="qwen3_moe",
            hf_class="Qwen3MoeForCausalLM",
            defaults={
                **_GQA_DEFAULTS,
                "rope_theta": 10000.0,
                "use_sliding_window": False,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "norm_topk_prob": False,
            },
            refusals=_qwen3_moe_refusals,
            build=_gqa_build(
                qk_norm="per_head",
                experts="num_experts",
                expert_width="moe_intermediate_size",
                route_norm="norm_topk_prob",
                dense_layers=_qwen3_moe_dense_layers,
            ),
            adapter=Qwen3StyleAdapter,
            titan_name="qwen3",
        ),
        Architecture(
            model_type="olmoe",
            hf_class="OlmoeForCausalLM",
            defaults={**_GQA_DEFAULTS, "rope_theta": 10000.0, "clip_qkv": None, "norm_topk_prob": False},
            refusals=_olmoe_refusals,
            build=_gqa_build(
                qk_norm="projection",
                experts="num_experts",
                expert_width="intermediate_size",
                route_norm="norm_topk_prob",
            ),
            adapter=Qwen3StyleAdapter,
            titan_name="qwen3",
        ),
        Architecture(
            model_type="mixtral",
            hf_class="MixtralForCausalLM",
            defaults={**_GQA_DEFAULTS, "rope_theta": 1_000_000.0, "sliding_window": None, "router_jitter_noise": 0.0},
            refusals=_mixtral_refusals,
            build=_gqa_build(
                qk_norm=None, experts="num_local_experts", expert_width="intermediate_size", route_norm=None
            ),
            adapter=MixtralAdapter,
            titan_name="qwen3",
        ),
        Architecture(
            model_type="deepseek_v3",
            hf_class="DeepseekV3ForCausalLM",
            defaults={
                "hidden_act": "silu",
                "attention_bias": False,
                "tie_word_embeddings": False,
                "rope_theta": 10000.0,
                "rope_interleave": True,
                "q_lora_rank": None,
                "n_group": 1,
                "topk_group": 1,
                "norm_topk_prob": True,
                "first_k_dense_replace": 0,
            },
            refusals=_deepseek_v3_refusals,
            build=_build_deepseek_v3,
            adapter=DeepSeekV3Adapter,
            titan_name="deepseek_v3",
            has_correction_bias=True,
            ignored_tensors=_deepseek_v3_ignored,
        ),
    )
}


def architecture_of(hf_config: Mapping[str, Any]) -> Architecture:
    """The family of ``hf_config`` (its ``model_type``); ``UnsupportedArchitecture`` for others."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[model_type]


def reader(hf_config: Mapping[str, Any]) -> ConfigReader:
    return ConfigReader(hf_config, architecture_of(hf_config).defaults)


def model_spec_from_hf_config(
    name: str,
    hf_config: Mapping[str, Any],
    *,
    compute_backend: ComputeBackend | None,
    attn_backend: str = "flex",
) -> ModelSpec:
    """The torchtitan ``ModelSpec`` computing ``hf_config``'s model as transformers does.

    ``compute_backend`` None keeps torchtitan's own MoE layers (their experts compute in bf16).
    Raises ``UnsupportedArchitecture`` listing every flag that cannot be computed.
    """
    architecture = architecture_of(hf_config)
    read = reader(hf_config)
    if refusals := architecture.refusals(read):
        raise UnsupportedArchitecture(f"{architecture.hf_class}: not supported: " + "; ".join(refusals))
    try:
        model, parallelize_fn = architecture.build(read, attn_backend)
        if compute_backend is not None:
            model = use_routing(use_backend_experts(model, compute_backend))
    except UnsupportedArchitecture:
        raise
    except ValueError as e:
        raise UnsupportedArchitecture(f"{architecture.hf_class}: {e}") from None
    return ModelSpec(
        name=architecture.titan_name,
        flavor=name,
        model=model,
        parallelize_fn=moe_parallelize(parallelize_fn),
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=with_hf_config(architecture.adapter, hf_config),
    )


def scaled_down(hf_config: Mapping[str, Any], **sizes: Any) -> dict[str, Any]:
    """``hf_config`` with every flag kept and the sizes in ``sizes`` (Hugging Face field names) replaced.

    Fields that index layers follow a smaller ``num_hidden_layers`` (``mlp_only_layers``
    keeps the indices that still exist). Unknown field names are refused, so a typo cannot
    leave a size unchanged.
    """
    known = set(hf_config) | set(architecture_of(hf_config).defaults)
    unknown = sorted(set(sizes) - known)
    if unknown:
        raise UnsupportedArchitecture(
            f"scaled_down: {', '.join(unknown)} not fields of this {hf_config['model_type']} config"
        )
    small = {**hf_config, **sizes}
    if small.get("mlp_only_layers"):
        small["mlp_only_layers"] = [i for i in small["mlp_only_layers"] if i < small["num_hidden_layers"]]
    return small


PUBLISHED: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "OLMoE-1B-7B-0924": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "clip_qkv": None,
        "tie_word_embeddings": False,
    },
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "tie_word_embeddings": False,
    },
    "Moonlight-16B-A3B": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 163840,
        "hidden_size": 2048,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.446,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
}
"""Architecture fields of published ``config.json`` files (the hub repository's name as key)."""
