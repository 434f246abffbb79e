"""torchtitan's Hugging Face checkpoint switches, for the flavors built from a Hugging Face config.

``checkpoint.initial_load_in_hf`` (with ``checkpoint.initial_load_path``, or the
``hf_assets_path`` folder) loads a Hugging Face checkpoint into the model, sharded as the run
shards it (FSDP, EP), through the flavor's state-dict adapter; ``checkpoint.last_save_in_hf``
saves the trained model back as safetensors. ``check_hf_checkpoints`` runs on the final config,
before any process group or model is built, and refuses in one message (exit 2):

- the switches without ``checkpoint.enable`` (torchtitan would silently load and save
  nothing; torchtitan's own config checks refuse a full, not model-only, HF load or save);
- a checkpoint folder that is missing, has missing shards, or holds another model: the first
  tensor whose name or shape does not match the flavor's model is named, with the
  ``model_type`` of its ``config.json`` when that differs; a ``config.json`` of the same family
  whose flags differ (RoPE base, norm epsilon, router normalisation, ...) is named too;
- a router bias that the saved Hugging Face model could not hold (Qwen3-MoE, OLMoE and Mixtral
  routers have none; DeepSeek-V3's ``e_score_correction_bias`` needs torchtitan's
  ``expert_bias_E``, i.e. ``moe.load_balance_coeff`` > 0).

A tokenizer whose vocabulary exceeds the model's is refused by the framework's data checks.
When ``checkpoint.folder`` already holds step folders, torchtitan resumes from them and ignores
the initial load; then the checkpoint folder is not inspected.

``HFCheckpointManager`` writes, beside a last save in Hugging Face format, the ``config.json``
(the one of ``hf_assets_path`` when it has one, else the flavor's, with the exported dtype)
and the tokenizer and generation files of ``hf_assets_path``, so transformers loads the folder,
and removes the per-rank parts torchtitan staged before consolidating them.
"""

import json
import os
import re
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torchtitan.models.common.moe import MoE

from torchtitan_ext.checkpoint_integrity import IntegrityCheckpointManager, step_numbers
from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.checks import register_config_check
from torchtitan_ext.validation import named

from .architectures import ConfigReader, UnsupportedArchitecture, architecture_of, reader
from .checkpoint_files import CONFIG_FILE, CheckpointFolderError, checkpoint_tensors, first_mismatch
from .state_dict_adapters import HFConfigAdapter, expected_hf_tensors

HF_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
)
"""Files of a Hugging Face model folder besides its weights and ``config.json``."""

STAGING_FOLDER = "sharded"
"""Where torchtitan's Hugging Face save stages each rank's tensors before consolidating them."""

UNCOMPARED_FIELDS = frozenset({"max_position_embeddings"})
"""Config fields that may differ between a checkpoint and the flavor: the RoPE length only
bounds ``training.seq_len`` (which the framework checks), it changes nothing computed."""


def hf_config_of(config) -> dict[str, Any] | None:
    """The Hugging Face config the flavor's model was built from; None for other flavors."""
    adapter = getattr(config.model_spec, "state_dict_adapter", None)
    if isinstance(adapter, type) and issubclass(adapter, HFConfigAdapter) and adapter.hf_config:
        return dict(adapter.hf_config)
    return None


class _RecordingReader(ConfigReader):
    """A ``ConfigReader`` that remembers what it was asked (the fields a family depends on)."""

    def __init__(self, hf_config, defaults):
        super().__init__(hf_config, defaults)
        self.fields: dict[str, Any] = {}

    def __call__(self, key: str) -> Any:
        self.fields[key] = value = super().__call__(key)
        return value

    def rope(self) -> dict[str, Any]:
        self.fields["rope"] = rope = super().rope()
        return rope


