"""The small offline corpus and tokenizer that ship with the project.

``TINY_STORIES`` is registered in torchtitan's dataset table on import, so
``--dataloader.dataset tiny_stories`` works like any torchtitan dataset. ``JSONL_TEXT``
(``jsonl``) reads any local folder of ``*.jsonl`` files whose records have a ``text`` field,
given as ``data.path`` (required: the start-up checks refuse ``jsonl`` without one);
torchtitan's own names (``c4``, ...) work as well. Users point to
their own tokenizer folder with ``data.tokenizer`` (docs/quickstart.md, "Your own data").
"""

from pathlib import Path

from datasets import load_dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
TINY_STORIES = "tiny_stories"
TINY_STORIES_DIR = ASSETS_DIR / "tiny_stories"
JSONL_TEXT = "jsonl"


def _load_jsonl_folder(path: str):
    return load_dataset("json", data_files=str(Path(path) / "*.jsonl"), split="train")


DATASETS.setdefault(
    TINY_STORIES,
    DatasetConfig(
        path=str(TINY_STORIES_DIR),
        loader=_load_jsonl_folder,
        sample_processor=lambda sample: sample["text"],
    ),
)

DATASETS.setdefault(
    JSONL_TEXT,
    DatasetConfig(
        path="",
        loader=_load_jsonl_folder,
        sample_processor=lambda sample: sample["text"],
    ),
)
