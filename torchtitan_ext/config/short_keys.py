"""Short keys: natural names for common knobs, each applied by its own function.

``register_short_key`` adds one (experiments add theirs, e.g. ``moe.compute_backend``); the
framework's own below name torchtitan fields (``training.batch_size`` for
``training.local_batch_size``) or set several (``training.lr`` on every parameter group).
A short key is accepted in TOML files and on the command line (``--training.lr 1e-3``).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan_ext.config.config_tree import set_value


@dataclass(frozen=True)
class ShortKey:
    """A natural TOML key applied by ``apply(config, value)`` after the type check."""

    key: str
    annotation: Any
    help: str
    apply: Callable[[Any, Any], None]
    fields: tuple[str, ...] = ()
    """The config fields (dotted keys) this key is another name for, when it names fixed ones."""
    sets: tuple[str, ...] = ()
    """Other short keys whose option this key sets too, in part (``moe.recompute_preactivations_layers``
    sets ``moe.recompute_preactivations`` in some layers): errors about that option can name this key."""


_SHORT_KEYS: dict[str, ShortKey] = {}


def register_short_key(key: str, annotation: Any, help: str, fields: tuple[str, ...] = (), sets: tuple[str, ...] = ()):
    """Decorator registering ``apply(config, value)`` as the handler of TOML ``key``; ``fields``: the
    config fields it is another name for (``ShortKey.fields``); ``sets``: the other short keys whose
    option it sets too (``ShortKey.sets``)."""

    def decorator(apply: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        if key in _SHORT_KEYS:
            raise ValueError(f"short TOML key {key!r} is registered twice")
        _SHORT_KEYS[key] = ShortKey(key, annotation, help, apply, fields, sets)
        return apply

    return decorator


def short_key(key: str) -> ShortKey | None:
    """The short key named ``key``, or None."""
    return _SHORT_KEYS.get(key)


def short_keys() -> list[ShortKey]:
    """Every registered short key, by name."""
    return sorted(_SHORT_KEYS.values(), key=lambda k: k.key)


def keys_setting(key: str) -> list[str]:
    """The short keys that set ``key``'s option too (``ShortKey.sets``), by name."""
    return [registered.key for registered in short_keys() if key in registered.sets]


def _field_alias(key: str, path: str, annotation: Any, help: str) -> None:
    """Register ``key`` as a short name for the config field at dotted ``path``."""

    def apply(config, value):
        set_value(config, path, value)

    register_short_key(key, annotation, f"{help} (= {path})", fields=(path,))(apply)


_field_alias("training.batch_size", "training.local_batch_size", int, "per-rank batch size")
_field_alias("training.seed", "debug.seed", int | None, "random seed")
_field_alias("parallelism.ep", "parallelism.expert_parallel_degree", int, "expert parallel degree")
_field_alias(
    "parallelism.dp_shard", "parallelism.data_parallel_shard_degree", int, "FSDP degree (-1: all remaining ranks)"
)
_field_alias("parallelism.dp_replicate", "parallelism.data_parallel_replicate_degree", int, "DDP/HSDP replicate degree")
_field_alias("parallelism.tp", "parallelism.tensor_parallel_degree", int, "tensor parallel degree")
_field_alias("parallelism.cp", "parallelism.context_parallel_degree", int, "context parallel degree")
_field_alias("parallelism.pp", "parallelism.pipeline_parallel_degree", int, "pipeline parallel degree")
_field_alias("wandb.enable", "metrics.enable_wandb", bool, "log to Weights & Biases")
_field_alias("tensorboard.enable", "metrics.enable_tensorboard", bool, "log to TensorBoard")
_field_alias("data.dataset", "dataloader.dataset", str, "dataset name registered with torchtitan")
_field_alias("data.path", "dataloader.dataset_path", str | None, "dataset location")
_field_alias("data.tokenizer", "hf_assets_path", str, "folder with tokenizer.json")
_field_alias(
    "data.workers",
    "dataloader.num_workers",
    int,
    "processes loading batches ahead of the step (0: the training process loads each batch)",
)


@register_short_key("training.lr", float, "learning rate of every optimizer parameter group")
def _set_learning_rate(config, lr: float) -> None:
    for group in config.optimizer.param_groups:
        group.optimizer_kwargs["lr"] = lr
