"""Train a registered flavor with torchtitan's own Trainer.

    python -m torchtitan_ext.train --nproc_per_node=2 --flavor tiny-moe-grouped-mm
    torchrun --nproc_per_node=2 -m torchtitan_ext.train --flavor tiny-moe-grouped-mm
    python -m torchtitan_ext.train --flavor tiny-moe-for-loop --toml my.toml --training.steps 20

Precedence: command line > TOML files (later wins) > flavor defaults; a key given twice on the
command line is an error. ``--help``, a missing or unknown flavor, an unknown or repeated option and
a torchrun option placed after the training arguments are answered from the cached command facts
(``command_facts``) before torch is imported and before torchrun starts any process; everything
else is checked once the config is built (``run_training``), before any process group or model.
Configuration errors exit with code 2.
"""

import sys
from pathlib import Path

from torchtitan_ext.command_facts import CommandFacts, command_facts
from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import name_errors
from torchtitan_ext.config.command_line import (
    COMMAND_LINE,
    FLAVOR_REQUIRED,
    command_line_errors,
    launcher_option_errors,
    split_override_args,
    split_project_args,
)
from torchtitan_ext.config.names import unknown_flavor_message
from torchtitan_ext.config.toml_files import read_toml
from torchtitan_ext.launch import (
    launch,
    report_startup_error,
    set_allocator_default,
    split_launcher_args,
    wants_launcher,
)
from torchtitan_ext.place_in_launch import is_rank_zero
from torchtitan_ext.stdout_pipe import until_the_reader_stops

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

Every short key (below) and any torchtitan option is accepted after these, once each, and wins
over the TOML files, e.g. --moe.compute_backend for_loop --parallelism.ep 2 --training.steps 20.
Switches take true or false as the short keys do (--compile.enable false = --compile.no-enable).
"""


def argument_errors(args: list[str], facts: CommandFacts) -> list[str]:
    """What the cached facts tell about the training arguments ``args`` without building a config: the
    flavor (missing, unknown), else every problem of the names: the keys of every TOML file (unreadable,
    unknown, fixed by the flavor) and of the command line's overrides, torchrun options after the
    training arguments, unknown options. Values are the run's to check, and so is everything of a
    flavor whose config did not build for the facts."""
    try:
        flavor, tomls, rest = split_project_args(args)
        if flavor is None:
            return [FLAVOR_REQUIRED]
        if flavor not in facts.flavor_keys:
            return [unknown_flavor_message(flavor, facts.flavor_keys)]
        keys = facts.flavor_keys[flavor]
        if keys is None:
            return []
        errors = []
        for path in tomls:
            try:
                overrides, lines = read_toml(Path(path))
            except ConfigError as e:
                errors.append(str(e))
                continue
            errors += name_errors(overrides, keys, path, lines)
        errors += name_errors(split_override_args(rest)[0], keys, COMMAND_LINE)
    except ConfigError as e:
        return [str(e)]
    return errors + command_line_errors(keys, args, facts.torchrun_options)


def main(argv: list[str] | None = None) -> int:
    """The train entry on ``argv`` (default: this process's arguments); returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(USAGE)
        print(command_facts().short_keys_help)
        return 0
    facts = command_facts()
    launcher_args, train_args = split_launcher_args(args) if wants_launcher(args) else ([], args)
    if errors := [*launcher_option_errors(launcher_args, facts.torchrun_options), *argument_errors(train_args, facts)]:
        message = "\n".join(errors)
        if not report_startup_error(message) and is_rank_zero():
            print(f"error: {message}", file=sys.stderr)
        return 2
    set_allocator_default()
    if launcher_args:
        return launch(args)
    from torchtitan_ext.run_training import run

    return run(args)


def cli() -> None:
    """Command-line entry: ``main``, and the process exit that suits the device after a training run."""
    code = until_the_reader_stops(main)
    if "torchtitan_ext.run_training" in sys.modules:  # a run in this process: gloo's threads may outlive it
        from torchtitan_ext.compat.cpu import exit_after_cpu_training

        exit_after_cpu_training(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
