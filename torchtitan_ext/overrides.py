"""TOML overrides of a flavor's ``Trainer.Config``.

A TOML file is a tree of tables; every leaf is a dotted key. A key is either a
*short key* (a natural name for a common knob, registered with ``register_short_key``,
e.g. ``moe.compute_backend`` or ``training.lr``) or the dotted path of any field of
the ``Trainer.Config`` (``training.local_batch_size``, ``parallelism.expert_parallel_degree``,
``model.layers.0.moe.router.top_k`` where ``model`` is the flavor's model config).

Values are checked against the field's type annotation (``Literal`` choices,
int/float/bool/str, optionals, lists). Every file is checked completely before
anything is applied, and overrides are applied to a copy: a bad file changes
nothing. Errors are ``ConfigError`` with one line per problem. Ranges and rules
between values are not checked here: the config checks (``run_config_checks``)
check each once, on the final config.
"""

import copy
import dataclasses
import difflib
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad flavor name, TOML file, key or value; the message is for the user."""


@dataclass(frozen=True)
class ShortKey:
    """A natural TOML key applied by ``apply(config, value)`` after the type check."""

    key: str
    annotation: Any
    help: str
    apply: Callable[[Any, Any], None]


_SHORT_KEYS: dict[str, ShortKey] = {}


def register_short_key(key: str, annotation: Any, help: str):
    """Decorator registering ``apply(config, value)`` as the handler of TOML ``key``."""

    def decorator(apply: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        if key in _SHORT_KEYS:
            raise ValueError(f"short TOML key {key!r} is registered twice")
        _SHORT_KEYS[key] = ShortKey(key, annotation, help, apply)
        return apply

    return decorator


_CONFIG_CHECKS: list[Callable[[Any], None]] = []


def register_config_check(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """Decorator registering ``check(config)``, run on the final config before training starts.

    A check raises ``ConfigError`` for settings that are valid one by one but not together
    (e.g. expert count vs expert-parallel degree).
    """
    _CONFIG_CHECKS.append(check)
    return check


def run_config_checks(config) -> None:
    """Run every registered check on the final ``Trainer.Config``; one ``ConfigError`` lists all problems.

    A check that fails with another exception after earlier checks reported problems is
    taken as a consequence of those problems; on a clean config it propagates.
    """
    errors: list[str] = []
    for check in _CONFIG_CHECKS:
        try:
            check(config)
        except ConfigError as e:
            errors.append(str(e))
        except Exception:
            if not errors:
                raise
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))


def short_keys() -> list[ShortKey]:
    return sorted(_SHORT_KEYS.values(), key=lambda k: k.key)


def _field_alias(key: str, path: str, annotation: Any, help: str) -> None:
    """Register ``key`` as a short name for the config field at dotted ``path``."""

    def apply(config, value):
        parent, name = _resolve_parent(config, path.split("."))
        setattr(parent, name, value)

    register_short_key(key, annotation, f"{help} (= {path})")(apply)


_field_alias("training.batch_size", "training.local_batch_size", int, "per-rank batch size")
_field_alias("training.seed", "debug.seed", int | None, "random seed")
_field_alias("parallelism.ep", "parallelism.expert_parallel_degree", int, "expert parallel degree")
_field_alias(
    "parallelism.dp_shard", "parallelism.data_parallel_shard_degree", int, "FSDP degree (-1: all remaining ranks)"
)
_field_alias("parallelism.dp_replicate", "parallelism.data_parallel_replicate_degree", int, "DDP/HSDP replicate degree")
_field_alias("parallelism.tp", "parallelism.tensor_parallel_degree", int, "tensor parallel degree")
_field_alias("parallelism.pp", "parallelism.pipeline_parallel_degree", int, "pipeline parallel degree")
_field_alias("wandb.enable", "metrics.enable_wandb", bool, "log to Weights & Biases")
_field_alias("tensorboard.enable", "metrics.enable_tensorboard", bool, "log to TensorBoard")
_field_alias("data.dataset", "dataloader.dataset", str, "dataset name registered with torchtitan")
_field_alias("data.path", "dataloader.dataset_path", str | None, "dataset location")
_field_alias("data.tokenizer", "hf_assets_path", str, "folder with tokenizer.json")


@register_short_key("training.lr", float, "learning rate of every optimizer parameter group")
def _set_learning_rate(config, lr: float) -> None:
    for group in config.optimizer.param_groups:
        group.optimizer_kwargs["lr"] = lr


def load_toml(path: str | Path) -> dict[str, Any]:
    """Parse one TOML file into ``{dotted_key: value}``; errors name file and line."""
    return _read_toml(Path(path))[0]


def _read_toml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """``{dotted_key: value}`` of one TOML file and ``{dotted_key: line}`` where a line is found."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read TOML file ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not a UTF-8 text file (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "TOML files must be UTF-8"
        ) from None
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    return dict(_flatten(tree)), _key_lines(text)


_TABLE_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_LINE = re.compile(r"^\s*([A-Za-z0-9_.\-\s\"']+?)\s*=")


def _key_lines(text: str) -> dict[str, int]:
    """Line number of each ``key = value`` of a TOML text, by dotted key (bare and quoted keys)."""
    lines, table = {}, ""
    for number, line in enumerate(text.splitlines(), start=1):
        if header := _TABLE_HEADER.match(line):
            table = _unquote_dotted(header.group(1)) + "."
        elif key := _KEY_LINE.match(line):
            lines.setdefault(table + _unquote_dotted(key.group(1)), number)
    return lines


def _unquote_dotted(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))


