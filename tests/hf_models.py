"""Random Hugging Face models of each family, built by transformers, and the same models in the
project: what the checkpoint tests (tests/test_hf_checkpoints*.py) compare."""

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from torchtitan_ext.compat.cpu import adapt_config_for_cpu
from torchtitan_ext.data import TINY_STORIES_DIR, TOKENIZER_DIR
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts, get_backend
from torchtitan_ext.experiments.moe_backends.flavors import TINY_HF_FLAVORS, hf_flavor_config, tiny_hf_config
from torchtitan_ext.run_training import FlavorConfigManager

FAMILY_FLAVORS = list(TINY_HF_FLAVORS)
"""The tiny flavor of every family."""

VARIANTS = {
    "tiny-qwen3-moe": [
        {},
        dict(mlp_only_layers=[0], norm_topk_prob=False, tie_word_embeddings=True, head_dim=8, rope_theta=10000.0),
    ],
    "tiny-olmoe": [{}, dict(norm_topk_prob=True, num_key_value_heads=2)],
    "tiny-mixtral": [{}, dict(head_dim=24, num_local_experts=8)],
    "tiny-deepseek-v3": [
        {},
        dict(q_lora_rank=24, n_group=4, topk_group=2, rope_interleave=False, norm_topk_prob=False),
        dict(
            rope_scaling=dict(
                type="yarn",
                factor=40.0,
                mscale=0.707,
                mscale_all_dim=0.707,
                original_max_position_embeddings=64,
                beta_fast=32,
                beta_slow=1,
            )
        ),
    ],
}
"""Flags of each family beyond its tiny flavor's (the published model's): every variant must
compute what transformers computes too."""

TOKENS = torch.randint(0, 597, (2, 24), generator=torch.Generator().manual_seed(1))
"""A batch of token ids every model of these tests reads (the shipped tokenizer's range)."""


def hf_config_variant(flavor: str, variant: dict) -> dict:
    return {**tiny_hf_config(flavor), **variant}


def random_hf_model(hf_config: dict, seed: int = 0, dtype: torch.dtype = torch.float32):
    """transformers' model of ``hf_config`` with every weight random (norm weights near 1,
    projections of unit-scale outputs, DeepSeek-V3's correction bias non-zero), in eval mode."""
    fields = {key: value for key, value in hf_config.items() if key != "architectures"}
    config = AutoConfig.for_model(**fields)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            if parameter.dim() == 1:
                parameter.copy_(1 + 0.1 * torch.randn(parameter.shape, generator=generator))
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * parameter.shape[-1] ** -0.5)
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model.to(dtype).eval()


def save_hub_folder(model, folder: Path, *, max_shard_size: str | None = None) -> Path:
    """``model.save_pretrained(folder)`` plus the shipped tokenizer: a hub snapshot's layout."""
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    for path in TOKENIZER_DIR.iterdir():
        shutil.copy(path, folder)
    return folder


def hub_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``folder`` (not below it)."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def hf_logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens.to(model.device)).logits.float()


def project_config(hf_config: dict, compute_backend: str | None, name: str = "test"):
    """The flavor config of ``hf_config`` with causal SDPA attention (the CPU stand-in for
    FlexAttention that torchtitan's Trainer gets on CPU), so that a forward needs no mask."""
    config = hf_flavor_config(name, hf_config, compute_backend)
    adapt_config_for_cpu(config)
    return config


def load_project_model(config, folder: Path, device: str = "cpu"):
    """The flavor's model with the Hugging Face checkpoint in ``folder`` loaded through its adapter."""
    model_config = config.model_spec.model
    with torch.device(device):
        model = model_config.build()
    adapter = config.model_spec.state_dict_adapter(model_config, str(folder))
    model.load_state_dict(adapter.from_hf(hub_tensors(folder)), strict=True)
    return model.eval()


def use_backend(model, compute_backend: str) -> None:
    """Switch every experts module of a built model to ``compute_backend`` (what
    ``moe.compute_backend`` sets at build time)."""
    for module in model.modules():
        if isinstance(module, BackendGroupedExperts):
            module.compute_backend, module.backend = compute_backend, get_backend(compute_backend)


def write_config(folder: Path, **changes) -> None:
    """Change fields of ``folder``'s config.json."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def write_corpus(folder: Path, records: int = 4, stories_per_record: int = 10) -> Path:
    """``records`` long documents (``stories_per_record`` stories each), so that every rank's
    first batch lies inside one document, as transformers reads a sequence."""
    folder.mkdir()
    lines = (TINY_STORIES_DIR / "train.jsonl").read_text().splitlines()[: records * stories_per_record]
    stories = [json.loads(line)["text"] for line in lines]
    documents = [" ".join(stories[i : i + stories_per_record]) for i in range(0, len(stories), stories_per_record)]
    (folder / "part-0.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    return folder


def without_checkpoint_options(args: list[str]) -> list[str]:
    """``args`` without any ``--checkpoint.*`` option and its value (the options that take one)."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value and not arg.startswith("--"):
            skip_value = False
            continue
        skip_value = arg.startswith("--checkpoint.")
        if not skip_value:
            kept.append(arg)
    return kept


def first_step_loss_of_transformers(hf_model, args: list[str], world: int) -> float:
    """transformers' mean token loss over every rank's first batch, read by torchtitan's dataloader
    (the run's config, read again after the run: without its checkpoint, which would be a resume)."""
    config = FlavorConfigManager().parse_args(without_checkpoint_options(args))
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    total, count = 0.0, 0
    for rank in range(world):
        loader = config.dataloader.build(
            dp_world_size=world,
            dp_rank=rank,
            tokenizer=tokenizer,
            seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
        )
        inputs, labels = next(iter(loader))
        assert (inputs["positions"] == torch.arange(inputs["input"].shape[1])).all(), "one document per sequence"
        with torch.no_grad():
            logits = hf_model(inputs["input"].to(hf_model.device)).logits.float().cpu()
        total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
        count += labels.numel()
    return total / count
