"""Flavors of the MoE backends experiment, and its torchtitan config registry.

Tiny flavors (one per compute backend, and ``tiny-torchtitan-moe`` with torchtitan's own MoE
layers) train in well under a second per step on two CPU cores. Full-size flavors are published
models (Qwen3-30B-A3B, Mixtral-8x7B, OLMoE-1B-7B, a DeepSeek-V3 16B), built from their Hugging
Face ``config.json`` so that they compute what transformers computes and load and save Hugging
Face checkpoints (``hf_flavor_config``, docs/hf_checkpoints.md); each family also has a tiny
flavor for CPU runs. ``<name>-torchtitan-moe`` (qwen3-30b-a3b, olmoe-1b-7b, deepseek-v3-16b) is the
same model with torchtitan's own MoE layers: the stock reference of the GPU measurements. Every
flavor trains on the shipped offline corpus and tokenizer by default. Full-size flavors compile
(torchtitan's ``compile.enable``), and the project's compute in the ``triton`` backend; tiny
flavors run eager (CPU).

Every flavor is a zero-argument function of this module returning its ``Trainer.Config``,
so this module is a torchtitan config registry: ``--module
torchtitan_ext.experiments.moe_backends.flavors --config tiny_moe_grouped_mm`` loads the
flavor ``--flavor tiny-moe-grouped-mm`` loads (``Flavor.torchtitan_args`` gives the pair).
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.config.override import derive
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from torchtitan_ext.checkpoint_integrity import IntegrityCheckpointManager
from torchtitan_ext.config.checks import register_config_check
from torchtitan_ext.config.value_sources import value_source
from torchtitan_ext.data import TINY_STORIES, TOKENIZER_DIR
from torchtitan_ext.metrics.processor import MoEMetricsProcessor
from torchtitan_ext.registry import register_flavor

# The [moe] TOML keys, start-up checks (run in import order) and run description register on import.
from . import run_description, startup_checks, toml_keys, torchtitan_features  # noqa: F401
from .activation_checkpoint import MoESelectiveAC
from .experts import DEFAULT_BACKEND, ComputeBackend
from .hf.architectures import PUBLISHED, model_spec_from_hf_config, scaled_down
from .hf.torchtitan_features import HFCheckpointManager
from .model import qwen3_style_moe
from .model_shapes import MoEShape

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


@dataclass(frozen=True, kw_only=True)
class TrainingRun:
    """How a flavor trains by default: per-rank batch and sequence length, steps, peak learning rate
    and its warm-up steps, metrics every ``log_freq`` steps, whether torchtitan compiles the model
    and the loss (``compile.enable`` with its default components), and how many processes load
    batches ahead of the step (``data_workers``, ``dataloader.num_workers``; 0: the training process
    loads each batch when its step starts, while the GPU waits)."""

    local_batch_size: int
    seq_len: int
    steps: int
    lr: float
    warmup_steps: int
    log_freq: int
    compile: bool
    data_workers: int


TINY_RUN = TrainingRun(
    local_batch_size=8, seq_len=128, steps=50, lr=3e-3, warmup_steps=5, log_freq=1, compile=False, data_workers=0
)
FULL_SIZE_RUN = TrainingRun(
    local_batch_size=4,
    seq_len=4096,
    steps=1000,
    lr=3e-4,
    warmup_steps=100,
    log_freq=10,
    compile=True,
    # Tokenising a step's batch took 18-32 ms of an olmoe-1b-7b step (batch 4 x 2048 on 2x H200,
    # docs/results/gpu_training.md), during which the GPU idled: a step replayed as a CUDA graph leaves
    # the host nothing else to do, so one worker process loading the next batch meanwhile hides it.
    data_workers=1,
)
DEEPSEEK_V3_16B_RUN = dataclasses.replace(FULL_SIZE_RUN, lr=2.2e-4)


def moe_trainer_config(model_spec: ModelSpec, run: TrainingRun, *, expert_parallel_degree: int = 1) -> Trainer.Config:
    """A complete ``Trainer.Config`` around ``model_spec`` on the shipped corpus."""
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=str(TOKENIZER_DIR),
        # pyrefly: ignore[missing-attribute]  # ModelSpec types model as BaseModel.Config; a decoder's has vocab_size
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size)),
        metrics=MoEMetricsProcessor.Config(log_freq=run.log_freq),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=TINY_STORIES, num_workers=run.data_workers),
        optimizer=default_adamw(lr=run.lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=run.warmup_steps, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1
        ),
        compile=CompileConfig(enable=run.compile),
        # CUDA graphs off unless the start-up check of moe.ep_receive_rows = "auto" turns them on
        # (cuda_graph_step.py): under expert parallelism a step is captured only with static received
        # rows, which cost memory; without EP, where the host already runs ahead, olmoe-1b-7b trained
        # 1.1% faster with them in one run each (docs/results/gpu_training.md).
        training=TrainingConfig(
            local_batch_size=run.local_batch_size, seq_len=run.seq_len, steps=run.steps, disable_cuda_graphs=True
        ),
        # Model-parallel axes only: these models carry no SPMD sharding annotations, which
        # torchtitan's default "spmd_types" backend needs for FSDP.
        parallelism=ParallelismConfig(expert_parallel_degree=expert_parallel_degree, spmd_backend="partial_dtensor"),
        checkpoint=IntegrityCheckpointManager.Config(interval=500, last_save_model_only=False),
        activation_checkpoint=MoESelectiveAC.Config(),
        debug=DebugConfig(seed=0),
    )


SCHEDULE_KEYS = ("lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio", "lr_scheduler.total_steps")


@register_config_check
def fit_the_schedule_to_a_short_run(config) -> None:
    """A run shorter than its flavor's warm-up plus decay (``TrainingRun``: under 25 steps for the tiny
    flavors) warms up for at most its steps and decays over the rest, unless the TOML files or the
    command line set the schedule (torchtitan would shorten it too, with two warnings per run)."""
    scheduler = config.lr_scheduler
    if any(value_source(key) for key in SCHEDULE_KEYS) or not isinstance(scheduler.decay_ratio, float):
        return
    steps = scheduler.total_steps or config.training.steps
    if steps < 1 or scheduler.warmup_steps + round(steps * scheduler.decay_ratio) <= steps:
        return
    scheduler.warmup_steps = min(scheduler.warmup_steps, steps)
    scheduler.decay_ratio = (steps - scheduler.warmup_steps) / steps


def tiny_flavor_name(compute_backend: ComputeBackend) -> str:
    return "tiny-moe-" + compute_backend.replace("_", "-")


def tiny_moe(name: str, compute_backend: ComputeBackend | None) -> Trainer.Config:
    """The tiny model on the CPU smoke-run settings; ``compute_backend`` None keeps torchtitan's own MoE."""
    config = moe_trainer_config(qwen3_style_moe(name, TINY_SHAPE, compute_backend=compute_backend), TINY_RUN)
    # Smoke-run models: full fp32 (no bf16 autocast or FSDP bf16 parameters), so every
    # backend, and the Triton interpreter on CPU, computes the same function.
    config.training.mixed_precision_param = "float32"
    return config


