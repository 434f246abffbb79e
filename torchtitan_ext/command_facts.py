"""What the command lines know before torch is imported: every flavor's settable keys, the short keys'
help and torchrun's options.

``command_facts()`` reads them from ``$TORCHTITAN_EXT_CACHE/command_facts.json`` (default
``~/.cache/torchtitan_ext/``) when its fingerprint matches: the project's source files, the
interpreter and the installed torch and torchtitan. A hit imports neither torch nor torchtitan, so
``--help`` and a mistyped option or flavor come back at once; a miss imports the project and every
experiment to build them (several seconds, once after an install or an edit). The flavor listing of
``python -m torchtitan_ext.flavors`` is cached the same way (``cached_by_sources``).
"""

import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from torchtitan_ext.experiments.moe_backends.cache import cache_dir

FACTS_CACHE_NAME = "command_facts.json"


def _installed_version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def files_fingerprint(roots: list[Path], salt: str) -> str:
    """Hash of ``salt`` and the path, size and modification time of every ``*.py`` under ``roots``."""
    digest = hashlib.sha256(salt.encode())
    for root in sorted(set(roots)):
        for path in sorted(root.rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def source_fingerprint() -> str:
    """Hash of what the cached facts depend on: the project's Python files, the interpreter prefix and
    the torch and torchtitan versions."""
    import torchtitan_ext
    import torchtitan_ext.experiments
    import torchtitan_ext.kernels

    roots = [
        Path(p)
        for package in (torchtitan_ext, torchtitan_ext.experiments, torchtitan_ext.kernels)
        for p in package.__path__
    ]
    installed = f"{sys.prefix}|{_installed_version('torch')}|{_installed_version('torchtitan')}"
    return files_fingerprint(roots, installed)


def cached_by_sources(name: str, build: Callable[[], Any], what: str) -> Any:
    """``build()`` (JSON data), from ``cache_dir() / name`` when its fingerprint is ``source_fingerprint()``;
    otherwise built (saying so on a terminal's stderr: it takes seconds) and cached."""
    path = cache_dir() / name
    fingerprint = source_fingerprint()
    try:
        cached = json.loads(path.read_text())
        if cached["fingerprint"] == fingerprint:
            return cached["data"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if sys.stderr.isatty():
        print(f"building {what} (first time after an install or an edit; cached after)", file=sys.stderr, flush=True)
    data = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"fingerprint": fingerprint, "data": data}))
        temporary.replace(path)
    except OSError:
        pass  # a read-only home still works, only slower
    return data


@contextmanager
def torchtitan_logger_quiet() -> Iterator[None]:
    """Building configs logs torchtitan warnings meant for training runs; keep them out of listings."""
    from torchtitan.tools.logging import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class CommandFacts:
    """``flavor_keys``: flavor name -> every key a run of it may set (short keys and config fields), None
    when its config did not build (the run itself then says why);
    ``short_keys_help``: the short keys as ``--help`` lists them; ``torchrun_options``: torchrun's
    options (those a user may pass), each mapped to whether it takes a value."""

    flavor_keys: dict[str, list[str] | None]
    short_keys_help: str
    torchrun_options: dict[str, bool]


def short_keys_help() -> str:
    """The short keys with their types and choices, as listed by ``--help``."""
    from torchtitan_ext.config.short_keys import short_keys
    from torchtitan_ext.config.value_types import annotation_name
    from torchtitan_ext.registry import all_flavors

    all_flavors()  # experiments register their keys on import
    keys = short_keys()
    width = max(len(k.key) for k in keys) + 2
    lines = ["short keys (command line --KEY VALUE, or TOML):"]
    for key in keys:
        lines.append(f"  --{key.key:<{width}} {annotation_name(key.annotation):<14} {key.help}")
    return "\n".join(lines)


def torchrun_options() -> dict[str, bool]:
    """torchrun's option strings, each mapped to whether it takes a value (those the launcher passes on)."""
    from torch.distributed.run import get_args_parser

    return {
        option: action.nargs != 0
        for option, action in get_args_parser()._option_string_actions.items()
        if option.startswith("--")
        and option not in ("--help", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
    }


def build_command_facts() -> dict[str, Any]:
    """The facts of ``CommandFacts`` from the project itself (imports torch, torchtitan, every experiment)."""
    from torchtitan_ext.config.apply import valid_keys
    from torchtitan_ext.registry import all_flavors

    def keys_of(flavor) -> list[str] | None:
        try:
            return valid_keys(flavor.build_config())
        except Exception:  # one flavor that does not build keeps neither the others nor --help from working
            return None

    with torchtitan_logger_quiet():
        flavor_keys = {flavor.name: keys_of(flavor) for flavor in all_flavors()}
    return {"flavor_keys": flavor_keys, "short_keys_help": short_keys_help(), "torchrun_options": torchrun_options()}


def command_facts() -> CommandFacts:
    """The facts, cached by the sources (module docstring)."""
    return CommandFacts(**cached_by_sources(FACTS_CACHE_NAME, build_command_facts, "the flavors' keys"))
