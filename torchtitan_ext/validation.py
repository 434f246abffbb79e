"""Start-up validation of a final ``Trainer.Config``: values, cross-field rules, paths.

``check_config_values`` is a registered config check (``config.checks.run_config_checks``): it
runs once on the final config (flavor, TOML files, command line), before any process group
or model is built, and reports every problem in one ``ConfigError``. Each message names the
key, where its value came from when it was overridden, the value and what is allowed.
"""

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.checks import register_value_check
from torchtitan_ext.config.config_tree import child, resolve_parent
from torchtitan_ext.config.names import close_matches_hint
from torchtitan_ext.config.short_keys import short_keys
from torchtitan_ext.config.value_sources import resolved_from, value_source
from torchtitan_ext.parallel_layout import data_parallel_shard_degree
from torchtitan_ext.place_in_launch import local_world_size, world_size

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model")


def named(key: str, *aliases: str) -> str:
    """``key``, prefixed with the file/line or "command line" its value came from (how errors name a key).

    Where the value was set under one of ``aliases`` or a short key naming the same field
    (``parallelism.ep`` for ``parallelism.expert_parallel_degree``), that key is named, as it was written."""
    for written in (key, *aliases):
        if source := value_source(written):
            return f"{source}: {written}"
    for other in short_keys():
        if {key, *aliases} & set(other.fields) and (source := value_source(other.key)):
            return f"{source}: {other.key}"
    return key


def _walk_floats(node: Any, path: str):
    """(dotted path, value) of every float in a config tree (dataclass fields, lists, dicts)."""
    if isinstance(node, float):
        yield path, node
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            if not field.name.startswith("_"):
                yield from _walk_floats(getattr(node, field.name), f"{path}.{field.name}".lstrip("."))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _walk_floats(item, f"{path}.{i}")
    elif isinstance(node, dict):
        for name, item in node.items():
            if isinstance(name, str):
                yield from _walk_floats(item, f"{path}.{name}")


def non_finite_errors(config) -> list[str]:
    """NaN or infinity anywhere in the config (the model config is walked as ``model``)."""
    trees = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model_spec"}
    if config.model_spec is not None:
        trees["model"] = config.model_spec.model
    return [
        f"{named(path)} = {value}: must be a finite number"
        for name, tree in trees.items()
        for path, value in _walk_floats(tree, name)
        if not math.isfinite(value)
    ]


def training_errors(config, world: int) -> list[str]:
    """Steps, batch sizes, learning rate, sequence length vs RoPE and loss chunking, step intervals."""
    t = config.training
    errors = []
    if t.steps < 1:
        errors.append(f"{named('training.steps')} = {t.steps}: must be >= 1")
    if t.local_batch_size < 1:
        errors.append(
            f"{named('training.local_batch_size', 'training.batch_size')} = {t.local_batch_size}: must be >= 1"
        )
    dp = config.parallelism.data_parallel_replicate_degree * data_parallel_shard_degree(config.parallelism, world)
    if t.global_batch_size != -1 and t.local_batch_size >= 1 and dp >= 1:
        per_step = t.local_batch_size * dp
        if t.global_batch_size < 1 or t.global_batch_size % per_step:
            errors.append(
                f"{named('training.global_batch_size')} = {t.global_batch_size}: must be -1 (= local batch x "
                f"data-parallel degree) or a positive multiple of local_batch_size ({t.local_batch_size}) x "
                f"data-parallel degree ({dp}) = {per_step}"
            )
    for group in config.optimizer.param_groups:
        lr = group.optimizer_kwargs.get("lr")
        if isinstance(lr, (int, float)) and not (math.isfinite(lr) and lr > 0):
            errors.append(f"{named('training.lr')} = {lr}: must be a finite number > 0")
            break
    errors.extend(sequence_length_errors(config))
    errors.extend(step_interval_errors(config))
    return errors


STEP_INTERVALS = (
    "metrics.log_freq",
    "training.gc_freq",
    "checkpoint.interval",
    "validator.freq",
    "profiler.profile_freq",
    "profiler.memory_snapshot_freq",
)
"""Fields that say "every N steps": torchtitan divides the step by them (``step % N``)."""


