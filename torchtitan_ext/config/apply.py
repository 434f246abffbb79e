"""Overrides applied to a flavor's ``Trainer.Config``: ``{dotted_key: value}`` from TOML files or
the command line, each key a short key or the dotted path of a config field (``config_tree``).

Values are checked against the field's type annotation (``value_types``). Every override of a
source is checked before anything is applied, and overrides are applied to a copy: a bad file
changes nothing. Ranges and rules between values are the start-up checks' (``checks``), on the
final config.
"""

import copy
import itertools
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.config_tree import (
    child,
    children,
    field_annotation,
    leaf_items,
    leaf_keys,
    resolve_parent,
    section_that_is_off,
    set_child,
)
from torchtitan_ext.config.names import unknown_key_message
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


_LINKED_FIELDS: list[tuple[str, str]] = []
"""Pairs of dotted key endings that name one setting held in two fields of the same config node (e.g.
a layer's router and dispatcher ``top_k``): setting one through its field path sets the other."""


def register_linked_fields(first: str, second: str) -> None:
    """Fields ``PREFIX.first`` and ``PREFIX.second`` hold one setting: an override of either sets both."""
    _LINKED_FIELDS.append((first, second))


def _linked_keys(key: str) -> list[str]:
    """The other fields of the setting ``key`` names (``register_linked_fields``)."""
    linked = []
    for first, second in _LINKED_FIELDS:
        for own, other in ((first, second), (second, first)):
            if key == own or key.endswith("." + own):
                linked.append(key[: len(key) - len(own)] + other)
    return linked


def fixed_field_error(key: str) -> str | None:
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


def _section_message(key: str) -> str:
    return f"{key} is a section, not a value; set one of its keys"


def key_name_problem(key: str, known: Collection[str]) -> str | None:
    """Why ``key`` cannot be set, as far as its name tells against ``known`` (every settable key,
    ``valid_keys``): a field the flavor fixed, a section, or no such key; worded as when it is applied."""
    if (reason := fixed_field_error(key)) is not None:
        return reason
    if key in known:
        return None
    if any(other.startswith(key + ".") for other in known):
        return _section_message(key)
    return unknown_key_message(key, known)


def name_errors(overrides: dict[str, Any], known: Collection[str], source: str, lines: dict | None = None) -> list[str]:
    """``key_name_problem`` of every key of ``overrides`` (from ``source``, keys at ``lines``), as
    ``apply_overrides`` reports it: without building a config."""
    return [
        f"{_where(key, source, lines)}: {problem}"
        for key in overrides
        if (problem := key_name_problem(key, known)) is not None
    ]


def _where(key: str, source: str, lines: dict[str, int] | None) -> str:
    """How errors name where ``key`` was set: ``file:line``, or the source."""
    return f"{source}:{lines[key]}" if lines and key in lines else source


def _apply_one(config, key: str, value: Any) -> str | None:
    """Apply one override to ``config``; the problem (without its source), or None when applied."""
    if (short := short_key(key)) is not None:
        short.apply(config, check_value(key, value, short.annotation))
        return None
    if (reason := fixed_field_error(key)) is not None:
        return reason
    try:
        parent, name = resolve_parent(config, key.split("."))
    except KeyError:
        if (off := section_that_is_off(config, key)) is not None:
            return f"{key} does not apply: {off} is off (None) in this config"
        return unknown_key_message(key, valid_keys(config))
    if children(child(parent, name)):
        return _section_message(key)
    checked = check_value(key, value, field_annotation(parent, name))
    set_child(parent, name, checked)
    for linked in _linked_keys(key):
        try:
            set_child(*resolve_parent(config, linked.split(".")), checked)
        except KeyError:
            continue
    return None


def _try_apply(config, key: str, value: Any) -> str | None:
    """``_apply_one`` with a ``ConfigError`` of the key's own handler as the problem."""
    try:
        return _apply_one(config, key, value)
    except ConfigError as e:
        return str(e)


def _snapshot(config) -> dict[str, Any]:
    """Every leaf of the config tree; containers copied, so that a change in place shows."""
    return {
        key: copy.copy(value) if isinstance(value, (dict, list)) else value for key, value in leaf_items(config).items()
    }


def _differs(after: Any, before: Any) -> bool:
    if after is before:
        return False
    try:
        return bool(after != before)
    except Exception:  # values without a truth value for ==: different objects count as different
        return True