FULL_SIZE_BACKEND: ComputeBackend = "triton"
"""The compute backend of the full-size flavors: the fastest on GPUs. ``--moe.compute_backend`` picks
another; the tiny flavors keep each their own."""


def hf_flavor_config(
    name: str,
    hf_config: dict,
    compute_backend: ComputeBackend | None = FULL_SIZE_BACKEND,
    run: TrainingRun = FULL_SIZE_RUN,
) -> Trainer.Config:
    """The ``Trainer.Config`` of the model a Hugging Face ``config.json`` (``hf_config``) describes,
    by default on the full-size settings (``FULL_SIZE_BACKEND``, ``FULL_SIZE_RUN``: compiled).

    The model is ``hf.architectures.model_spec_from_hf_config``'s; its checkpoints load from and save
    to the Hugging Face format (docs/hf_checkpoints.md).
    """
    config = moe_trainer_config(model_spec_from_hf_config(name, hf_config, compute_backend=compute_backend), run)
    config.checkpoint = derive(config.checkpoint, HFCheckpointManager.Config)
    return config


def register_tiny_flavor(compute_backend: ComputeBackend) -> Callable[[], Trainer.Config]:
    """Register the flavor ``tiny-moe-<backend>`` and return its config function, named
    ``tiny_moe_<compute_backend>``: this module binds it to that name, where torchtitan's
    ``--config`` looks it up."""

    def build() -> Trainer.Config:
        return tiny_moe(tiny_flavor_name(compute_backend), compute_backend)

    build.__name__ = build.__qualname__ = "tiny_moe_" + compute_backend
    build.__doc__ = f"The {tiny_flavor_name(compute_backend)} flavor's Trainer.Config."
    description = f"2-layer, 8-expert top-2 MoE (dim 64) for CPU smoke runs; {compute_backend} experts"
    return register_flavor(tiny_flavor_name(compute_backend), description)(build)


# One tiny flavor per backend of the table, each bound to its function's name (tests/test_flavors.py checks).
tiny_moe_grouped_mm = register_tiny_flavor("grouped_mm")
tiny_moe_for_loop = register_tiny_flavor("for_loop")
tiny_moe_batched_mm_padded = register_tiny_flavor("batched_mm_padded")
tiny_moe_triton = register_tiny_flavor("triton")