def step_interval_errors(config) -> list[str]:
    """Every ``STEP_INTERVALS`` field the config has is None (off, where allowed) or >= 1."""
    errors = []
    for key in STEP_INTERVALS:
        try:
            value = child(*resolve_parent(config, key.split(".")))
        except (KeyError, AttributeError):
            continue
        if isinstance(value, int) and value < 1:
            errors.append(f"{named(key)} = {value}: must be >= 1 (every N steps)")
    return errors


def sequence_length_errors(config) -> list[str]:
    """``training.seq_len`` > 0, within every RoPE cache and divisible by the loss chunk count."""
    seq_len = config.training.seq_len
    key = named("training.seq_len")
    if seq_len < 1:
        return [f"{key} = {seq_len}: must be >= 1"]
    errors = []
    if config.model_spec is not None:
        limits = {node.max_seq_len for node in _config_nodes(config.model_spec.model) if hasattr(node, "max_seq_len")}
        if limits and seq_len > min(limits):
            errors.append(
                f"{key} = {seq_len}: exceeds the model's RoPE length (max_seq_len = {min(limits)}); "
                f"use at most {min(limits)}"
            )
    num_chunks = getattr(config.loss, "num_chunks", None)
    if isinstance(num_chunks, int) and num_chunks > 0 and seq_len % num_chunks:
        errors.append(
            f"{key} = {seq_len}: the chunked loss splits the sequence into {num_chunks} equal chunks; "
            f"use a multiple of {num_chunks}"
        )
    return errors


def _config_nodes(node: Any):
    """Every dataclass config in a tree, the root included."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        yield node
        for field in dataclasses.fields(node):
            yield from _config_nodes(getattr(node, field.name))
    elif isinstance(node, (list, tuple)):
        for item in node:
            yield from _config_nodes(item)


def data_errors(config) -> list[str]:
    """Dataset name known to torchtitan, local data paths that hold data, tokenizer folder."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    import torchtitan_ext.data

    errors = []
    loader = config.dataloader
    name = getattr(loader, "dataset", None)
    if name is not None and name not in DATASETS:
        errors.append(
            f"{named('dataloader.dataset', 'data.dataset')} = {name!r}: unknown dataset; "
            f"known: {', '.join(sorted(DATASETS))}"
        )
    elif name == torchtitan_ext.data.JSONL_TEXT and not getattr(loader, "dataset_path", None):
        errors.append(
            f"{named('dataloader.dataset', 'data.dataset')} = {name!r} needs "
            f"{named('dataloader.dataset_path', 'data.path')}: a folder of *.jsonl files with a 'text' field"
        )
    elif name is not None:
        path = getattr(loader, "dataset_path", None) or DATASETS[name].path
        key = named("dataloader.dataset_path", "data.path")
        local = Path(path).expanduser()
        if local.is_dir() and not any(p.is_file() and not p.name.startswith(".") for p in local.rglob("*")):
            errors.append(f"{key} = {path!r}: the folder holds no data files")
        elif not local.exists() and (local.is_absolute() or path.startswith(".")):
            errors.append(f"{key} = {path!r}: no such file or folder")
    errors += data_worker_errors(loader)
    tokenizer = Path(config.hf_assets_path).expanduser()
    tokenizer_key = named("hf_assets_path", "data.tokenizer")
    if not tokenizer.is_dir():
        errors.append(
            f"{tokenizer_key} = {str(config.hf_assets_path)!r}: no such folder "
            f"(a folder with {' or '.join(TOKENIZER_FILES)})"
        )
    elif not any((tokenizer / f).is_file() for f in TOKENIZER_FILES):
        errors.append(
            f"{tokenizer_key} = {str(config.hf_assets_path)!r}: the folder has none of {', '.join(TOKENIZER_FILES)}"
        )
    else:
        errors += tokenizer_vocabulary_errors(tokenizer, tokenizer_key, config)
    return errors


