"""This process's place in a launch: its rank and the number of ranks, as torchrun sets them.

torchrun gives every process ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``;
the train entry sets the same variables for a single process it starts itself
(``run_training.set_single_process_env``). Outside any launch a process is rank 0 of a world of 1.
Every other module asks here; this module imports nothing of the project, so every layer may.
"""

import os


def in_launch() -> bool:
    """True when a launcher (torchrun, or the train entry for one process) has set this process's place."""
    return "RANK" in os.environ


def rank() -> int:
    """This process's rank among all ranks (0 outside a launch)."""
    return int(os.environ.get("RANK", "0"))


def is_rank_zero() -> bool:
    """True on the rank that logs and reports for the run (and outside a launch)."""
    return rank() == 0


def local_rank() -> int:
    """This process's rank among the ranks of its host (its rank where torchrun did not say)."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def world_size() -> int:
    """How many ranks the launch has (1 outside a launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """How many ranks run on this host (the world size where torchrun did not say)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
