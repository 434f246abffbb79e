"""``--name value`` options taken out of a command line: the one splitter of the train entry's
``--flavor``/``--toml`` and of the keys the project's overrides set (short keys such as
``--training.lr 1e-3``, and ``--model.*``), which win over the TOML files; and what the options of
a command line cannot be: unknown, misplaced (torchrun's) or given twice."""

import itertools
import shlex
import typing
from collections.abc import Callable, Collection
from typing import Any

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import fixed_field_error
from torchtitan_ext.config.names import close_matches_hint
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


def repeated_option_errors(args: list[str], key_of: Callable[[str], str | None]) -> list[str]:
    """An error for each key that options of ``args`` set more than once, naming the values in order;
    ``key_of(arg)`` is the key the option ``arg`` (``--NAME`` or ``--NAME=VALUE``) sets, None for an
    argument not to count. The value of an option is the text after ``=``, else the arguments up to
    the next ``--`` option (all of a list-valued key's values), else true (false for a switch
    ``--a.no_b`` whose key is ``a.b``)."""
    given: dict[str, list[str]] = {}
    for i, arg in enumerate(args):
        if (key := key_of(arg)) is None:
            continue
        name, has_inline, inline = arg.partition("=")
        following = list(itertools.takewhile(lambda a: not a.startswith("--"), args[i + 1 :]))
        switched_on = name[2:].replace("-", "_") == key
        value = inline if has_inline else " ".join(following) if following else str(switched_on).lower()
        given.setdefault(key, []).append(value)
    return [
        f"{COMMAND_LINE}: --{key} is given {'twice' if len(values) == 2 else f'{len(values)} times'} "
        f"({', '.join(values)}): give it once"
        for key, values in given.items()
        if len(values) > 1
    ]


PROJECT_OPTIONS = ("--flavor", "--toml")
"""The train entry's own options; short keys and torchtitan's options follow them. ``--toml`` is
meant to be repeated (later files win)."""

FLAVOR_REQUIRED = "--flavor is required (list flavors: python -m torchtitan_ext.flavors)"


def split_project_args(args: list[str]) -> tuple[str | None, list[str], list[str]]:
    """Take ``--flavor`` and ``--toml`` out of ``args``: (flavor, toml files, the rest). ``--flavor``
    given twice is refused here, alone: the flavor decides which keys the rest may set."""
    taken, rest = take_options(args, lambda name: name if name in PROJECT_OPTIONS else None)
    flavor, tomls = None, []
    for option, value in taken:
        if value is None:
            raise ConfigError(f"{option} needs a value")
        if option == "--flavor":
            flavor = value
        else:
            tomls.append(value)
    if repeated := repeated_option_errors(args, lambda arg: "flavor" if arg.partition("=")[0] == "--flavor" else None):
        raise ConfigError(repeated[0])
    return flavor, tomls, rest


def option_key(arg: str, known: set[str]) -> str | None:
    """The config key an option ``--a.b[=v]`` / ``--a.no_b`` sets, when it is in ``known``; else None."""
    if not arg.startswith("--"):
        return None
    name = arg[2:].partition("=")[0].replace("-", "_")
    parent, _, leaf = name.rpartition(".")
    plain = f"{parent}.{leaf.removeprefix('no_')}".lstrip(".")
    return name if name in known else plain if plain in known else None


def subcommands_as_short_keys(args: list[str]) -> list[str]:
    """``args`` with each torchtitan subcommand ``section-name:choice`` written as the short key
    ``--section_name.mode choice`` where one is registered and takes that choice
    (``activation-checkpoint:full`` -> ``--activation_checkpoint.mode full``): the choice is then
    applied as every other key is (over the TOML files, checked for repeats). Other subcommands
    (``activation-checkpoint:memory-budget``) stay for torchtitan's parser."""
    spelled: list[str] = []
    for arg in args:
        section, colon, choice = arg.partition(":")
        key = f"{section.replace('-', '_')}.mode"
        registered = short_key(key) if colon and not arg.startswith("-") else None
        if registered is not None and choice in typing.get_args(registered.annotation):
            spelled += [f"--{key}", choice]
        else:
            spelled.append(arg)
    return spelled


