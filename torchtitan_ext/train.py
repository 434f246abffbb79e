"""Train a registered flavor with torchtitan's own Trainer.

    python -m torchtitan_ext.train --nproc_per_node=2 --flavor tiny-moe-grouped-mm
    torchrun --nproc_per_node=2 -m torchtitan_ext.train --flavor tiny-moe-grouped-mm
    python -m torchtitan_ext.train --flavor tiny-moe-for-loop --toml my.toml --training.steps 20

Precedence: torchtitan CLI flags > TOML files (later wins) > flavor defaults.
Without CUDA, training runs on CPU with gloo (see ``compat.cpu``); with CUDA it is
torchtitan's NCCL path. On every device the fixes the running torch needs
(``compat.torch_versions``) are applied first. Configuration errors exit with code 2
before any process group or model is built.
"""

import os
import socket
import sys
from typing import Any

import torch
import torchtitan.train as titan_train
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import logger

from torchtitan_ext.compat.cpu import (
    adapt_config_for_cpu,
    cpu_training,
    exit_after_cpu_training,
    patch_torchtitan_for_cpu,
)
from torchtitan_ext.compat.quiet_cpu import quiet_cpu_warnings
from torchtitan_ext.compat.torch_versions import apply_torch_version_fixes
from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import apply_overrides, apply_toml_files, valid_keys, written_fields
from torchtitan_ext.config.checks import run_config_checks
from torchtitan_ext.config.command_line import COMMAND_LINE, split_override_args, take_options
from torchtitan_ext.config.short_keys import short_keys
from torchtitan_ext.config.toml_files import toml_value
from torchtitan_ext.config.value_sources import forget_value_sources, record_value_sources
from torchtitan_ext.config.value_types import annotation_name
from torchtitan_ext.launch import launch, report_startup_error, wants_launcher
from torchtitan_ext.metrics.metadata import record_run_metadata, run_metadata
from torchtitan_ext.place_in_launch import in_launch, is_rank_zero
from torchtitan_ext.registry import UnknownFlavorError, all_flavors, get_flavor, startup_notes
from torchtitan_ext.validation import check_config_values

USAGE = """\
usage: python -m torchtitan_ext.train [TORCHRUN OPTIONS] --flavor NAME
           [--toml FILE ...] [TORCHTITAN OPTIONS ...]
       (also: moe-train ...; torchrun --nproc_per_node=N -m torchtitan_ext.train ...)

Train a registered flavor with torchtitan's Trainer (CPU/gloo without CUDA, NCCL with it).
Leading torchrun options (e.g. --nproc_per_node=2, --nnodes, --rdzv_endpoint) start the
processes through torchrun, show rank 0's output, and report a start-up error once (exit 2).

options:
  --flavor NAME        flavor to train (list them: python -m torchtitan_ext.flavors)
  --toml FILE          TOML overrides, repeatable, later files win (keys: docs/configuration.md)
  --help-torchtitan    with --flavor: list every torchtitan option for that flavor
  -h, --help           show this help

Every short key (below) and any torchtitan option is accepted after these and wins over
the TOML files, e.g. --moe.compute_backend for_loop --parallelism.ep 2 --training.steps 20.
"""


def short_keys_help() -> str:
    """The short keys with their types and choices, as listed by ``--help``."""
    all_flavors()  # experiments register their keys on import
    keys = short_keys()
    width = max(len(k.key) for k in keys) + 2
    lines = ["short keys (command line --KEY VALUE, or TOML):"]
    for key in keys:
        lines.append(f"  --{key.key:<{width}} {annotation_name(key.annotation):<14} {key.help}")
    return "\n".join(lines)


PROJECT_OPTIONS = ("--flavor", "--toml")
"""The train entry's own options; short keys and torchtitan's options follow them."""


def split_project_args(args: list[str]) -> tuple[str | None, list[str], list[str]]:
    """Take ``--flavor`` and ``--toml`` out of ``args``: (flavor, toml files, the rest)."""
    taken, rest = take_options(args, lambda name: name if name in PROJECT_OPTIONS else None)
    flavor, tomls = None, []
    for option, value in taken:
        if value is None:
            raise ConfigError(f"{option} needs a value")
        if option == "--flavor":
            flavor = value
        else:
            tomls.append(value)
    return flavor, tomls, rest


def resolve_config(flavor_name: str, toml_paths: list[str], cli_overrides: dict | None = None):
    """The flavor's ``Trainer.Config`` with the TOML files, then the command-line short keys, applied."""
    try:
        flavor = get_flavor(flavor_name)
    except UnknownFlavorError as e:
        raise ConfigError(str(e)) from None
    forget_value_sources()
    config = apply_toml_files(flavor.build(), toml_paths)
    return apply_overrides(config, cli_overrides or {}, source=COMMAND_LINE)


def option_key(arg: str, known: set[str]) -> str | None:
    """The config key an option ``--a.b[=v]`` / ``--a.no_b`` sets, when it is in ``known``; else None."""
    if not arg.startswith("--"):
        return None
    name = arg[2:].partition("=")[0].replace("-", "_")
    parent, _, leaf = name.rpartition(".")
    plain = f"{parent}.{leaf.removeprefix('no_')}".lstrip(".")
    return name if name in known else plain if plain in known else None


