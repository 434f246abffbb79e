"""The small offline corpus and tokenizer that ship with the project, and a corpus without end.

``TINY_STORIES`` is registered in torchtitan's dataset table on import, so
``--dataloader.dataset tiny_stories`` works like any torchtitan dataset. ``JSONL_TEXT``
(``jsonl``) reads any local folder of ``*.jsonl`` files whose records have a ``text`` field,
given as ``data.path`` (required: the start-up checks refuse ``jsonl`` without one);
torchtitan's own names (``c4``, ...) work as well. Users point to
their own tokenizer folder with ``data.tokenizer`` (docs/quickstart.md, "Your own data").

``MARKOV_TEXT`` (``markov_text``) is an endless stream of documents drawn from one fixed random
Markov chain over the words of a ``*.jsonl`` folder (``data.path``, default the shipped corpus): a
model cannot memorise it (no document repeats) and its loss falls towards a known floor, the
chain's entropy (``MarkovChain.entropy_per_word``), so loss curves of long runs compare
implementations rather than how well each memorised a small corpus. The same seed gives the
same stream on every run.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import IterableDataset, load_dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
TINY_STORIES = "tiny_stories"
TINY_STORIES_DIR = ASSETS_DIR / "tiny_stories"
JSONL_TEXT = "jsonl"
MARKOV_TEXT = "markov_text"


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


@dataclass(frozen=True)
class MarkovChain:
    """A first-order chain over ``words``: word ``v`` is followed by ``successor_VS[v, j]`` with
    probability ``probability_VS[v, j]``."""

    words: list[str]
    successor_VS: np.ndarray
    probability_VS: np.ndarray

    VOCABULARY = 2048
    """At most this many words: the folder's most frequent ones"""
    SUCCESSORS = 16
    """Successors per word, each with a Dirichlet(0.5)-drawn probability"""
    DOCUMENT_WORDS = 256

    @classmethod
    def from_folder(cls, path: str, seed: int = 0) -> MarkovChain:
        """The chain over the words of the ``text`` fields of ``path``'s ``*.jsonl`` files."""
        counts = Counter()
        for file in sorted(Path(path).expanduser().glob("*.jsonl")):
            with file.open() as lines:
                counts.update(word for line in lines if line.strip() for word in json.loads(line)["text"].split())
        if not counts:
            raise ValueError(f"{MARKOV_TEXT}: no words in the *.jsonl files of {path!r} (a 'text' field per line)")
        words = [word for word, _ in counts.most_common(cls.VOCABULARY)]
        rng = np.random.default_rng(seed)
        successor_VS = rng.integers(0, len(words), size=(len(words), cls.SUCCESSORS))
        probability_VS = rng.dirichlet(np.full(cls.SUCCESSORS, 0.5), size=len(words))
        return cls(words, successor_VS, probability_VS)

    def entropy_per_word(self) -> float:
        """The chain's entropy rate in nats per word: each word's successor entropy, weighted by
        how often the chain visits the word (its stationary distribution)."""
        transition_VV = np.zeros((len(self.words), len(self.words)))
        np.add.at(transition_VV, (np.arange(len(self.words))[:, None], self.successor_VS), self.probability_VS)
        visits_V = np.full(len(self.words), 1.0 / len(self.words))
        for _ in range(1000):
            visits_V = visits_V @ transition_VV
        logs = np.log(self.probability_VS, where=self.probability_VS > 0, out=np.zeros_like(self.probability_VS))
        return float(visits_V @ -(self.probability_VS * logs).sum(axis=1))

    def documents(self, seed: int = 0, batch: int = 64) -> Iterator[dict[str, str]]:
        """Endless ``{"text": ...}`` records of ``DOCUMENT_WORDS`` words each, drawn ``batch`` at a
        time (each a walk from a uniformly drawn first word)."""
        rng = np.random.default_rng(seed)
        cumulative_VS = np.cumsum(self.probability_VS, axis=1)
        while True:
            word_B = rng.integers(0, len(self.words), size=batch)
            walk_NB = [word_B]
            for _ in range(self.DOCUMENT_WORDS - 1):
                step_B = (cumulative_VS[word_B] < rng.random(batch)[:, None]).sum(axis=1)
                word_B = self.successor_VS[word_B, np.minimum(step_B, self.SUCCESSORS - 1)]
                walk_NB.append(word_B)
            for walk in np.stack(walk_NB, axis=1):
                yield {"text": " ".join(self.words[v] for v in walk)}


def _markov_text(path: str) -> IterableDataset:
    return IterableDataset.from_generator(MarkovChain.from_folder(path).documents)


DATASETS.setdefault(
    MARKOV_TEXT,
    DatasetConfig(path=str(TINY_STORIES_DIR), loader=_markov_text, sample_processor=lambda sample: sample["text"]),
)
