"""Flavors of the MoE backends experiment, and its torchtitan config registry.

Tiny flavors (one per compute backend) train in well under a second per step on
two CPU cores. Full-size flavors are published models (Qwen3-30B-A3B, Mixtral-8x7B,
OLMoE-1B-7B, a DeepSeek-V3 16B), built from their Hugging Face ``config.json`` so that they
compute what transformers computes and load and save Hugging Face checkpoints
(``hf_flavor_config``, docs/hf_checkpoints.md); each family also has a tiny flavor for CPU
runs. Every flavor trains on the shipped offline corpus and tokenizer by default.

Every flavor is a zero-argument function of this module returning its ``Trainer.Config``,
so this module is a torchtitan config registry: ``--module
torchtitan_ext.experiments.moe_backends.flavors --config tiny_moe_grouped_mm`` loads the
flavor ``--flavor tiny-moe-grouped-mm`` loads (``Flavor.torchtitan_args`` gives the pair).
"""

from collections.abc import Callable

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.config.override import derive
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from torchtitan_ext.checkpoint_integrity import IntegrityCheckpointManager
from torchtitan_ext.data import TINY_STORIES, TOKENIZER_DIR
from torchtitan_ext.metrics.processor import MoEMetricsProcessor
from torchtitan_ext.registry import register_flavor

from . import toml_keys, torchtitan_features  # noqa: F401  (register the [moe] TOML keys and start-up checks)
from .experts import DEFAULT_BACKEND, ComputeBackend, backend_names
from .hf.architectures import PUBLISHED, model_spec_from_hf_config, scaled_down
from .hf.torchtitan_features import HFCheckpointManager
from .model import MoEShape, qwen3_style_moe

TINY_SHAPE = MoEShape(
    vocab_size=640,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    moe_hidden_dim=96,
    num_experts=8,
    top_k=2,
    max_seq_len=512,
)


def moe_trainer_config(
    model_spec: ModelSpec,
    *,
    local_batch_size: int,
    seq_len: int,
    steps: int,
    lr: float,
    warmup_steps: int,
    log_freq: int,
    expert_parallel_degree: int = 1,
) -> Trainer.Config:
    """A complete ``Trainer.Config`` around ``model_spec`` on the shipped corpus."""
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=str(TOKENIZER_DIR),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size)),
        metrics=MoEMetricsProcessor.Config(log_freq=log_freq),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=TINY_STORIES),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=warmup_steps, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1
        ),
        # CUDA graphs stay off: the MoE metrics hooks keep Python-side counts, and the EP
        # dispatch and the for_loop / batched_mm_padded experts read counts on the host.
        training=TrainingConfig(
            local_batch_size=local_batch_size, seq_len=seq_len, steps=steps, disable_cuda_graphs=True
        ),
        # Model-parallel axes only: these models carry no SPMD sharding annotations, which
        # torchtitan's default "spmd_types" backend needs for FSDP.
        parallelism=ParallelismConfig(expert_parallel_degree=expert_parallel_degree, spmd_backend="partial_dtensor"),
        checkpoint=IntegrityCheckpointManager.Config(interval=500, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
        debug=DebugConfig(seed=0),
    )


def tiny_flavor_name(compute_backend: ComputeBackend) -> str:
    return "tiny-moe-" + compute_backend.replace("_", "-")


def tiny_config_function_name(compute_backend: ComputeBackend) -> str:
    """The name of the tiny flavor's config function in this module (``--config``)."""
    return "tiny_moe_" + compute_backend


TINY_TRAINING = dict(local_batch_size=8, seq_len=128, steps=50, lr=3e-3, warmup_steps=5, log_freq=1)
"""Training settings of the tiny flavors (CPU smoke runs)."""


def tiny_moe(compute_backend: ComputeBackend) -> Trainer.Config:
    config = moe_trainer_config(
        qwen3_style_moe(tiny_flavor_name(compute_backend), TINY_SHAPE, compute_backend=compute_backend),
        **TINY_TRAINING,
    )
    # Smoke-run models: full fp32 (no bf16 autocast or FSDP bf16 parameters), so every
    # backend, and the Triton interpreter on CPU, computes the same function.
    config.training.mixed_precision_param = "float32"
    return config


def hf_flavor_config(
    name: str, hf_config: dict, compute_backend: ComputeBackend | None = DEFAULT_BACKEND, **training
) -> Trainer.Config:
    """The ``Trainer.Config`` of the model a Hugging Face ``config.json`` (``hf_config``) describes.

    ``training``: ``moe_trainer_config``'s settings (full-size ones by default). The model is
    ``hf.architectures.model_spec_from_hf_config``'s; its checkpoints load from and save to the
    Hugging Face format (docs/hf_checkpoints.md).
    """
    settings = dict(local_batch_size=4, seq_len=4096, steps=1000, lr=3e-4, warmup_steps=100, log_freq=10)
    config = moe_trainer_config(
        model_spec_from_hf_config(name, hf_config, compute_backend=compute_backend), **{**settings, **training}
    )
    config.checkpoint = derive(config.checkpoint, HFCheckpointManager.Config)
    return config


