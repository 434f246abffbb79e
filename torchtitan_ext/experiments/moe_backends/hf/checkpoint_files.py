"""What a Hugging Face checkpoint folder holds, read from its file headers (no weights).

A safetensors file starts with an 8-byte little-endian header length and a JSON header
naming every tensor with its dtype and shape; a sharded checkpoint lists its files in
``model.safetensors.index.json`` (``weight_map``: tensor name -> file). ``checkpoint_tensors``
reads those headers; ``first_mismatch`` compares them with the tensors a model needs.
"""

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointFolderError(ValueError):
    """A checkpoint folder whose tensors cannot be listed; the message says what is missing or broken."""


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of one safetensors file, from its header."""
    try:
        with open(path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size))
        return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except (OSError, struct.error, ValueError, KeyError, TypeError) as e:
        raise CheckpointFolderError(f"{path.name} is not a readable safetensors file ({e})") from None


def checkpoint_tensors(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of every tensor of the checkpoint in ``folder``.

    With an index file every shard it names must be present (the missing ones are listed);
    without one, every ``*.safetensors`` file of the folder is read.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointFolderError(f"{folder} is not a folder")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFolderError(f"{INDEX_FILE} is unreadable ({e})") from None
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise CheckpointFolderError(
                f"{len(missing)} of the {len(shards)} shards {INDEX_FILE} lists are missing: {', '.join(missing)}"
            )
    else:
        shards = sorted(path.name for path in folder.glob("*.safetensors"))
        if not shards:
            raise CheckpointFolderError(f"{folder} holds no *.safetensors file (nor {INDEX_FILE})")
    tensors: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        tensors.update(safetensors_shapes(folder / shard))
    return tensors


def first_mismatch(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    ignored: Callable[[str], bool] = lambda name: False,
) -> str | None:
    """The first tensor whose name or shape differs, as a sentence; None when all match.

    ``expected`` is walked in its order (a tensor missing or of another shape), then
    ``found`` in its order (a tensor the model does not have, unless ``ignored``).
    """

    def shape(dims: tuple[int, ...]) -> str:
        return "[" + ", ".join(map(str, dims)) + "]"

    for name, dims in expected.items():
        if name not in found:
            return f"it has no tensor {name} (shape {shape(dims)})"
        if tuple(found[name]) != tuple(dims):
            return f"its tensor {name} has shape {shape(found[name])}, the model's has {shape(dims)}"
    for name, dims in found.items():
        if name not in expected and not ignored(name):
            return f"it has a tensor {name} (shape {shape(dims)}) that the model does not have"
    return None
