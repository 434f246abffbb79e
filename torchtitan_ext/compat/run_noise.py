"""What torchtitan 0.3.0's train entry says or waits for that a run here does not need, on every device.

- ``train.py`` ``main`` logs ``torchtitan version: ...`` before it reads the config, so the line
  comes before every configuration error; it is dropped, and the train entry names the torch and
  torchtitan versions in its start-up line once the config is accepted.
- ``trainer.py`` ``Trainer.train`` ends with ``Sleeping 2 seconds for other ranks to complete`` and
  ``time.sleep(2)`` on rank 0; in a run of one process there is no other rank: neither the line nor
  the wait.
- ``components/optimizer/lr_scheduler.py`` ``LRSchedulersContainer.load_state_dict`` recomputes each
  scheduler's last learning rate with ``get_lr()``, which torch meant for its own ``step()`` and
  answers with a ``UserWarning`` on every resume; the warning is ignored.

``quiet_run_noise()`` applies all three (idempotent); ``tests/test_compat.py`` checks torchtitan
still does what they answer.
"""

import logging
import re
import time
import warnings

import torchtitan.trainer as titan_trainer
from torchtitan.tools.logging import logger

from torchtitan_ext.place_in_launch import world_size

VERSION_LINE = re.compile(r"torchtitan version: ")
RANK_WAIT_LINE = re.compile(r"Sleeping \d+ seconds for other ranks to complete")
GET_LR_WARNING = r"To get the last learning rate computed by the scheduler, please use `get_last_lr\(\)`"


class _DropRunNoise(logging.Filter):
    """Drops torchtitan's version line, and its wait-for-other-ranks line in a run of one process."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if VERSION_LINE.match(message):
            return False
        return not (world_size() == 1 and RANK_WAIT_LINE.match(message))


class _TimeWithoutRankWait:
    """``time`` as torchtitan's trainer module sees it: ``sleep`` (which it calls only to wait for the
    other ranks at the end of training) returns at once in a run of one process."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        if world_size() > 1:
            time.sleep(seconds)


def quiet_run_noise() -> None:
    """Drop the version line, the wait for other ranks in a run of one process, and the resume's
    ``get_lr()`` warning (module docstring)."""
    if not any(isinstance(existing, _DropRunNoise) for existing in logger.filters):
        logger.addFilter(_DropRunNoise())
    # pyrefly: ignore[bad-assignment]  # the trainer module's `time`, replaced by a stand-in with its attributes
    titan_trainer.time = _TimeWithoutRankWait()
    warnings.filterwarnings("ignore", message=GET_LR_WARNING, category=UserWarning)
