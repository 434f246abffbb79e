"""Values checked against a config field's type annotation: ``Literal`` choices, bool, int, float,
str, optionals and unions, lists and tuples. Ranges are the configs' own checks."""

import types
import typing
from typing import Any, Literal

from torchtitan_ext.config import ConfigError


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
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{key} = {value!r}: expected {annotation_name(annotation)}, got {type(value).__name__}")
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


def annotation_name(annotation: Any) -> str:
    """How help text names a type: ``{a,b}`` for choices, ``int|str`` for a union, else its name."""
    if typing.get_origin(annotation) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return "|".join(annotation_name(a) for a in typing.get_args(annotation) if a is not type(None))
    return getattr(annotation, "__name__", str(annotation))
