"""``--name value`` options taken out of a command line: the one splitter of the train entry's
``--flavor``/``--toml`` and of the keys the project's overrides set (short keys such as
``--training.lr 1e-3``, and ``--model.*``), which win over the TOML files."""

from collections.abc import Callable
from typing import Any

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import fixed_field_error
from torchtitan_ext.config.short_keys import short_key
from torchtitan_ext.config.toml_files import toml_value

COMMAND_LINE = "command line"
"""How errors and ``value_source`` name a value given on the command line."""


def take_options(
    args: list[str], option_of: Callable[[str], str | None]
) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Take ``NAME VALUE`` / ``NAME=VALUE`` out of ``args`` wherever ``option_of(NAME)`` names an option.

    Returns ([(option, value text)], the other arguments in order). The value is the text after
    ``=``, else the next argument unless it starts with ``--``, else None (the caller decides
    whether a bare option means something).
    """
    taken: list[tuple[str, str | None]] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        name, has_inline, inline = args[i].partition("=")
        option = option_of(name)
        if option is None:
            rest.append(args[i])
        elif has_inline:
            taken.append((option, inline))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            taken.append((option, args[i + 1]))
            i += 1
        else:
            taken.append((option, None))
        i += 1
    return taken, rest


def override_key(name: str) -> str | None:
    """The key option ``--NAME`` sets through the project's overrides (dashes read as underscores),
    or None for an option torchtitan's parser takes.

    The overrides take every short key, and the config keys torchtitan's parser cannot set (the
    model's, ``model.*``) or must not (fields a flavor fixed when it was built).
    """
    key = name[2:].replace("-", "_") if name.startswith("--") else None
    if key is None:
        return None
    if short_key(key) is not None or key.startswith("model.") or fixed_field_error(key) is not None:
        return key
    return None


def split_override_args(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Take the options the overrides set (``override_key``), ``--KEY VALUE`` / ``--KEY=VALUE``, out of
    ``args``: (overrides, the rest, for torchtitan's parser).

    A value is read as a TOML value (``2``, ``1e-3``, ``true``, ``"x"``), else as a bare
    string (``for_loop``); a key given without a value means true, unless it is a short key of
    another type.
    """
    taken, rest = take_options(args, override_key)
    overrides: dict[str, Any] = {}
    for key, text in taken:
        annotation = getattr(short_key(key), "annotation", bool)
        if text is None and annotation is not bool:
            raise ConfigError(f"{COMMAND_LINE}: --{key} needs a value")
        overrides[key] = toml_value("true" if text is None else text)
    return overrides, rest
