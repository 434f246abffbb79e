"""torchtitan's Trainer on a registered flavor: the ``ConfigManager`` that loads ``--flavor`` / ``--toml``
and the command line, and a training run in this process (``run``). The parsed config builds
``torchtitan_ext.trainer.Trainer`` (torchtitan's, with CUDA-graph steps that own their gradients).

The train entry (``torchtitan_ext.train``) checks the arguments it can without torch and comes
here to train. Without CUDA, training runs on CPU with gloo (see ``compat.cpu``), one thread per
process unless ``OMP_NUM_THREADS`` says otherwise (as torchrun sets it); with CUDA it is
torchtitan's NCCL path. On every device the fixes the running torch needs
(``compat.torch_versions``) are applied first. Configuration errors exit with code 2 before any
process group or model is built; Ctrl-C ends a run with one line and its summary (exit code 130).
"""

import contextlib
import os
import re
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torchtitan
import torchtitan.train as titan_train
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import logger

from torchtitan_ext.command_facts import torchrun_options
from torchtitan_ext.compat.cpu import adapt_config_for_cpu, cpu_training, patch_torchtitan_for_cpu
from torchtitan_ext.compat.quiet_cpu import quiet_cpu_warnings
from torchtitan_ext.compat.run_noise import quiet_run_noise
from torchtitan_ext.compat.torch_versions import apply_torch_version_fixes, apply_trainer_fixes
from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import (
    applied_noting_refusals,
    apply_overrides,
    apply_toml_files,
    valid_keys,
    written_fields,
)
from torchtitan_ext.config.checks import run_config_checks, value_check_errors
from torchtitan_ext.config.command_line import (
    COMMAND_LINE,
    FLAVOR_REQUIRED,
    command_line_errors,
    option_key,
    split_override_args,
    split_project_args,
    subcommands_as_short_keys,
    switches_for_parser,
    take_options,
)
from torchtitan_ext.config.config_tree import leaf_items, section_that_is_off
from torchtitan_ext.config.toml_files import toml_value
from torchtitan_ext.config.value_sources import forget_value_sources, record_resolved_from, record_value_sources
from torchtitan_ext.launch import (
    INTERRUPTED_EXIT_CODE,
    allocator_description,
    report_startup_error,
    under_this_launcher,
)
from torchtitan_ext.metrics.metadata import record_run_metadata, run_metadata
from torchtitan_ext.metrics.processor import close_interrupted_runs
from torchtitan_ext.place_in_launch import in_launch, is_rank_zero
from torchtitan_ext.registry import UnknownFlavorError, all_flavors, get_flavor, startup_notes
from torchtitan_ext.trainer import with_gradient_owning_trainer


def resolve_config(flavor_name: str, toml_paths: list[str]):
    """The flavor's ``Trainer.Config`` with the TOML files applied (later files win)."""
    try:
        flavor = get_flavor(flavor_name)
    except UnknownFlavorError as e:
        raise ConfigError(str(e)) from None
    forget_value_sources()
    record_resolved_from(flavor_name, toml_paths)
    return apply_toml_files(flavor.build_config(), toml_paths)


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