def tiny_config_function(compute_backend: ComputeBackend) -> Callable[[], Trainer.Config]:
    """The tiny flavor's zero-argument config function, named ``tiny_moe_<compute_backend>``."""

    def build() -> Trainer.Config:
        return tiny_moe(compute_backend)

    build.__name__ = build.__qualname__ = tiny_config_function_name(compute_backend)
    build.__doc__ = f"The {tiny_flavor_name(compute_backend)} flavor's Trainer.Config."
    return build


for _backend in backend_names():
    _build = register_flavor(
        tiny_flavor_name(_backend),
        f"2-layer, 8-expert top-2 MoE (dim 64) for CPU smoke runs; {_backend} experts",
    )(tiny_config_function(_backend))
    globals()[_build.__name__] = _build


@register_flavor(
    "qwen3-30b-a3b", "Qwen3-30B-A3B (Qwen3-MoE): 48 layers, dim 2048, 128 experts top-8, F 768, per-head QK-norm"
)
def qwen3_30b_a3b() -> Trainer.Config:
    return hf_flavor_config("qwen3-30b-a3b", PUBLISHED["Qwen3-30B-A3B"])


@register_flavor("mixtral-8x7b", "Mixtral-8x7B-v0.1: 32 layers, dim 4096, 8 experts top-2, F 14336, no QK-norm")
def mixtral_8x7b() -> Trainer.Config:
    return hf_flavor_config("mixtral-8x7b", PUBLISHED["Mixtral-8x7B-v0.1"])


@register_flavor(
    "olmoe-1b-7b", "OLMoE-1B-7B-0924: 16 layers, dim 2048, 64 experts top-8, F 1024, QK-norm over whole projections"
)
def olmoe_1b_7b() -> Trainer.Config:
    return hf_flavor_config("olmoe-1b-7b", PUBLISHED["OLMoE-1B-7B-0924"])


@register_flavor(
    "olmoe-1b-7b-torchtitan-moe",
    "olmoe-1b-7b with torchtitan's own MoE layers (router, dispatcher, grouped_mm experts): the stock reference; "
    "its experts compute in bf16 even with fp32 parameters",
)
def olmoe_1b_7b_torchtitan_moe() -> Trainer.Config:
    return hf_flavor_config("olmoe-1b-7b-torchtitan-moe", PUBLISHED["OLMoE-1B-7B-0924"], compute_backend=None)


@register_flavor(
    "deepseek-v3-16b",
    "DeepSeek-V3 architecture at 16B (Moonlight-16B-A3B): MLA, 27 layers, dim 2048, 64 experts top-6 + 2 shared, "
    "sigmoid routing with correction bias",
)
def deepseek_v3_16b() -> Trainer.Config:
    return hf_flavor_config("deepseek-v3-16b", PUBLISHED["Moonlight-16B-A3B"], lr=2.2e-4)


TINY_HF_FLAVORS: dict[str, tuple[str, dict]] = {
    "tiny-qwen3-moe": (
        "Qwen3-30B-A3B",
        dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "tiny-olmoe": (
        "OLMoE-1B-7B-0924",
        dict(
            hidden_size=64,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "tiny-mixtral": (
        "Mixtral-8x7B-v0.1",
        dict(
            hidden_size=64,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "tiny-deepseek-v3": (
        "Moonlight-16B-A3B",
        dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
        ),
    ),
}
"""Tiny flavors of each Hugging Face family: (published config, sizes) -- the published flags at
dim 64, 2 layers, vocabulary 640 (the shipped tokenizer's 597 tokens fit), 8 experts top-2
(Mixtral: 4 experts)."""


def tiny_hf_config(name: str) -> dict:
    """The Hugging Face config of tiny flavor ``name`` (``TINY_HF_FLAVORS``)."""
    published, sizes = TINY_HF_FLAVORS[name]
    return scaled_down(PUBLISHED[published], vocab_size=640, num_hidden_layers=2, max_position_embeddings=512, **sizes)


def tiny_hf_config_function(name: str) -> Callable[[], Trainer.Config]:
    """Tiny flavor ``name``'s zero-argument config function (fp32 like the other tiny flavors)."""

    def build() -> Trainer.Config:
        config = hf_flavor_config(name, tiny_hf_config(name), **TINY_TRAINING)
        config.training.mixed_precision_param = "float32"
        return config

    build.__name__ = build.__qualname__ = name.replace("-", "_")
    build.__doc__ = f"The {name} flavor's Trainer.Config."
    return build


for _name, (_published, _) in TINY_HF_FLAVORS.items():
    _build = register_flavor(
        _name,
        f"{_published}'s architecture and flags at dim 64, 2 layers: CPU runs and checkpoint tests",
    )(tiny_hf_config_function(_name))
    globals()[_build.__name__] = _build