def data_worker_errors(loader) -> list[str]:
    """A count of loading processes, and at most one for torchtitan's text and chat datasets, which give
    every worker process the whole stream (each batch would come once per worker)."""
    from torchtitan.hf_datasets import text_datasets

    workers = getattr(loader, "num_workers", 0)
    key = named("dataloader.num_workers", "data.workers")
    whole_stream_loaders = (
        text_datasets.HuggingFaceTextDataLoader.Config,
        text_datasets.InterleavedHuggingFaceTextDataLoader.Config,
        text_datasets.ChatDataLoader.Config,
        text_datasets.InterleavedChatDataLoader.Config,
    )
    if workers < 0:
        return [f"{key} = {workers}: must be >= 0 (0: the training process loads each batch)"]
    if workers > 1 and isinstance(loader, whole_stream_loaders):
        return [
            f"{key} = {workers}: torchtitan's text and chat datasets give every worker process the whole "
            f"stream, so each batch would be trained on {workers} times; use 1 (one process loading batches "
            "ahead of the step) or 0 (the training process loads each batch)"
        ]
    return []


def tokenizer_vocabulary_errors(tokenizer_dir: Path, key: str, config) -> list[str]:
    """A ``tokenizer.json`` whose ids the model's embedding cannot hold."""
    vocab_size = getattr(getattr(config.model_spec, "model", None), "vocab_size", None)
    tokenizer_file = tokenizer_dir / "tokenizer.json"
    if vocab_size is None or not tokenizer_file.is_file():
        return []
    from tokenizers import Tokenizer

    try:
        tokens = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
    except Exception as e:
        return [f"{key}: {tokenizer_file} cannot be read as a tokenizer ({e})"]
    if tokens > vocab_size:
        return [
            f"{key}: the tokenizer has {tokens} tokens but this flavor's model has a vocabulary of "
            f"{vocab_size}; use a flavor whose vocabulary holds the tokenizer"
        ]
    return []


def output_errors(config) -> list[str]:
    """``dump_folder`` and its parents are folders or do not exist yet."""
    folder = Path(config.dump_folder).expanduser()
    for path in (folder, *folder.parents):
        if path.exists() and not path.is_dir():
            return [
                f"{named('dump_folder')} = {str(config.dump_folder)!r}: {path} is a file; dump_folder must be a folder"
            ]
    return []


def resume_errors(config) -> list[str]:
    """With checkpointing on: ``checkpoint.load_step`` names a step folder that exists, and the step a
    resume starts from (that one, else the highest unless ``checkpoint.start_fresh``) is before
    ``training.steps`` (else the run would train nothing)."""
    from torchtitan_ext.checkpoint_integrity import step_numbers, steps_present

    checkpoint = config.checkpoint
    if not checkpoint.enable:
        return []
    folder = os.path.join(config.dump_folder, checkpoint.folder)
    steps = step_numbers(folder)
    if checkpoint.load_step != -1:
        if checkpoint.load_step not in steps:
            return [
                f"{named('checkpoint.load_step')} = {checkpoint.load_step}: no step folder; {steps_present(folder)}"
            ]
        resumed = checkpoint.load_step
    elif steps and not getattr(checkpoint, "start_fresh", False):
        resumed = steps[-1]
    else:
        return []
    total = config.training.steps
    if resumed < total:
        return []
    return [
        f"{named('training.steps')} = {total}: the run would resume from "
        f"{os.path.abspath(os.path.join(folder, f'step-{resumed}'))}, at or past its last step, and train "
        f"nothing. To go on, raise training.steps above {resumed} (e.g. --training.steps {resumed + total}); "
        "to start over, pass --checkpoint.start_fresh or another --checkpoint.folder; to resume an earlier "
        f"step, pass --checkpoint.load_step N ({steps_present(folder)})"
    ]


COMPILE_COMPONENTS = ("model", "loss")
"""What torchtitan's ``compile.components`` names (``"model" in components``, ``"loss" in components``)."""