def _changed_fields(config, key: str, value: Any) -> dict[str, Any]:
    """``{dotted field: new value}`` that applying ``key = value`` to a copy of ``config`` changes."""
    trial = copy.deepcopy(config)
    before = _snapshot(trial)
    if _try_apply(trial, key, value) is not None:
        return {}
    return {field: new for field, new in leaf_items(trial).items() if _differs(new, before.get(field, object()))}


def written_fields(config, overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each key of ``overrides``: ``{dotted field: value}`` it writes, applied to ``config`` and to
    ``config`` with the other overrides applied (a field it sets to the value already there shows in
    one of the two); a short key's declared ``fields`` count as written."""
    written = {}
    for key, value in overrides.items():
        others = copy.deepcopy(config)
        for other, other_value in overrides.items():
            if other != key:
                _try_apply(others, other, other_value)
        fields = _changed_fields(config, key, value) | _changed_fields(others, key, value)
        declared = registered.fields if (registered := short_key(key)) is not None else ()
        written[key] = {field: fields.get(field, value) for field in declared} | fields
    return written


def conflict_errors(config, overrides: dict[str, Any], where: dict[str, str]) -> list[str]:
    """Pairs of ``overrides`` (one source) that set a field to different values, each an error naming
    both keys (``where[key]``: the key's source) and the field; the result would depend on their order."""
    if len(overrides) < 2:
        return []
    written = written_fields(config, overrides)
    errors = []
    for first, second in itertools.combinations(overrides, 2):
        fields = [f for f in written[first] if f in written[second] and _differs(written[first][f], written[second][f])]
        if fields:
            errors.append(
                f"{where[first]}: {first} = {overrides[first]!r} and {where[second]}: {second} = "
                f"{overrides[second]!r} both set {', '.join(fields[:3])}{' ...' if len(fields) > 3 else ''}; "
                "keep one of them"
            )
    return errors


class RefusedValues(ConfigError):
    """Overrides refused one by one (type, choice, a key the flavor fixed); ``applied``: a copy of the config
    with every other override applied, where the start-up value checks can still find their problems
    (``checks.value_check_errors``), so that one message lists them all. The caller's config is untouched."""

    def __init__(self, message: str, applied):
        super().__init__(message)
        self.applied = applied


def applied_noting_refusals(refusals: list[str], apply: Callable[..., Any], *args: Any, **kwargs: Any):
    """``apply(*args, **kwargs)``'s config; where it refuses values one by one (``RefusedValues``), its
    message is added to ``refusals`` and the config with every other override applied is returned instead."""
    try:
        return apply(*args, **kwargs)
    except RefusedValues as e:
        refusals.append(str(e))
        return e.applied


def apply_overrides(config, overrides: dict[str, Any], source: str = "TOML", lines: dict[str, int] | None = None):
    """Return a copy of ``config`` with ``{dotted_key: value}`` applied, or raise.

    All keys are checked before the copy is returned; on any error the caller's
    ``config`` is untouched and ``ConfigError`` lists every problem, two keys that set one
    field to different values included (``conflict_errors``). ``lines`` maps keys to their
    line in ``source``; errors and ``value_source`` name it.
    """
    result = copy.deepcopy(config)
    errors: list[str] = []
    where = {key: _where(key, source, lines) for key in overrides}
    refused = set()
    for key, value in overrides.items():
        if (problem := _try_apply(result, key, value)) is not None:
            errors.append(f"{where[key]}: {problem}")
            refused.add(key)
    if errors:
        record_value_sources({key: place for key, place in where.items() if key not in refused})
        raise RefusedValues("\n".join(errors), result)
    if errors := conflict_errors(config, overrides, where):
        raise ConfigError("\n".join(errors))
    record_value_sources(where)
    return result


def apply_toml_files(config, paths: list[str]):
    """Apply TOML files in order (later files win); all-or-nothing: ``ConfigError`` lists the problems
    of every file (a file with problems is skipped while the later ones are checked). Where every problem
    is a refused value, it is a ``RefusedValues`` holding the config with every other value applied."""
    errors = []
    only_refused_values = True
    for path in paths:
        try:
            overrides, lines = read_toml(Path(path))
            config = applied_noting_refusals(errors, apply_overrides, config, overrides, str(path), lines)
        except ConfigError as e:
            errors.append(str(e))
            only_refused_values = False
    if errors:
        raise RefusedValues("\n".join(errors), config) if only_refused_values else ConfigError("\n".join(errors))
    return config
