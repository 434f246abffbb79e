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
from torchtitan_ext.launch import launch, report_startup_error, wants_launcher
from torchtitan_ext.metrics.metadata import record_run_metadata, run_metadata
from torchtitan_ext.overrides import (
    COMMAND_LINE,
    ConfigError,
    apply_overrides,
    apply_toml_files,
    forget_value_sources,
    run_config_checks,
    split_short_key_args,
)
from torchtitan_ext.registry import UnknownFlavorError, all_flavors, get_flavor, startup_notes
from torchtitan_ext.validation import check_config_values  # noqa: F401  (registers the start-up checks)

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
    from torchtitan_ext.overrides import short_keys

    all_flavors()  # experiments register their keys on import
    keys = short_keys()
    width = max(len(k.key) for k in keys) + 2
    lines = ["short keys (command line --KEY VALUE, or TOML):"]
    for key in keys:
        lines.append(f"  --{key.key:<{width}} {_type_name(key.annotation):<14} {key.help}")
    return "\n".join(lines)


def _type_name(annotation) -> str:
    import types
    import typing

    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return "|".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    return getattr(annotation, "__name__", str(annotation))


def split_project_args(args: list[str]) -> tuple[str | None, list[str], list[str]]:
    """Take ``--flavor`` and ``--toml`` out of ``args``: (flavor, toml files, the rest)."""
    flavor, tomls, rest = None, [], []
    i = 0
    while i < len(args):
        arg = args[i]
        name, has_inline, inline = arg.partition("=")
        if name in ("--flavor", "--toml"):
            if has_inline:
                value = inline
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                raise ConfigError(f"{name} needs a value")
            if name == "--flavor":
                flavor = value
            else:
                tomls.append(value)
        else:
            rest.append(arg)
        i += 1
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


def unknown_option_errors(config, args: list[str]) -> list[str]:
    """``--a.b`` options of ``args`` that name no config field, with close matches (short keys included)."""
    import difflib

    from torchtitan_ext.overrides import valid_keys

    keys = valid_keys(config)
    known = set(keys)
    errors = []
    for arg in args:
        if not arg.startswith("--") or arg in ("--help", "--help-torchtitan"):
            continue
        name = arg[2:].partition("=")[0].replace("-", "_")
        parent, _, leaf = name.rpartition(".")
        plain = f"{parent}.{leaf.removeprefix('no_')}".lstrip(".")
        if name in known or plain in known or any(k.startswith(name + ".") for k in keys):
            continue
        close = difflib.get_close_matches(name, keys, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
        errors.append(f"{COMMAND_LINE}: unknown option {arg.partition('=')[0]}{hint}")
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
        cli_overrides, rest = split_short_key_args(rest)
        config = resolve_config(flavor, tomls, cli_overrides)
        if errors := unknown_option_errors(config, rest):
            raise ConfigError("\n".join(errors))
        return config, rest

    def parse_args(self, args: list[str] | None = None):
        config = parse_with_tyro(lambda: super(FlavorConfigManager, self).parse_args(args))
        flavor, tomls, cli_args = self.run_arguments
        run_config_checks(config)  # cross-field checks (and "auto" resolution), before any process group exists
        # Run metadata for the metrics loggers (wandb config).
        record_run_metadata(flavor=flavor, toml_files=tomls, cli_args=cli_args, config=config)
        if os.environ.get("RANK", "0") == "0":
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
        if fixes and os.environ.get("RANK", "0") == "0":
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
            line.strip() for line in text.splitlines() if line.strip().strip("-") and "For full helptext" not in line
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
    if "RANK" in os.environ:
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
        if not report_startup_error(str(e)) and os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    """Command-line entry: ``main`` and the process exit that suits the device."""
    exit_after_cpu_training(main())


if __name__ == "__main__":
    cli()
