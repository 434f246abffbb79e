"""Overrides applied to a flavor's ``Trainer.Config``: ``{dotted_key: value}`` from TOML files or
the command line, each key a short key or the dotted path of a config field (``config_tree``).

Values are checked against the field's type annotation (``value_types``). Every override of a
source is checked before anything is applied, and overrides are applied to a copy: a bad file
changes nothing. Ranges and rules between values are the start-up checks' (``checks``), on the
final config.
"""

import copy
import difflib
from pathlib import Path
from typing import Any

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.config_tree import child, children, field_annotation, leaf_keys, resolve_parent, set_child
from torchtitan_ext.config.short_keys import short_key, short_keys
from torchtitan_ext.config.toml_files import read_toml
from torchtitan_ext.config.value_sources import record_value_sources
from torchtitan_ext.config.value_types import check_value

FLAVOR_FIXED_FIELDS: dict[str, str] = {
    "dim": (
        "the model width was copied into the embedding, attention, MoE, norm and output configs "
        "when the flavor was built"
    ),
    "vocab_size": "the vocabulary size was copied into the embedding, output layer and loss when the flavor was built",
    "global_vocab_size": "the vocabulary size is fixed by the flavor's model",
    "num_experts": (
        "the expert count was copied into the router, dispatcher and experts of the layer when the flavor was built"
    ),
    "hidden_dim": "the expert/FFN width fixes the weight shapes the flavor built",
    "n_heads": "the head count was copied into the attention projections when the flavor was built",
    "n_kv_heads": "the KV head count was copied into the attention projections when the flavor was built",
    "head_dim": "the head width was copied into the attention projections and RoPE when the flavor was built",
    "in_features": "layer shapes are fixed by the flavor",
    "out_features": "layer shapes are fixed by the flavor",
    "num_embeddings": "layer shapes are fixed by the flavor",
    "embedding_dim": "layer shapes are fixed by the flavor",
    "normalized_shape": "layer shapes are fixed by the flavor",
}
"""Model-shape fields a flavor derives into other fields when it is built: an override of one
copy would leave the others unchanged (or build a model whose shapes disagree), so it is refused."""


def _fixed_field_error(key: str) -> str | None:
    """Why ``key`` cannot be overridden after the flavor was built, or None."""
    parts = key.split(".")
    if parts[0] not in ("model", "loss") or parts[-1] not in FLAVOR_FIXED_FIELDS:
        return None
    return (
        f"{key} cannot be overridden: {FLAVOR_FIXED_FIELDS[parts[-1]]}; "
        "pick a flavor of the size you need (python -m torchtitan_ext.flavors) or register one"
    )


def valid_keys(config) -> list[str]:
    """Every settable dotted key: short keys and leaf fields of the config tree."""
    return [k.key for k in short_keys()] + leaf_keys(config)


def _unknown_key_message(key: str, config) -> str:
    close = difflib.get_close_matches(key, valid_keys(config), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown key {key!r}{hint}"


def _apply_one(config, key: str, value: Any) -> str | None:
    """Apply one override to ``config``; the problem (without its source), or None when applied."""
    if (short := short_key(key)) is not None:
        short.apply(config, check_value(key, value, short.annotation))
        return None
    if (reason := _fixed_field_error(key)) is not None:
        return reason
    try:
        parent, name = resolve_parent(config, key.split("."))
    except KeyError:
        return _unknown_key_message(key, config)
    if children(child(parent, name)):
        return f"{key} is a section, not a value; set one of its keys"
    set_child(parent, name, check_value(key, value, field_annotation(parent, name)))
    return None


def apply_overrides(config, overrides: dict[str, Any], source: str = "TOML", lines: dict[str, int] | None = None):
    """Return a copy of ``config`` with ``{dotted_key: value}`` applied, or raise.

    All keys are checked before the copy is returned; on any error the caller's
    ``config`` is untouched and ``ConfigError`` lists every problem. ``lines`` maps keys
    to their line in ``source``; errors and ``value_source`` name it.
    """
    result = copy.deepcopy(config)
    errors: list[str] = []
    applied: dict[str, str] = {}
    for key, value in overrides.items():
        where = f"{source}:{lines[key]}" if lines and key in lines else source
        try:
            problem = _apply_one(result, key, value)
        except ConfigError as e:
            problem = str(e)
        if problem is None:
            applied[key] = where
        else:
            errors.append(f"{where}: {problem}")
    if errors:
        raise ConfigError("\n".join(errors))
    record_value_sources(applied)
    return result


def apply_toml_files(config, paths: list[str]):
    """Apply TOML files in order (later files win); all-or-nothing."""
    for path in paths:
        overrides, lines = read_toml(Path(path))
        config = apply_overrides(config, overrides, source=str(path), lines=lines)
    return config
