"""Silence the log lines and Python warnings that mean nothing in a CPU training run.

``quiet_cpu_warnings()`` installs one filter per message below, on CPU only (no CUDA
device visible); with CUDA it does nothing, so GPU runs keep every message. Each
entry names the message it drops and why the message tells a CPU user nothing.

torchrun's ``Setting OMP_NUM_THREADS environment variable for each process to be 1`` notice is
left out by the train entry's launcher, which sets the variable itself when it is unset
(``launch``); a bare ``torchrun`` still prints it.
"""

import logging
import re
import warnings
from dataclasses import dataclass

from torchtitan.tools.logging import logger

from torchtitan_ext.compat import cpu_training


@dataclass(frozen=True)
class SilencedMessage:
    """A message to drop: ``pattern`` is a regular expression matched at the message's start."""

    pattern: str
    why: str


TORCHTITAN_LOG_MESSAGES = (
    SilencedMessage(
        r"initial_load_model_only=True has no effect without an initial_load_path",
        "torchtitan's checkpoint config warns about its own default whenever no initial "
        "checkpoint is loaded; the tiny CPU flavors never load one",
    ),
    SilencedMessage(
        r"Error running lspci",
        "lspci is only asked to tell GPU models apart for the MFU peak; there is no GPU",
    ),
    SilencedMessage(
        r"Peak flops undefined for: .*, fallback to A100",
        "the MFU peak of a CPU is looked up in a GPU table; MFU is not reported on CPU",
    ),
    SilencedMessage(
        r"Peak FLOPS used for computing MFU",
        "the A100 figure of the fallback above; MFU is not reported on CPU",
    ),
    SilencedMessage(
        r"ENV\[TORCH_(NCCL|FR)_\w+\] = .* will be overridden",
        "NCCL and its flight recorder are not used by gloo, the CPU backend",
    ),
    SilencedMessage(
        r"CPU memory usage for model",
        "on CPU the memory monitor's only figure is the peak resident memory of the whole process, "
        "not the model's; every step line carries the same figure",
    ),
    SilencedMessage(
        r"model\.safetensors\.index\.json not found at hf_assets_path",
        "the index only matters for checkpoints exported in Hugging Face format; the shipped "
        "asset folder holds a tokenizer, and CPU runs do not export HF checkpoints",
    ),
)

PYTHON_WARNINGS = (
    SilencedMessage(
        r"DTensor (random operators|manual_seed\(\)) may not have complete support on cpu device mesh",
        "DTensor's offset-based RNG exists for CUDA-like devices only; on a CPU mesh each rank "
        "draws from its own seeded default generator, which is what CPU training uses",
    ),
    SilencedMessage(
        r"'set_vital' is deprecated",
        "torchdata's StatefulDataLoader calls the deprecated torch.set_vital; nothing to act on",
    ),
    SilencedMessage(
        r"In CPU autocast, but the target dtype is not supported",
        "torchtitan's router asks autocast for float32 to keep routing in full precision; CPU "
        "autocast knows only bf16/fp16 and steps aside, and CPU training computes in float32",
    ),
)


class _DropMessages(logging.Filter):
    """Drops records whose message starts with one of ``messages``' patterns."""

    def __init__(self, messages: tuple[SilencedMessage, ...]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{m.pattern})" for m in messages))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def quiet_cpu_warnings() -> None:
    """On CPU, drop ``TORCHTITAN_LOG_MESSAGES`` from torchtitan's logger and ignore
    ``PYTHON_WARNINGS``; idempotent; a no-op when CUDA is available."""
    if not cpu_training():
        return
    if not any(isinstance(existing, _DropMessages) for existing in logger.filters):
        logger.addFilter(_DropMessages(TORCHTITAN_LOG_MESSAGES))
    for message in PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=message.pattern, category=UserWarning)
