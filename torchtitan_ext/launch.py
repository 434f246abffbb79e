"""Multi-process launch through torchrun, with start-up errors reported once and exit code 2.

    python -m torchtitan_ext.train --nproc_per_node=2 --flavor tiny-moe-grouped-mm ...
    moe-train --nproc_per_node=2 --flavor tiny-moe-grouped-mm ...

Leading torchrun options (``--nproc_per_node``, ``--nnodes``, ``--rdzv_endpoint``, ...) make the
train entry start torchrun in this process with ``-m torchtitan_ext.train`` and the remaining
arguments; only rank 0's output is shown unless ``--local-ranks-filter`` says otherwise.

torchrun turns any failed worker into a ``ChildFailedError`` traceback and exit code 1. Here a
worker that refuses its configuration writes the message to a file this launcher names
(``ERROR_FILE_ENV``) and exits 2; the launcher silences torchrun's failure report, prints the
message last and exits 2. Other failures keep torchrun's report and exit code.
"""

import logging
import os
import sys
import tempfile
from pathlib import Path

from torchtitan_ext.place_in_launch import is_rank_zero

ERROR_FILE_ENV = "TORCHTITAN_EXT_ERROR_FILE"
"""Where rank 0 writes a start-up error for the launcher to print."""

RANK_FILTER_OPTIONS = ("--local-ranks-filter", "--local_ranks_filter")


def _torchrun_options() -> dict[str, bool]:
    """torchrun's option strings, each mapped to whether it takes a value."""
    from torch.distributed.run import get_args_parser

    return {
        option: action.nargs != 0
        for option, action in get_args_parser()._option_string_actions.items()
        if option.startswith("--")
        and option not in ("--help", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
    }


def split_launcher_args(args: list[str]) -> tuple[list[str], list[str]]:
    """The leading torchrun options of ``args`` and the rest (the training arguments)."""
    options = _torchrun_options()
    launcher, i = [], 0
    while i < len(args):
        name = args[i].partition("=")[0]
        if name not in options:
            break
        launcher.append(args[i])
        if options[name] and "=" not in args[i] and i + 1 < len(args):
            launcher.append(args[i + 1])
            i += 1
        i += 1
    return launcher, args[i:]


def wants_launcher(args: list[str]) -> bool:
    """True when ``args`` start with a torchrun option and no torchrun started this process."""
    return "TORCHELASTIC_RUN_ID" not in os.environ and bool(args) and bool(split_launcher_args(args)[0])


def report_startup_error(message: str) -> bool:
    """Hand rank 0's start-up ``message`` to the launcher; False when no launcher waits for it."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    if is_rank_zero():
        Path(path).write_text(message)
    return True


def launch(args: list[str]) -> int:
    """Run torchrun with ``args`` (torchrun options, then training arguments); see the module docstring."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    launcher_args, train_args = split_launcher_args(args)
    if not any(a.partition("=")[0] in RANK_FILTER_OPTIONS for a in launcher_args):
        launcher_args.append("--local-ranks-filter=0")
    with tempfile.TemporaryDirectory(prefix="moe-train-") as folder:
        error_file = Path(folder) / "startup_error.txt"
        os.environ[ERROR_FILE_ENV] = str(error_file)
        try:
            torchrun_main([*launcher_args, "-m", "torchtitan_ext.train", *train_args])
        except ChildFailedError:
            if not error_file.exists():
                raise
            _silence_torchrun_reports()
            print(f"error: {error_file.read_text()}", file=sys.stderr)
            return 2
    return 0


def _silence_torchrun_reports() -> None:
    """torchrun's loggers report the failed workers again after their own message."""
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