def _flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def _children(node: Any) -> dict[str, Any]:
    """Named children of a config node: dataclass fields or list indices."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return {f.name: getattr(node, f.name) for f in dataclasses.fields(node) if not f.name.startswith("_")}
    if isinstance(node, list):
        return {str(i): item for i, item in enumerate(node)}
    return {}


def _root_children(config) -> dict[str, Any]:
    children = _children(config)
    children.pop("model_spec", None)
    if config.model_spec is not None:
        children["model"] = config.model_spec.model
    return children


def _resolve_parent(config, parts: list[str]) -> tuple[Any, str]:
    """The node holding the last part of ``parts`` and that part's name."""
    node_children = _root_children(config)
    node: Any = config
    for depth, part in enumerate(parts[:-1]):
        if part not in node_children:
            raise KeyError(".".join(parts[: depth + 1]))
        node = node_children[part]
        node_children = _children(node)
    if parts[-1] not in node_children:
        raise KeyError(".".join(parts))
    return node, parts[-1]


def _field_annotation(node: Any, name: str) -> Any:
    if isinstance(node, list):
        return Any
    try:
        return typing.get_type_hints(type(node))[name]
    except Exception:
        return type(getattr(node, name))


def valid_keys(config) -> list[str]:
    """Every settable dotted key: short keys and leaf fields of the config tree."""
    keys = [k.key for k in short_keys()]

    def walk(children: dict[str, Any], prefix: str) -> None:
        for name, value in children.items():
            grandchildren = _children(value)
            if grandchildren:
                walk(grandchildren, f"{prefix}{name}.")
            else:
                keys.append(f"{prefix}{name}")

    walk(_root_children(config), "")
    return keys


def check_value(key: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` converted to ``annotation`` or raise ``ConfigError``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin is Literal:
        if value in args:
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ConfigError(f"{key} = {value!r} is not one of the valid choices: {choices}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in args:
            if arm is type(None):
                continue
            try:
                return check_value(key, value, arm)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key} = {value!r} has the wrong type")
    expected = origin or annotation
    if expected is bool:
        if isinstance(value, bool):
            return value
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif expected is str:
        if isinstance(value, str):
            return value
    elif expected in (list, tuple):
        if isinstance(value, list):
            item_type = args[0] if args else Any
            return expected(check_value(f"{key}[]", v, item_type) for v in value)
    elif expected is dict:
        if isinstance(value, dict):
            return value
    elif isinstance(expected, type) and isinstance(value, expected):
        return value
    type_name = getattr(expected, "__name__", str(expected))
    raise ConfigError(f"{key} = {value!r}: expected {type_name}, got {type(value).__name__}")


def _unknown_key_message(key: str, config) -> str:
    close = difflib.get_close_matches(key, valid_keys(config), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown key {key!r}{hint}"


FLAVOR_FIXED_FIELDS: dict[str, str] = {
    "dim": "the model width was copied into the embedding, attention, MoE, norm and output configs when the flavor was built",
    "vocab_size": "the vocabulary size was copied into the embedding, output layer and loss when the flavor was built",
    "global_vocab_size": "the vocabulary size is fixed by the flavor's model",
    "num_experts": "the expert count was copied into the router, dispatcher and experts of the layer when the flavor was built",
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


_VALUE_SOURCES: dict[str, str] = {}


def forget_value_sources() -> None:
    """Start recording value sources afresh: call before resolving a new run's config."""
    _VALUE_SOURCES.clear()


def value_source(*keys: str) -> str | None:
    """Where the value of the first of ``keys`` that was overridden came from ("file:line", "command line")."""
    for key in keys:
        if key in _VALUE_SOURCES:
            return _VALUE_SOURCES[key]
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
            if key in _SHORT_KEYS:
                short = _SHORT_KEYS[key]
                short.apply(result, check_value(key, value, short.annotation))
                applied[key] = where
                continue
            if (reason := _fixed_field_error(key)) is not None:
                errors.append(f"{where}: {reason}")
                continue
            try:
                parent, name = _resolve_parent(result, key.split("."))
            except KeyError:
                errors.append(f"{where}: {_unknown_key_message(key, result)}")
                continue
            current = parent[int(name)] if isinstance(parent, list) else getattr(parent, name)
            if _children(current):
                errors.append(f"{where}: {key} is a section, not a value; set one of its keys")
                continue
            checked = check_value(key, value, _field_annotation(parent, name))
            if isinstance(parent, list):
                parent[int(name)] = checked
            else:
                setattr(parent, name, checked)
            applied[key] = where
        except ConfigError as e:
            errors.append(f"{where}: {e}")
    if errors:
        raise ConfigError("\n".join(errors))
    _VALUE_SOURCES.update(applied)
    return result


def apply_toml_files(config, paths: list[str]):
    """Apply TOML files in order (later files win); all-or-nothing."""
    for path in paths:
        overrides, lines = _read_toml(Path(path))
        config = apply_overrides(config, overrides, source=str(path), lines=lines)
    return config


COMMAND_LINE = "command line"


def split_short_key_args(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Take ``--<short key> VALUE`` / ``--<short key>=VALUE`` out of ``args``: (overrides, the rest).

    A value is read as a TOML value (``2``, ``1e-3``, ``true``, ``"x"``), else as a bare
    string (``for_loop``); a bool key given without a value means true.
    """
    overrides: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        name, has_inline, inline = args[i].partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key not in _SHORT_KEYS:
            rest.append(args[i])
            i += 1
            continue
        if has_inline:
            text = inline
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            text = args[i + 1]
            i += 1
        elif _SHORT_KEYS[key].annotation is bool:
            text = "true"
        else:
            raise ConfigError(f"{COMMAND_LINE}: --{key} needs a value")
        overrides[key] = _cli_value(text)
        i += 1
    return overrides, rest


def _cli_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