def compile_errors(config) -> list[str]:
    """``compile.components`` names only ``COMPILE_COMPONENTS`` (torchtitan skips any other name
    silently), and ``compile.backend`` is a backend ``torch.compile`` knows (torchtitan would fail on it
    in the first step)."""
    from torch._dynamo import list_backends

    errors = [
        f"{named('compile.components')} = {config.compile.components!r}: {name!r} is not a component; "
        f"choose from {', '.join(map(repr, COMPILE_COMPONENTS))}{close_matches_hint(name, COMPILE_COMPONENTS)}"
        for name in config.compile.components
        if name not in COMPILE_COMPONENTS
    ]
    backends = list_backends(exclude_tags=())
    if config.compile.backend not in backends:
        errors.append(
            f"{named('compile.backend')} = {config.compile.backend!r}: not a torch.compile backend"
            f"{close_matches_hint(config.compile.backend, backends)} (torchtitan's default: 'inductor'; "
            "'aot_eager' compiles without Inductor)"
        )
    return errors


def memory_errors(config) -> list[str]:
    """On CPU: the model's weights, gradients and optimizer state (a lower bound of training's memory,
    ``model_size.training_state_bytes``), this host's share of them, fit in this machine's memory."""
    from torchtitan_ext.compat import cpu_training
    from torchtitan_ext.model_size import (
        TRAINING_COPIES_PER_PARAMETER,
        gibibytes,
        human_count,
        machine_memory_bytes,
        training_state_bytes,
    )

    if config.model_spec is None or not cpu_training():
        return []
    try:
        parameters, state_bytes = training_state_bytes(config)
    except Exception:  # a model that does not build: the checks of its values say why
        return []
    needed = state_bytes * local_world_size() // world_size()
    available = machine_memory_bytes()
    if needed <= available:
        return []
    return [
        f"the model ({resolved_from()[0] or config.model_spec.name}, {human_count(parameters)} parameters) needs "
        "at least "
        f"{gibibytes(needed)} on this host to train on CPU ({TRAINING_COPIES_PER_PARAMETER} copies of every "
        f"parameter in {config.training.dtype}: weights, gradients and AdamW's two moments), but this machine has "
        f"{gibibytes(available)} of memory; train it on GPUs, or pick a smaller flavor "
        "(python -m torchtitan_ext.flavors lists them with their parameter counts)"
    ]


def memory_snapshot_errors(config) -> list[str]:
    """On CPU: no memory snapshots (torchtitan records them from the CUDA allocator, which a CPU run
    does not have; it would fail with an AttributeError when training starts)."""
    from torchtitan_ext.compat import cpu_training

    if not config.profiler.enable_memory_snapshot or not cpu_training():
        return []
    return [
        f"{named('profiler.enable_memory_snapshot')}: memory snapshots record the CUDA allocator, and this run "
        "trains on CPU; take them on GPUs (then python -m torchtitan_ext.bench memory SNAPSHOT.pickle says "
        "where the reserved memory came from)"
    ]


def context_parallel_errors(config) -> list[str]:
    """On CPU: no context parallelism (torch's context-parallel attention shards the attention kernels of
    CUDA; its CPU one has no sharding rule, so the first step would fail)."""
    from torchtitan_ext.compat import cpu_training

    degree = config.parallelism.context_parallel_degree
    if degree <= 1 or not cpu_training():
        return []
    return [
        f"{named('parallelism.context_parallel_degree')} = {degree}: context parallelism shards CUDA's "
        "attention kernels, and this run trains on CPU (torch has no context-parallel CPU attention); "
        "use data, tensor or expert parallelism here, or train on GPUs"
    ]


@register_value_check
def check_config_values(config) -> None:
    """Every value and cross-field rule of the framework; one ``ConfigError`` lists all problems."""
    world = world_size()
    errors = [
        *non_finite_errors(config),
        *training_errors(config, world),
        *data_errors(config),
        *output_errors(config),
        *compile_errors(config),
        *resume_errors(config),
        *memory_errors(config),
        *memory_snapshot_errors(config),
        *context_parallel_errors(config),
    ]
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
