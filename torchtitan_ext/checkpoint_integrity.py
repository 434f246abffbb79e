"""Checkpoints that are verified before they are loaded.

``IntegrityCheckpointManager`` is torchtitan's DCP ``CheckpointManager`` plus a manifest
(``integrity.json``) in every step folder: the size and sha256 of each file, written
atomically once torchtitan's save has completed. Before a resume the step folder is
checked against it, and a missing, truncated or altered file, a missing or unreadable
manifest, or a step folder that does not exist ends the run with a
``CheckpointIntegrityError`` naming the folder and the problem (exit code 2 from
``torchtitan_ext.train``). A run starts fresh while step folders exist only when
``checkpoint.start_fresh`` asks for it, with a logged warning; a checkpoint saved without
a manifest loads only with ``checkpoint.allow_unverified``, with a logged warning.

Hashing and verification are split across ranks (rank ``r`` takes every ``world``-th
file) and the results are exchanged with ``all_gather_object``, so every rank reaches the
same verdict. Checkpoint folders must be local paths.
"""

import hashlib
import json
import os
import re
from dataclasses import dataclass

import torch.distributed as dist
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError

MANIFEST_NAME = "integrity.json"
MANIFEST_FORMAT = 1
STEP_FOLDER = re.compile(r"step-(\d+)")
HASH_CHUNK_BYTES = 8 << 20


class CheckpointIntegrityError(ConfigError):
    """A checkpoint that must not be loaded; the message names the step folder and why.

    A ``ConfigError``, so the train entry prints it and exits with code 2.
    """


def file_record(path: str) -> dict:
    """``{"size": bytes, "sha256": hex digest}`` of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def checkpoint_files(checkpoint_dir: str) -> list[str]:
    """Sorted paths, relative to ``checkpoint_dir``, of every file under it but the manifest."""
    files = []
    for root, _, names in os.walk(checkpoint_dir):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), checkpoint_dir)
            if relative != MANIFEST_NAME:
                files.append(relative)
    return sorted(files)


def step_numbers(folder: str) -> list[int]:
    """Sorted steps of the ``step-N`` folders in ``folder``, damaged or not."""
    if not os.path.isdir(folder):
        return []
    return sorted(
        int(match.group(1))
        for name in os.listdir(folder)
        if (match := STEP_FOLDER.fullmatch(name)) and os.path.isdir(os.path.join(folder, name))
    )


def steps_present(folder: str) -> str:
    """``steps present in FOLDER: 2, 4`` (or that it holds none), FOLDER absolute: how messages list them."""
    steps = step_numbers(folder)
    where = os.path.abspath(folder)
    if not steps:
        return f"{where} holds no step folders"
    return f"steps present in {where}: {', '.join(str(step) for step in steps)}"


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gathered(local: dict) -> dict:
    """Union of every rank's ``local`` dict (``local`` itself without a process group)."""
    _, world = _rank_and_world()
    if world == 1:
        return local
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local)
    return {key: value for part in gathered for key, value in part.items()}


def write_manifest(checkpoint_dir: str, step: int) -> None:
    """Record size and sha256 of every file of a completed save (all ranks call this).

    Each rank hashes its share of the files; rank 0 writes the manifest to a temporary
    file and renames it into place, so a manifest is either complete or absent.
    """
    rank, world = _rank_and_world()
    files = checkpoint_files(checkpoint_dir)
    records = _gathered({name: file_record(os.path.join(checkpoint_dir, name)) for name in files[rank::world]})
    if rank != 0:
        return
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": dict(sorted(records.items()))}
    temporary = os.path.join(checkpoint_dir, f".{MANIFEST_NAME}.tmp")
    with open(temporary, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(checkpoint_dir, MANIFEST_NAME))


def read_manifest(checkpoint_dir: str) -> dict[str, dict] | None:
    """The manifest's ``{file: {"size", "sha256"}}``; None when there is no manifest.

    Raises ``CheckpointIntegrityError`` for a manifest that cannot be read or parsed.
    """
    path = os.path.join(checkpoint_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest["format"] != MANIFEST_FORMAT or not all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
            for r in files.values()
        ):
            raise ValueError("unexpected layout")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointIntegrityError(
            f"checkpoint {checkpoint_dir}: its manifest {MANIFEST_NAME} is unreadable ({e})"
        ) from None
    return files


def file_problem(checkpoint_dir: str, name: str, expected: dict) -> str | None:
    """What is wrong with file ``name`` compared with its manifest record; None if intact."""
    path = os.path.join(checkpoint_dir, name)
    if not os.path.isfile(path):
        return f"{name}: missing"
    size = os.path.getsize(path)
    if size != expected["size"]:
        return f"{name}: size {size} bytes, {expected['size']} when saved (truncated or overwritten)"
    if file_record(path)["sha256"] != expected["sha256"]:
        return f"{name}: sha256 differs from the one recorded at save (contents changed)"
    return None


