"""The dotted keys of a ``Trainer.Config``: its dataclass fields and list items, with the flavor's
model config under ``model`` (``model.layers.0.moe.router.top_k``) in place of ``model_spec``."""

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any


def is_config_node(node: Any) -> bool:
    """A dataclass instance, or a list holding config nodes (``model.layers``); a list of plain values
    (``compile.components``) is a value, set whole."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return True
    return isinstance(node, list) and any(is_config_node(item) for item in node)


def children(node: Any) -> dict[str, Any]:
    """Named children of a config node: dataclass fields or list indices (none for a value)."""
    if not is_config_node(node):
        return {}
    if isinstance(node, list):
        return {str(i): item for i, item in enumerate(node)}
    return {f.name: getattr(node, f.name) for f in dataclasses.fields(node) if not f.name.startswith("_")}


def root_children(config) -> dict[str, Any]:
    """The top-level sections of a ``Trainer.Config``, the model config as ``model``."""
    sections = children(config)
    sections.pop("model_spec", None)
    if config.model_spec is not None:
        sections["model"] = config.model_spec.model
    return sections


def resolve_parent(config, parts: Sequence[str]) -> tuple[Any, str]:
    """The node holding the last part of ``parts`` and that part's name; KeyError naming the
    first part that is not there."""
    node_children = root_children(config)
    node: Any = config
    for depth, part in enumerate(parts[:-1]):
        if part not in node_children:
            raise KeyError(".".join(parts[: depth + 1]))
        node = node_children[part]
        node_children = children(node)
    if parts[-1] not in node_children:
        raise KeyError(".".join(parts))
    return node, parts[-1]


def section_that_is_off(config, key: str) -> str | None:
    """The dotted prefix of ``key`` naming a config field that is None (a section switched off, such as
    ``activation_checkpoint`` with mode "none"), or None when there is none."""
    parts = key.split(".")
    node_children = root_children(config)
    for depth, part in enumerate(parts[:-1]):
        if part not in node_children:
            return None
        if node_children[part] is None:
            return ".".join(parts[: depth + 1])
        node_children = children(node_children[part])
    return None


def child(parent: Any, name: str) -> Any:
    """The field ``name`` of a config node, or its item ``int(name)`` when it is a list."""
    return parent[int(name)] if isinstance(parent, list) else getattr(parent, name)


def set_child(parent: Any, name: str, value: Any) -> None:
    """Set the field ``name`` of a config node, or its item ``int(name)`` when it is a list."""
    if isinstance(parent, list):
        parent[int(name)] = value
    else:
        setattr(parent, name, value)


def set_value(config, key: str, value: Any) -> None:
    """Set the field or list item at dotted ``key`` (which must exist) to ``value``."""
    set_child(*resolve_parent(config, key.split(".")), value)


def field_annotation(parent: Any, name: str) -> Any:
    """The type annotation of field ``name`` of ``parent`` (``Any`` for a list item)."""
    if isinstance(parent, list):
        return Any
    try:
        return typing.get_type_hints(type(parent))[name]
    except Exception:
        return type(getattr(parent, name))


def leaf_items(config) -> dict[str, Any]:
    """Every leaf field of the config tree by dotted key, with its value."""
    items = {}

    def walk(nodes: dict[str, Any], prefix: str) -> None:
        for name, value in nodes.items():
            grandchildren = children(value)
            if grandchildren:
                walk(grandchildren, f"{prefix}{name}.")
            else:
                items[f"{prefix}{name}"] = value

    walk(root_children(config), "")
    return items


def leaf_keys(config) -> list[str]:
    """The dotted key of every leaf field of the config tree."""
    return list(leaf_items(config))