def _as_typed(value: Any) -> str:
    """A command-line value as it is typed: ``true``/``false`` for switches, other values as Python shows them."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def parser_conflict_errors(config, overrides: dict, parser_keys: dict[str, tuple[str, Any]]) -> list[str]:
    """Command-line ``overrides`` (the project's) that set a field to another value than an option
    torchtitan's parser takes (``parser_options``), each an error naming both."""
    errors = []
    for key, fields in written_fields(config, overrides).items():
        errors += [
            f"{COMMAND_LINE}: --{key} {_as_typed(overrides[key])} and {parser_keys[field][0]} both set {field} "
            f"(to {_as_typed(value)} and {_as_typed(parser_keys[field][1])}); keep one of them"
            for field, value in fields.items()
            if field in parser_keys and parser_keys[field][1] != value
        ]
    return errors


def parser_option_problems(config, parser_keys: dict[str, tuple[str, Any]]) -> tuple[list[str], list[str]]:
    """(the values refused one by one among the options torchtitan's parser takes (``parser_options``), what
    the value checks find in ``config`` with every other of those values applied): where a value was refused,
    the rest of the run's one message."""
    refused: list[str] = []
    values = {key: value for key, (_, value) in parser_keys.items()}
    # options that set one field twice: the command-line checks name them once the values are fixed
    with contextlib.suppress(ConfigError):
        config = applied_noting_refusals(refused, apply_overrides, config, values, COMMAND_LINE)
    return refused, value_check_errors(config)


class FlavorConfigManager(ConfigManager):
    """torchtitan's ConfigManager, loading ``--flavor``/``--toml`` instead of ``--module``/``--config``."""

    def _load_config(self, args: list[str]):
        flavor, tomls, rest = split_project_args(args)
        if flavor is None:
            raise ConfigError(FLAVOR_REQUIRED)
        if "--help-torchtitan" in rest:
            rest = [a for a in rest if a != "--help-torchtitan"] + ["--help"]
        all_flavors()  # experiments register their short keys on import
        args, rest = subcommands_as_short_keys(args), subcommands_as_short_keys(rest)
        self.run_arguments = (flavor, tomls, rest)
        cli_overrides, rest = split_override_args(rest)
        refused: list[str] = []
        from_files = applied_noting_refusals(refused, resolve_config, flavor, tomls)
        config = applied_noting_refusals(refused, apply_overrides, from_files, cli_overrides, COMMAND_LINE)
        known = set(valid_keys(config))
        rest = switches_for_parser(rest, [key for key, value in leaf_items(config).items() if isinstance(value, bool)])
        parser_keys = parser_options(rest, known)
        self.parser_keys = parser_keys
        if refused:
            refused_options, problems = parser_option_problems(config, parser_keys)
            raise ConfigError("\n".join(dict.fromkeys([*refused, *refused_options, *problems])))
        errors = command_line_errors(
            list(known), args, torchrun_options(), lambda key: section_that_is_off(config, key)
        )
        errors += parser_conflict_errors(from_files, cli_overrides, parser_keys)
        if errors:
            raise ConfigError("\n".join(errors))
        record_value_sources(dict.fromkeys(parser_keys, COMMAND_LINE))
        self.resolved_config = config
        return config, rest

    def _validate_config(self) -> None:
        """Nothing: torchtitan's ``ConfigManager._validate_config`` warns of a missing ``hf_assets_path`` and
        may switch it to a legacy tokenizer path; ``validation.check_config_values`` refuses a missing or tokenizer-less
        folder instead, named as it was set (``data.tokenizer``), in the run's one error message."""

    def parse_args(self, args: list[str] | None = None) -> Any:
        """The run's config, a ``torchtitan_ext.trainer.Trainer.Config`` (typed ``Any``: the flavors'
        configs carry sections of their own, such as ``moe_metrics``, that the class does not declare)."""
        from torchtitan_ext.compat.cuda_graph_dispatchers import apply_cuda_graph_dispatcher_fix

        apply_cuda_graph_dispatcher_fix()  # before tyro builds the config: torchtitan checks CUDA graphs there
        self.resolved_config = None
        self.parser_keys: dict[str, tuple[str, Any]] = {}
        try:
            command_line = sys.argv[1:] if args is None else args
            config = parse_with_tyro(lambda: super(FlavorConfigManager, self).parse_args(args), command_line)
        except ConfigError as refusal:
            if self.resolved_config is not None:
                # tyro refused a value (the first only: the others come from parser_option_problems), or
                # torchtitan's own checks did (the value checks name a TOML file's with its line).
                refused_options, problems = parser_option_problems(self.resolved_config, self.parser_keys)
                if refused_options or problems:
                    named_key = re.match(rf"{COMMAND_LINE}: (\S+) = ", str(refusal))
                    others = [
                        line
                        for message in refused_options
                        for line in message.splitlines()
                        if not (named_key and line.startswith(named_key.group(0)))
                    ]
                    lines = [str(refusal), *others] if refused_options else []
                    raise ConfigError("\n".join(dict.fromkeys([*lines, *problems]))) from None
            raise
        flavor, tomls, cli_args = self.run_arguments
        run_config_checks(config)  # cross-field checks (and "auto" resolution), before any process group exists
        # Run metadata for the metrics loggers (wandb config).
        record_run_metadata(flavor=flavor, toml_files=tomls, cli_args=cli_args, config=config)
        if is_rank_zero():
            metadata = run_metadata()
            transport = "".join(
                f", {key}={metadata[key]}"
                for key in (
                    "ep_transport",
                    "ep_receive_rows",
                    "experts_apply_scores",
                    "recompute_preactivations",
                    "experts_fsdp",
                )
                if key in metadata
            )
            precision = metadata.get("expert_precision", "native")
            precision = "" if precision == "native" else f", expert_precision={precision}"
            logger.info(
                f"flavor {flavor}: compute_backend={metadata['compute_backend']}{precision}, "
                f"expert_parallel_degree={metadata['expert_parallel_degree']}{transport}, "
                f"compile={compile_state(config)}, "
                f"cuda_graphs={cuda_graphs_state(config)}, "
                f"toml files: {', '.join(tomls) or 'none'}; torch {torch.__version__}, "
                f"torchtitan {torchtitan.__version__}"
            )
            if cpu_training():
                logger.info(
                    f"CPU: {torch.get_num_threads()} thread(s) per process, OMP_NUM_THREADS="
                    f"{os.environ.get('OMP_NUM_THREADS')} (1 when it is unset, as torchrun gives each process)"
                )
            else:
                logger.info(f"CUDA caching allocator: {allocator_description()}")
            for note in startup_notes(config):
                logger.info(note)
        fixes = apply_trainer_fixes() + apply_torch_version_fixes()
        if fixes and is_rank_zero():
            logger.info(f"torch {torch.__version__}: torchtitan compatibility fixes applied: {', '.join(fixes)}")
        if cpu_training():
            adapt_config_for_cpu(config)
            patch_torchtitan_for_cpu()
        return with_gradient_owning_trainer(config)


def cuda_graphs_state(config) -> str:
    """What the start-up line says of CUDA graphs: ``on``, ``off``, or, where they were asked for on CPU
    (``adapt_config_for_cpu`` turns them off), ``off`` with the reason."""
    if config.training.disable_cuda_graphs:
        return "off"
    return "off (no CUDA device; training.disable_cuda_graphs = false applies on GPUs)" if cpu_training() else "on"


def compiles_model(config) -> bool:
    """Whether torchtitan compiles the model's blocks (``compile.enable`` with the ``model`` component)."""
    return config.compile.enable and "model" in config.compile.components


def compile_state(config) -> str:
    """The start-up line's ``compile=``: "on" (the model's blocks, and whatever else is named), "off", or
    the components compiled without the model (e.g. "loss only")."""
    if compiles_model(config):
        return "on"
    if config.compile.enable and config.compile.components:
        return f"{' and '.join(config.compile.components)} only"
    return "off"


def value_error_line(lines: list[str], args: Sequence[str]) -> str | None:
    """tyro's report of a value it could not convert (``Error parsing --training.steps: invalid literal
    ...``, then the option's type and help) as the short keys word theirs: ``training.steps = 'abc':
    expected int (How many train steps to run (default: 50))``; None for other reports."""
    report = re.search(r"Error parsing --(\S+?): .*? Argument helptext: --(\S+) (\S+) ?(.*)$", " ".join(lines))
    if report is None or report[1] != report[2]:
        return None
    spelled = report[1].replace("_", "-")
    taken, _ = take_options(list(args), lambda name: name[2:] if name[2:].replace("_", "-") == spelled else None)
    if not taken or (value := taken[-1][1]) is None:
        return None
    option = taken[-1][0]
    kind, help_text = report[3], report[4]
    expected = f"one of {kind}" if kind.startswith("{") else kind.lower()
    return f"{option} = {value!r}: expected {expected}" + (f" ({help_text})" if help_text else "")


def parse_with_tyro(parse, args: Sequence[str] = ()):
    """Run torchtitan's tyro parsing of ``args``; its usage errors and ``ValueError``s become
    ``ConfigError`` (a value tyro could not convert worded as ``value_error_line`` does)."""
    import io

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
        message = value_error_line(lines, args) or "\n".join(lines or [f"invalid arguments (exit {e.code})"])
        raise ConfigError(f"{COMMAND_LINE}: {message}") from None
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


def use_one_thread_on_cpu() -> None:
    """On CPU, one thread per process unless ``OMP_NUM_THREADS`` is set: what torchrun gives each
    process (the tiny flavors' steps are several times faster than on every core of a busy machine)."""
    if cpu_training() and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def run(args: list[str]) -> int:
    """Train with torchtitan's main in this process on ``args`` (``--flavor``, ``--toml``, overrides);
    the exit code: 0, 2 for a start-up error, ``INTERRUPTED_EXIT_CODE`` after Ctrl-C."""
    set_single_process_env()
    use_one_thread_on_cpu()
    quiet_cpu_warnings()
    quiet_run_noise()
    # torchtitan's main builds its config through the name ``ConfigManager``.
    titan_train.ConfigManager = FlavorConfigManager
    sys.argv = [sys.argv[0], *args]
    try:
        titan_train.main()
    except ConfigError as e:
        if not report_startup_error(str(e)) and is_rank_zero():
            print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if is_rank_zero() and not under_this_launcher():
            print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        close_interrupted_runs()
        return INTERRUPTED_EXIT_CODE
    return 0
