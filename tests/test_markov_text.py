"""The endless synthetic corpus (``markov_text``): the same stream for the same seed, documents that
never repeat, words and transitions of its chain only, split across data-parallel ranks, and a
training run on it."""

import itertools
import math

import numpy as np
import pytest
import torch
from datasets.distributed import split_dataset_by_node
from test_own_data import train
from torchtitan.hf_datasets.text_datasets import DATASETS

from torchtitan_ext.data import MARKOV_TEXT, TINY_STORIES_DIR, MarkovChain


@pytest.fixture(scope="module")
def chain() -> MarkovChain:
    return MarkovChain.from_folder(str(TINY_STORIES_DIR))


def test_the_same_seed_gives_the_same_stream_and_another_seed_another(chain):
    first = list(itertools.islice(chain.documents(seed=0), 70))
    assert first == list(itertools.islice(chain.documents(seed=0), 70))
    assert first != list(itertools.islice(chain.documents(seed=1), 70))
    assert MarkovChain.from_folder(str(TINY_STORIES_DIR)).successor_VS.tolist() == chain.successor_VS.tolist()


def test_documents_walk_the_chain_and_do_not_repeat(chain):
    """More words than the source corpus holds, every document distinct, every step a transition of
    the chain."""
    corpus_words = sum(len(line.split()) for line in (TINY_STORIES_DIR / "train.jsonl").read_text().splitlines())
    count = corpus_words // MarkovChain.DOCUMENT_WORDS + 64
    documents = [record["text"] for record in itertools.islice(chain.documents(), count)]
    assert len(set(documents)) == count
    index = {word: v for v, word in enumerate(chain.words)}
    allowed = {(v, int(s)) for v in range(len(chain.words)) for s in chain.successor_VS[v]}
    for text in documents[:50]:
        walk = [index[word] for word in text.split()]
        assert len(walk) == MarkovChain.DOCUMENT_WORDS
        assert all(step in allowed for step in itertools.pairwise(walk))


def test_entropy_per_word_is_the_empirical_rate_of_the_stream(chain):
    """The entropy rate matches the average surprise of the words the stream draws."""
    index = {word: v for v, word in enumerate(chain.words)}
    surprise, steps = 0.0, 0
    for record in itertools.islice(chain.documents(seed=3), 400):
        walk = [index[word] for word in record["text"].split()]
        for previous, word in itertools.pairwise(walk):
            probability = chain.probability_VS[previous][chain.successor_VS[previous] == word].sum()
            surprise -= math.log(probability)
            steps += 1
    rate = chain.entropy_per_word()
    assert 0 < rate < math.log(MarkovChain.SUCCESSORS)
    assert surprise / steps == pytest.approx(rate, rel=0.03)


def test_data_parallel_ranks_share_one_stream_without_overlap():
    dataset = DATASETS[MARKOV_TEXT].loader(DATASETS[MARKOV_TEXT].path)
    ranks = [list(itertools.islice(iter(split_dataset_by_node(dataset, rank, 2)), 4)) for rank in range(2)]
    whole = list(itertools.islice(iter(dataset), 8))
    assert ranks[0] == whole[0::2] and ranks[1] == whole[1::2]


def test_a_folder_without_words_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="markov_text: no words"):
        MarkovChain.from_folder(str(tmp_path))


def test_probabilities_are_distributions(chain):
    assert np.allclose(chain.probability_VS.sum(axis=1), 1.0)
    assert chain.successor_VS.shape == (len(chain.words), MarkovChain.SUCCESSORS)


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CPU/gloo training run (GPU runs: scripts/measure_on_gpu.sh train-numerics)"
)
def test_a_tiny_flavor_trains_on_the_endless_corpus(tmp_path):
    toml = tmp_path / "markov.toml"
    toml.write_text(f'[data]\ndataset = "{MARKOV_TEXT}"\n')
    result = train(toml, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step:  2" in result.stdout + result.stderr
    assert f"Preparing {MARKOV_TEXT} dataset" in result.stdout + result.stderr


def test_the_documented_entropy_floor(chain):
    """docs/configuration.md states the shipped chain's entropy: 2.11 nats per word."""
    assert round(chain.entropy_per_word(), 2) == 2.11
    assert len(chain.words) == 208


def test_a_resumed_stream_continues_where_its_state_was_saved():
    """torchtitan checkpoints a streamed dataset's ``state_dict``; loading it resumes the same stream."""
    dataset = DATASETS[MARKOV_TEXT].loader(DATASETS[MARKOV_TEXT].path)
    stream = split_dataset_by_node(dataset, 0, 2)
    documents = iter(stream)
    for _ in range(3):
        next(documents)
    state = stream.state_dict()
    following = next(documents)
    resumed = split_dataset_by_node(DATASETS[MARKOV_TEXT].loader(DATASETS[MARKOV_TEXT].path), 0, 2)
    resumed.load_state_dict(state)
    assert next(iter(resumed)) == following