def switches_for_parser(args: list[str], switch_keys: Collection[str]) -> list[str]:
    """``args`` with torchtitan's boolean options given a value, as the short keys take one
    (``--a.b false``, ``--a.b=true``, ``--a.no_b false``), spelled as the switches its parser takes
    (``--a.no_b``, ``--a.b``); ``switch_keys`` are the boolean config keys. Any other value is refused
    (ConfigError), except a tyro subcommand (``activation-checkpoint:full``) after a bare switch."""
    known = set(switch_keys)
    spelled: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, has_inline, inline = arg.partition("=")
        key = option_key(arg, known)
        following = args[i + 1] if not has_inline and i + 1 < len(args) else "--"
        if key is None or (not has_inline and (following.startswith("--") or ":" in following)):
            spelled.append(arg)
            i += 1
            continue
        text = inline if has_inline else following
        value = toml_value(text)
        if not isinstance(value, bool):
            raise ConfigError(f"{COMMAND_LINE}: {name} is a switch: give true, false or no value, got {text!r}")
        negated = name[2:].replace("-", "_") != key
        parent, _, leaf = key.rpartition(".")
        spelled.append(f"--{key}" if value != negated else f"--{parent}.no_{leaf}")
        i += 1 if has_inline else 2
    return spelled


def command_line_errors(
    keys: list[str],
    args: list[str],
    torchrun_options: dict[str, bool],
    section_off: Callable[[str], str | None] = lambda key: None,
) -> list[str]:
    """The options of the training arguments ``args`` that cannot be: torchrun options placed among them
    (``misplaced_torchrun_options``), options that name none of the settable ``keys`` (``section_off(key)``:
    the section of the key that is switched off, if any), then keys given more than once
    (``repeated_option_errors``; a key of the TOML files set once here is no repeat)."""
    flavor_and_files_out = split_project_args(args)[2]
    misplaced = misplaced_torchrun_options(args, torchrun_options)
    known = set(keys)
    return [
        *([misplaced] if misplaced else []),
        *unknown_option_errors(keys, flavor_and_files_out, torchrun_options, section_off),
        *repeated_option_errors(
            flavor_and_files_out, lambda arg: override_key(arg.partition("=")[0]) or option_key(arg, known)
        ),
    ]


def launcher_option_errors(launcher_args: list[str], torchrun_options: dict[str, bool]) -> list[str]:
    """torchrun options of the leading ``launcher_args`` given more than once; torchrun reads ``-`` and
    ``_`` in a name as the same option (``--nproc-per-node``, ``--nproc_per_node``)."""
    return repeated_option_errors(
        launcher_args,
        lambda arg: name[2:].replace("-", "_") if (name := arg.partition("=")[0]) in torchrun_options else None,
    )


FLAVORS_COMMAND_OPTIONS = {
    "--show": "python -m torchtitan_ext.flavors --show NAME [--toml FILE] prints a flavor's settings",
    "--full": "python -m torchtitan_ext.flavors --show NAME --full prints every config field of a flavor, as JSON",
    "--keys": "python -m torchtitan_ext.flavors --keys lists the short keys",
}
"""Options of the flavors command that a user may give the train entry, with the command that takes each."""


def unknown_option_errors(
    keys: list[str],
    args: list[str],
    torchrun_options: Collection[str],
    section_off: Callable[[str], str | None] = lambda key: None,
) -> list[str]:
    """``--a.b`` options of ``args`` that name none of the settable ``keys``, with close matches;
    torchrun's options are left to ``misplaced_torchrun_options``, the overrides' keys (``override_key``)
    to the overrides' own check."""
    known = set(keys)
    errors = []
    for arg in args:
        option = arg.partition("=")[0]
        if not arg.startswith("--") or option in ("--help", "--help-torchtitan") or option in torchrun_options:
            continue
        if override_key(option) is not None:
            continue
        name = option[2:].replace("-", "_")
        if option_key(arg, known) is not None or any(k.startswith(name + ".") for k in keys):
            continue
        if (off := section_off(name)) is not None:
            errors.append(f"{COMMAND_LINE}: {option} does not apply: {off} is off (None) in this config")
            continue
        if option in FLAVORS_COMMAND_OPTIONS:
            errors.append(
                f"{COMMAND_LINE}: {option} is an option of the flavors command, not of training: "
                f"{FLAVORS_COMMAND_OPTIONS[option]}"
            )
            continue
        errors.append(f"{COMMAND_LINE}: unknown option {option}{close_matches_hint(name, keys, prefix='--')}")
    return errors


def misplaced_torchrun_options(args: list[str], torchrun_options: dict[str, bool]) -> str | None:
    """The error for torchrun options (``torchrun_options``: option -> takes a value) placed among the
    training arguments ``args``, with the command that puts them first; None when there are none."""
    moved, rest, i = [], [], 0
    while i < len(args):
        option = args[i].partition("=")[0]
        if option not in torchrun_options:
            rest.append(args[i])
        else:
            takes_value = torchrun_options[option] and "=" not in args[i] and i + 1 < len(args)
            moved += args[i : i + 1 + takes_value]
            i += takes_value
        i += 1
    if not moved:
        return None
    return (
        f"{COMMAND_LINE}: {' '.join(moved)}: torchrun options come first, before the training arguments: "
        f"python -m torchtitan_ext.train {shlex.join(moved + rest)}"
    )