def verify_checkpoint(checkpoint_dir: str, allow_unverified: bool = False) -> bool:
    """True when ``checkpoint_dir`` matches its manifest; else raise ``CheckpointIntegrityError``.

    Every rank of a process group must call this; each checks its share of the files.
    Without a manifest the checkpoint is refused, or, with ``allow_unverified``, accepted
    with a warning when its DCP ``.metadata`` is present (returns False).
    """
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointIntegrityError(f"checkpoint {checkpoint_dir}: the step folder does not exist")
    expected = read_manifest(checkpoint_dir)
    if expected is None:
        present = checkpoint_files(checkpoint_dir)
        if allow_unverified and ".metadata" in present:
            logger.warning(
                f"checkpoint {checkpoint_dir} has no {MANIFEST_NAME}: loading it UNVERIFIED "
                "because checkpoint.allow_unverified is set"
            )
            return False
        contents = f"files: {', '.join(present)}" if present else "the folder is empty"
        raise CheckpointIntegrityError(
            f"checkpoint {checkpoint_dir}: no {MANIFEST_NAME} ({contents}); the save did not "
            "complete, or the checkpoint predates integrity checks (to load such a checkpoint "
            "anyway, set checkpoint.allow_unverified)"
        )
    rank, world = _rank_and_world()
    names = sorted(expected)[rank::world]
    problems = _gathered(
        {name: problem for name in names if (problem := file_problem(checkpoint_dir, name, expected[name]))}
    )
    if problems:
        raise CheckpointIntegrityError(
            f"checkpoint {checkpoint_dir} is damaged: " + "; ".join(problems[name] for name in sorted(problems))
        )
    unlisted = sorted(set(checkpoint_files(checkpoint_dir)) - set(expected))
    if unlisted and rank == 0:
        logger.warning(f"checkpoint {checkpoint_dir}: files not in its manifest are ignored: {', '.join(unlisted)}")
    return True


class IntegrityCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose step folders carry a verified manifest.

    Resuming (``checkpoint.load_step``, or the highest ``step-N`` folder when it is -1,
    whether or not torchtitan would consider that folder valid) verifies the folder first
    and raises ``CheckpointIntegrityError`` when it is damaged. Async saves get their
    manifest when torchtitan waits for them (before the next save or the last one).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        start_fresh: bool = False
        """Start at step 1 although checkpoint.folder holds step folders (logged; same-numbered saves replace them)."""

        allow_unverified: bool = False
        """Load a checkpoint that has no integrity manifest (saved without one), with a warning."""

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        if filesystem.is_remote(self.folder):
            raise CheckpointIntegrityError(
                f"checkpoint.folder {self.folder}: integrity-checked checkpoints need a local folder"
            )
        self.start_fresh = config.start_fresh
        self.allow_unverified = config.allow_unverified
        self.unsealed_step: int | None = None

    def _find_load_step(self, folder: str = "") -> int:
        """Highest ``step-N`` folder, damaged or not; -1 when none or ``start_fresh``."""
        steps = step_numbers(folder or self.folder)
        if not steps or self.start_fresh:
            return -1
        return steps[-1]

    def _load(self, step: int = -1) -> bool:
        chosen = step != -1
        if not chosen:
            existing = step_numbers(self.folder)
            if existing and self.start_fresh:
                logger.warning(
                    f"checkpoint.start_fresh: starting at step 1 without loading the step folders "
                    f"{existing} in {self.folder}; saves at the same steps replace them"
                )
            step = self._find_load_step()
        if step == -1:
            return super()._load(-1)
        checkpoint_dir = self._create_checkpoint_id(step)
        try:
            verified = verify_checkpoint(checkpoint_dir, self.allow_unverified)
        except CheckpointIntegrityError as e:
            previous = "" if chosen else "move it away to resume from the previous step folder, "
            raise CheckpointIntegrityError(
                f"{e}. Cannot resume from it: {previous}pass --checkpoint.load_step with an intact step "
                f"({steps_present(self.folder)}), or start at step 1 deliberately with "
                "--checkpoint.start_fresh or another --checkpoint.folder"
            ) from None
        if verified:
            logger.info(f"checkpoint {checkpoint_dir}: every file matches {MANIFEST_NAME}")
        return super()._load(step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        if saved:
            if last_step or self.async_mode == AsyncMode.DISABLED:
                write_manifest(self._create_checkpoint_id(curr_step), curr_step)
            else:
                self.unsealed_step = curr_step
        return saved

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()
        if self.unsealed_step is not None:
            write_manifest(self._create_checkpoint_id(self.unsealed_step), self.unsealed_step)
            self.unsealed_step = None