def _architecture(hf_config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The fields (and normalised RoPE settings) the model built from ``hf_config`` reads, and
    that model config as text (object addresses and RoPE lengths left out)."""
    architecture = architecture_of(hf_config)
    recording = _RecordingReader(hf_config, architecture.defaults)
    if refusals := architecture.refusals(recording):
        raise UnsupportedArchitecture("; ".join(refusals))
    model, _ = architecture.build(recording, "flex")
    text = re.sub(r" at 0x[0-9a-f]+|max_seq_len=\d+", "", repr(model))
    return {key: value for key, value in recording.fields.items() if key not in UNCOMPARED_FIELDS}, text


def flag_difference(flavor_config: dict[str, Any], checkpoint_config: dict[str, Any]) -> str | None:
    """How the model ``checkpoint_config`` describes differs from the flavor's, naming the first
    field set otherwise; None when both build the same model (however the files spell it)."""
    flavor_fields, flavor_model = _architecture(flavor_config)
    try:
        checkpoint_fields, checkpoint_model = _architecture(checkpoint_config)
    except (UnsupportedArchitecture, ValueError) as e:
        return f"its config.json describes a model this project cannot build ({e})"
    if checkpoint_model == flavor_model:
        return None
    for key, value in flavor_fields.items():
        if checkpoint_fields.get(key) != value:
            return f"its config.json has {key} = {checkpoint_fields.get(key)!r}, the flavor's model {value!r}"
    return "its config.json describes another model than the flavor's"


def _resuming(config) -> bool:
    """torchtitan resumes from ``checkpoint.folder``'s step folders and then skips the initial load."""
    folder = os.path.join(config.dump_folder, config.checkpoint.folder)
    return bool(step_numbers(folder)) and not getattr(config.checkpoint, "start_fresh", False)


def checkpoint_folder_errors(config, hf_config: dict[str, Any]) -> list[str]:
    """What makes the initial Hugging Face checkpoint unloadable into the flavor's model."""
    checkpoint = config.checkpoint
    if checkpoint.initial_load_path:
        folder, key = checkpoint.initial_load_path, named("checkpoint.initial_load_path")
    else:
        folder, key = str(config.hf_assets_path), named("hf_assets_path", "data.tokenizer")
    where = f"{key} = {folder!r}"
    try:
        found = checkpoint_tensors(folder)
    except CheckpointFolderError as e:
        return [f"{where}: {e}"]
    checkpoint_config = None
    config_file = Path(folder) / CONFIG_FILE
    if config_file.is_file():
        try:
            checkpoint_config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            return [f"{where}: {CONFIG_FILE} is unreadable ({e})"]
    adapter = config.model_spec.state_dict_adapter
    ignored = partial(architecture_of(hf_config).ignored_tensors, reader(hf_config))
    problem = first_mismatch(expected_hf_tensors(config.model_spec.model, adapter), found, ignored)
    checkpoint_family = None if checkpoint_config is None else checkpoint_config.get("model_type")
    other_family = checkpoint_config is not None and checkpoint_family != hf_config["model_type"]
    family = f"its {CONFIG_FILE} describes a {checkpoint_family!r} model" if other_family else ""
    if problem is None and checkpoint_config is not None:
        problem = family or flag_difference(hf_config, checkpoint_config)
    elif problem is not None and family:
        problem = f"{problem} ({family}, the flavor a {hf_config['model_type']!r} one)"
    if problem is None:
        return []
    return [
        f"{where} does not hold this flavor's model: {problem}; pick the flavor of this checkpoint, "
        "or register one built from its config.json (docs/hf_checkpoints.md)"
    ]


def router_bias_errors(config, hf_config: dict[str, Any]) -> list[str]:
    """A router bias the Hugging Face model has no place for, or lacks."""
    architecture = architecture_of(hf_config)
    coefficients = {moe.load_balance_coeff for _, moe, _, _ in config.model_spec.model.traverse(MoE.Config)}
    key = named("moe.load_balance_coeff")
    if architecture.has_correction_bias and None in coefficients:
        return [
            f"{key} is off: {architecture.hf_class}'s router adds e_score_correction_bias, which is "
            "torchtitan's expert_bias_E (kept only while load_balance_coeff > 0)"
        ]
    if not architecture.has_correction_bias and coefficients - {None}:
        return [
            f"{key} = {sorted(coefficients - {None})[0]} gives the router a bias that a {architecture.hf_class} "
            "checkpoint cannot hold; with checkpoint.last_save_in_hf leave it off (0)"
        ]
    return []


@register_config_check
def check_hf_checkpoints(config) -> None:
    """Refuse Hugging Face checkpoint settings that would fail or be ignored (module docstring)."""
    checkpoint = config.checkpoint
    loads, saves = checkpoint.initial_load_in_hf, checkpoint.last_save_in_hf
    if config.model_spec is None or not (loads or saves):
        return
    switches = " and ".join(
        named(key)
        for key, on in (("checkpoint.initial_load_in_hf", loads), ("checkpoint.last_save_in_hf", saves))
        if on
    )
    errors = []
    if not checkpoint.enable:
        errors.append(f"{switches} needs {named('checkpoint.enable')}: without it torchtitan loads and saves nothing")
    hf_config = hf_config_of(config)
    if hf_config is None:
        if config.model_spec.state_dict_adapter is None:
            errors.append(f"{switches}: this flavor's model has no Hugging Face state-dict adapter")
        if errors:
            raise ConfigError("\n".join(errors))
        return
    errors += router_bias_errors(config, hf_config)
    if loads and checkpoint.enable and not _resuming(config):
        errors += checkpoint_folder_errors(config, hf_config)
    if errors:
        raise ConfigError("\n".join(errors))


def write_hf_model_files(folder: str, hf_config: dict[str, Any], hf_assets_path: str | None, dtype: str) -> None:
    """``config.json`` (``hf_assets_path``'s, else ``hf_config``) with ``dtype``, and the
    tokenizer and generation files of ``hf_assets_path``, into ``folder``."""
    source = Path(hf_assets_path) if hf_assets_path else None
    config = dict(hf_config)
    if source is not None and (source / CONFIG_FILE).is_file():
        config = json.loads((source / CONFIG_FILE).read_text())
    config.setdefault("architectures", [architecture_of(config).hf_class])
    for dtype_key in [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]:
        config[dtype_key] = dtype
    (Path(folder) / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if source is None:
        return
    for name in HF_SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, Path(folder) / name)


class HFCheckpointManager(IntegrityCheckpointManager):
    """The integrity-checked checkpoint manager; a last save in Hugging Face format also gets
    ``config.json`` and the tokenizer files (``write_hf_model_files``), before its manifest."""

    @dataclass(kw_only=True, slots=True)
    class Config(IntegrityCheckpointManager.Config):
        pass

    def _save_last_step(self, curr_step: int) -> None:
        super()._save_last_step(curr_step)
        adapter = self.sd_adapter
        if not (self.last_save_in_hf and isinstance(adapter, HFConfigAdapter) and adapter.hf_config):
            return
        folder = self._create_checkpoint_id(curr_step)
        if not dist.is_initialized() or dist.get_rank() == 0:
            dtype = str(self.export_dtype).removeprefix("torch.")
            write_hf_model_files(folder, dict(adapter.hf_config), adapter.hf_assets_path, dtype)
            # torchtitan writes each rank's part under sharded/ and consolidates it into the
            # model files beside it; the parts would double the folder's size.
            shutil.rmtree(os.path.join(folder, STAGING_FOLDER), ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()