def unknown_option_errors(config, args: list[str]) -> list[str]:
    """``--a.b`` options of ``args`` that name no config field, with close matches (short keys included)."""
    import difflib

    keys = valid_keys(config)
    known = set(keys)
    errors = []
    for arg in args:
        if not arg.startswith("--") or arg in ("--help", "--help-torchtitan"):
            continue
        name = arg[2:].partition("=")[0].replace("-", "_")
        if option_key(arg, known) is not None or any(k.startswith(name + ".") for k in keys):
            continue
        close = difflib.get_close_matches(name, keys, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
        errors.append(f"{COMMAND_LINE}: unknown option {arg.partition('=')[0]}{hint}")
    return errors


def parser_options(args: list[str], known: set[str]) -> dict[str, tuple[str, Any]]:
    """``{config key: (option as given, its value read as a TOML value)}`` of the options in ``args``
    that torchtitan's parser takes; a switch (``--a.b``, ``--a.no_b``) has the value true or false."""
    options = {}
    for i, arg in enumerate(args):
        if (key := option_key(arg, known)) is None:
            continue
        name, has_inline, inline = arg.partition("=")
        if has_inline:
            shown, text = arg, inline
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            shown, text = f"{arg} {args[i + 1]}", args[i + 1]
        else:
            switched_off = name[2:].replace("-", "_") != key
            shown, text = arg, "false" if switched_off else "true"
        options[key] = (shown, toml_value(text))
    return options


def parser_conflict_errors(config, overrides: dict, parser_keys: dict[str, tuple[str, Any]]) -> list[str]:
    """Command-line ``overrides`` (the project's) that set a field to another value than an option
    torchtitan's parser takes (``parser_options``), each an error naming both."""
    errors = []
    for key, fields in written_fields(config, overrides).items():
        errors += [
            f"{COMMAND_LINE}: --{key} {overrides[key]!r} and {parser_keys[field][0]} both set {field}; keep one of them"
            for field, value in fields.items()
            if field in parser_keys and parser_keys[field][1] != value
        ]
    return errors


class FlavorConfigManager(ConfigManager):
    """torchtitan's ConfigManager, loading ``--flavor``/``--toml`` instead of ``--module``/``--config``."""

    def _load_config(self, args: list[str]):
        flavor, tomls, rest = split_project_args(args)
        if flavor is None:
            raise ConfigError("--flavor is required (list flavors: python -m torchtitan_ext.flavors)")
        if "--help-torchtitan" in rest:
            rest = [a for a in rest if a != "--help-torchtitan"] + ["--help"]
        self.run_arguments = (flavor, tomls, rest)
        all_flavors()  # experiments register their short keys on import
        cli_overrides, rest = split_override_args(rest)
        from_files = resolve_config(flavor, tomls)
        config = apply_overrides(from_files, cli_overrides, source=COMMAND_LINE)
        known = set(valid_keys(config))
        parser_keys = parser_options(rest, known)
        errors = unknown_option_errors(config, rest) + parser_conflict_errors(from_files, cli_overrides, parser_keys)
        if errors:
            raise ConfigError("\n".join(errors))
        record_value_sources(dict.fromkeys(parser_keys, COMMAND_LINE))
        self.resolved_config = config
        return config, rest

    def parse_args(self, args: list[str] | None = None):
        self.resolved_config = None
        try:
            config = parse_with_tyro(lambda: super(FlavorConfigManager, self).parse_args(args))
        except ConfigError:
            if self.resolved_config is not None:
                # torchtitan's own checks refused a value; a TOML file's is named with its line.
                check_config_values(self.resolved_config)
            raise
        flavor, tomls, cli_args = self.run_arguments
        run_config_checks(config)  # cross-field checks (and "auto" resolution), before any process group exists
        # Run metadata for the metrics loggers (wandb config).
        record_run_metadata(flavor=flavor, toml_files=tomls, cli_args=cli_args, config=config)
        if is_rank_zero():
            metadata = run_metadata()
            transport = f", ep_transport={metadata['ep_transport']}" if "ep_transport" in metadata else ""
            logger.info(
                f"flavor {flavor}: compute_backend={metadata['compute_backend']}, "
                f"expert_parallel_degree={metadata['expert_parallel_degree']}{transport}, "
                f"toml files: {', '.join(tomls) or 'none'}"
            )
            for note in startup_notes(config):
                logger.info(note)
        fixes = apply_torch_version_fixes()
        if fixes and is_rank_zero():
            logger.info(f"torch {torch.__version__}: torchtitan compatibility fixes applied: {', '.join(fixes)}")
        if cpu_training():
            adapt_config_for_cpu(config)
            patch_torchtitan_for_cpu()
        return config


def parse_with_tyro(parse):
    """Run torchtitan's tyro parsing; its usage errors and ``ValueError``s become ``ConfigError``."""
    import contextlib
    import io
    import re

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            return parse()
    except SystemExit as e:
        if e.code in (0, None):
            sys.stdout.write(captured.getvalue())
            raise
        text = re.sub(r"[\u2500-\u257f]", " ", captured.getvalue())
        lines = [
            line.strip()
            for line in text.splitlines()
            if line.strip().strip("-") and "For full helptext" not in line and not line.rstrip().endswith(" --help")
        ]
        raise ConfigError(f"{COMMAND_LINE}: " + "\n".join(lines or [f"invalid arguments (exit {e.code})"])) from None
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{COMMAND_LINE}: {e}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_process_env() -> None:
    """Outside torchrun, provide the rendezvous variables torchtitan expects (world of 1)."""
    if in_launch():
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(USAGE)
        print(short_keys_help())
        return 0
    if wants_launcher(args):
        return launch(args)
    set_single_process_env()
    quiet_cpu_warnings()
    # torchtitan's main builds its config through the name ``ConfigManager``.
    titan_train.ConfigManager = FlavorConfigManager
    sys.argv = [sys.argv[0], *args]
    try:
        titan_train.main()
    except ConfigError as e:
        if not report_startup_error(str(e)) and is_rank_zero():
            print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    """Command-line entry: ``main`` and the process exit that suits the device."""
    exit_after_cpu_training(main())


if __name__ == "__main__":
    cli()
