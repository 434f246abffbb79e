"""Multi-process launch through torchrun, with start-up errors reported once and exit code 2.

    python -m torchtitan_ext.train --nproc_per_node=2 --flavor tiny-moe-grouped-mm ...
    moe-train --nproc_per_node=2 --flavor tiny-moe-grouped-mm ...

Leading torchrun options (``--nproc_per_node``, ``--nnodes``, ``--rdzv_endpoint``, ...) make the
train entry start torchrun in this process with ``-m torchtitan_ext.train`` and the remaining
arguments; only rank 0's output is shown unless ``--local-ranks-filter`` says otherwise. Each process
gets ``OMP_NUM_THREADS=1`` unless it is set, as torchrun would give it (without torchrun's notice).

Every training process, however launched, runs the CUDA caching allocator with
``ALLOCATOR_DEFAULT`` (``expandable_segments:True``, what torchtitan's own launch script sets) unless
``PYTORCH_ALLOC_CONF`` or its older name ``PYTORCH_CUDA_ALLOC_CONF`` is set (``set_allocator_default``).

torchrun turns any failed worker into a ``ChildFailedError`` traceback and exit code 1. Here every
worker that refuses its configuration writes the message to its own file in a folder this launcher
names (``ERROR_FOLDER_ENV``) and exits 2, whichever rank it is; the launcher silences torchrun's
failure report, prints the message of the rank that failed first, once, last, and exits 2. Other
failures keep torchrun's report and exit code. Ctrl-C stops the workers (rank 0 prints its run
summary) and ends the launcher with one line and exit code 130.
"""

import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from torchtitan_ext.command_facts import command_facts
from torchtitan_ext.place_in_launch import rank

ERROR_FOLDER_ENV = "TORCHTITAN_EXT_ERROR_FOLDER"
"""The folder where every rank writes its start-up error (``rank-<N>.txt``) for the launcher."""

INTERRUPTED_EXIT_CODE = 130
"""A run stopped by Ctrl-C (SIGINT), as a shell reports it."""

RANK_FILTER_OPTIONS = ("--local-ranks-filter", "--local_ranks_filter")

ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The variables torch reads the CUDA caching allocator's settings from, the first one winning."""
ALLOCATOR_DEFAULT = "expandable_segments:True"
"""The allocator settings of a training run whose environment names none: segments that grow in place
instead of new ones of fixed sizes, so a compiled step's many buffer sizes fragment less (2x H100,
``olmoe-1b-7b``: 3.7 to 8.6 GiB less reserved at the same tokens/s, docs/results/gpu_training.md)."""


def allocator_settings(environ: Mapping[str, str] = os.environ) -> str | None:
    """The CUDA caching allocator settings a process with ``environ`` runs with (None: torch's defaults)."""
    return next((environ[name] for name in ALLOCATOR_ENV if name in environ), None)


def training_allocator_settings(environ: Mapping[str, str] = os.environ) -> str:
    """The allocator settings a training process the train entry starts from ``environ`` runs with:
    ``environ``'s, else ``ALLOCATOR_DEFAULT`` ("": torch's defaults)."""
    settings = allocator_settings(environ)
    return ALLOCATOR_DEFAULT if settings is None else settings


def allocator_description(environ: Mapping[str, str] = os.environ) -> str:
    """What the start-up line says of the CUDA caching allocator's settings in ``environ``."""
    settings = allocator_settings(environ)
    if settings == ALLOCATOR_DEFAULT:
        return f"{settings} (the train entry's default; {ALLOCATOR_ENV[0]} replaces it)"
    if not settings:
        return f"torch's defaults ({ALLOCATOR_ENV[0]} is empty or unset)"
    return f"{settings} (from the environment)"


def set_allocator_default(environ: MutableMapping[str, str] = os.environ) -> None:
    """Give ``environ`` ``PYTORCH_ALLOC_CONF=ALLOCATOR_DEFAULT`` unless it sets the allocator's settings
    (even to nothing). Takes effect when it runs before torch first allocates CUDA memory: the train
    entry calls it before it imports torch, and the processes it starts inherit it."""
    if allocator_settings(environ) is None:
        environ[ALLOCATOR_ENV[0]] = ALLOCATOR_DEFAULT


def split_launcher_args(args: list[str]) -> tuple[list[str], list[str]]:
    """The leading torchrun options of ``args`` and the rest (the training arguments)."""
    options = command_facts().torchrun_options
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
    """Hand this rank's start-up ``message`` to the launcher; False when no launcher waits for it.

    The file appears whole (written aside, then renamed), so the launcher never reads half of it.
    """
    folder = os.environ.get(ERROR_FOLDER_ENV)
    if not folder:
        return False
    path = Path(folder) / f"rank-{rank()}.txt"
    temporary = path.with_suffix(".tmp")
    temporary.write_text(message)
    temporary.replace(path)
    return True


def first_startup_error(folder: str) -> str | None:
    """The message of the rank whose start-up error was written first; None when no rank wrote one."""
    written = sorted(Path(folder).glob("rank-*.txt"), key=lambda path: (path.stat().st_mtime_ns, path.name))
    return written[0].read_text() if written else None


def under_this_launcher() -> bool:
    """True in a worker this launcher started (it reports start-up errors and Ctrl-C for the run)."""
    return ERROR_FOLDER_ENV in os.environ


class _WithoutCtrlCReports(logging.Filter):
    """Drops torchrun's lines about passing Ctrl-C (SIGINT) on to the workers: the launcher says it once."""

    PATTERN = re.compile(r"Received (2|Signals\.SIGINT) death signal|Sending process \d+ closing signal (2|SIGINT)")

    def filter(self, record: logging.LogRecord) -> bool:
        return self.PATTERN.match(record.getMessage()) is None


class _WithoutStartupFailureReports(logging.Filter):
    """Drops torchrun's lines about a failed worker and the workers it stops, once a worker wrote its
    start-up error to ``folder``: the launcher prints that error instead, once."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        return next(Path(self.folder).glob("rank-*.txt"), None) is None


TORCHRUN_WORKER_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)
"""torchrun's loggers of signals sent to the workers and of their failures."""


def launch(args: list[str]) -> int:
    """Run torchrun with ``args`` (torchrun options, then training arguments); see the module docstring."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    launcher_args, train_args = split_launcher_args(args)
    if not any(a.partition("=")[0] in RANK_FILTER_OPTIONS for a in launcher_args):
        launcher_args.append("--local-ranks-filter=0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="moe-train-") as folder:
        for name in TORCHRUN_WORKER_LOGGERS:
            logging.getLogger(name).addFilter(_WithoutCtrlCReports())
            logging.getLogger(name).addFilter(_WithoutStartupFailureReports(folder))
        os.environ[ERROR_FOLDER_ENV] = folder
        try:
            torchrun_main([*launcher_args, "-m", "torchtitan_ext.train", *train_args])
        except ChildFailedError:
            message = first_startup_error(folder)
            if message is None:
                raise
            _silence_torchrun_reports()
            print(f"error: {message}", file=sys.stderr)
            return 2
        except (KeyboardInterrupt, SignalException):
            _silence_torchrun_reports()
            print("interrupted (Ctrl-C): the workers stopped", file=sys.stderr)
            return INTERRUPTED_EXIT_CODE
    return 0


def _silence_torchrun_reports() -> None:
    """torchrun's loggers report the failed workers again after their own message."""
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