STOCK_REFERENCE = "torchtitan's own MoE layers (router, dispatcher, grouped_mm experts): the stock reference"
STOCK_FULL_SIZE = f"{STOCK_REFERENCE}; its experts compute in bf16 even with fp32 parameters"


@register_flavor("tiny-torchtitan-moe", f"the tiny model with {STOCK_REFERENCE}")
def tiny_torchtitan_moe() -> Trainer.Config:
    return tiny_moe("tiny-torchtitan-moe", None)


@register_flavor(
    "qwen3-30b-a3b", "Qwen3-30B-A3B (Qwen3-MoE): 48 layers, dim 2048, 128 experts top-8, F 768, per-head QK-norm"
)
def qwen3_30b_a3b() -> Trainer.Config:
    return hf_flavor_config("qwen3-30b-a3b", PUBLISHED["Qwen3-30B-A3B"])


@register_flavor("qwen3-30b-a3b-torchtitan-moe", f"qwen3-30b-a3b with {STOCK_FULL_SIZE}")
def qwen3_30b_a3b_torchtitan_moe() -> Trainer.Config:
    return hf_flavor_config("qwen3-30b-a3b-torchtitan-moe", PUBLISHED["Qwen3-30B-A3B"], compute_backend=None)


@register_flavor("mixtral-8x7b", "Mixtral-8x7B-v0.1: 32 layers, dim 4096, 8 experts top-2, F 14336, no QK-norm")
def mixtral_8x7b() -> Trainer.Config:
    return hf_flavor_config("mixtral-8x7b", PUBLISHED["Mixtral-8x7B-v0.1"])


@register_flavor(
    "olmoe-1b-7b", "OLMoE-1B-7B-0924: 16 layers, dim 2048, 64 experts top-8, F 1024, QK-norm over whole projections"
)
def olmoe_1b_7b() -> Trainer.Config:
    return hf_flavor_config("olmoe-1b-7b", PUBLISHED["OLMoE-1B-7B-0924"])


@register_flavor("olmoe-1b-7b-torchtitan-moe", f"olmoe-1b-7b with {STOCK_FULL_SIZE}")
def olmoe_1b_7b_torchtitan_moe() -> Trainer.Config:
    return hf_flavor_config("olmoe-1b-7b-torchtitan-moe", PUBLISHED["OLMoE-1B-7B-0924"], compute_backend=None)


@register_flavor(
    "deepseek-v3-16b",
    "DeepSeek-V3 architecture at 16B (Moonlight-16B-A3B): MLA, 27 layers, dim 2048, 64 experts top-6 + 2 shared, "
    "sigmoid routing with correction bias",
)
def deepseek_v3_16b() -> Trainer.Config:
    return hf_flavor_config("deepseek-v3-16b", PUBLISHED["Moonlight-16B-A3B"], run=DEEPSEEK_V3_16B_RUN)


@register_flavor("deepseek-v3-16b-torchtitan-moe", f"deepseek-v3-16b with {STOCK_FULL_SIZE}")
def deepseek_v3_16b_torchtitan_moe() -> Trainer.Config:
    return hf_flavor_config(
        "deepseek-v3-16b-torchtitan-moe", PUBLISHED["Moonlight-16B-A3B"], compute_backend=None, run=DEEPSEEK_V3_16B_RUN
    )


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


def register_tiny_hf_flavor(name: str) -> Callable[[], Trainer.Config]:
    """Register tiny flavor ``name`` (``TINY_HF_FLAVORS``, fp32 like the other tiny flavors) and return
    its config function, named like the flavor with underscores: this module binds it to that name."""

    def build() -> Trainer.Config:
        config = hf_flavor_config(name, tiny_hf_config(name), DEFAULT_BACKEND, run=TINY_RUN)
        config.training.mixed_precision_param = "float32"
        return config

    build.__name__ = build.__qualname__ = name.replace("-", "_")
    build.__doc__ = f"The {name} flavor's Trainer.Config."
    published, _ = TINY_HF_FLAVORS[name]
    description = f"{published}'s architecture and flags at dim 64, 2 layers: CPU runs and checkpoint tests"
    return register_flavor(name, description)(build)


tiny_qwen3_moe = register_tiny_hf_flavor("tiny-qwen3-moe")
tiny_olmoe = register_tiny_hf_flavor("tiny-olmoe")
tiny_mixtral = register_tiny_hf_flavor("tiny-mixtral")
tiny_deepseek_v3 = register_tiny_hf_flavor("tiny-deepseek-v3")
