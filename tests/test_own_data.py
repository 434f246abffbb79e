"""Training on a user's own JSONL folder and tokenizer, as docs/configuration.md shows."""

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchtitan_ext.data import TINY_STORIES_DIR, TOKENIZER_DIR
from torchtitan_ext.validation import tokenizer_vocabulary_errors

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_data.toml"


def own_data_toml(tmp_path, corpus: Path | None) -> Path:
    """The documented example with its two placeholder folders pointed at real ones."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER_DIR, tokenizer)
    text = EXAMPLE.read_text().replace("/models/my_tokenizer", str(tokenizer))
    if corpus is None:
        text = text.replace('path = "/data/my_corpus"\n', "")
    else:
        text = text.replace("/data/my_corpus", str(corpus))
    toml = tmp_path / "own_data.toml"
    toml.write_text(text)
    return toml


def train(toml: Path, dump_folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_ext.train",
            "--flavor",
            "tiny-moe-grouped-mm",
            "--toml",
            str(toml),
            "--training.steps",
            "2",
            "--training.local_batch_size",
            "2",
            "--training.seq_len",
            "32",
            "--dump_folder",
            str(dump_folder),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CPU/gloo training run (GPU runs: scripts/measure_on_gpu.sh train-tiny)"
)
def test_documented_example_trains_on_own_jsonl_folder(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = (TINY_STORIES_DIR / "train.jsonl").read_text().splitlines()[:200]
    (corpus / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    result = train(own_data_toml(tmp_path, corpus), tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step:  2" in result.stdout + result.stderr


def test_jsonl_dataset_without_a_path_is_refused(tmp_path):
    result = train(own_data_toml(tmp_path, corpus=None), tmp_path / "out")
    assert result.returncode == 2
    assert "'jsonl' needs" in result.stderr and "a folder of *.jsonl files" in result.stderr


def test_the_example_as_shipped_names_its_placeholders_as_written(tmp_path):
    """Its placeholder folders do not exist: one error, naming the short keys the file writes with their
    lines, and no log line before it (torchtitan's own warning of a missing tokenizer folder)."""
    lines = EXAMPLE.read_text().splitlines()
    path_line, tokenizer_line = (
        lines.index(line) + 1 for line in ('path = "/data/my_corpus"', 'tokenizer = "/models/my_tokenizer"')
    )
    result = train(EXAMPLE, tmp_path / "out")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(
        f"error: {EXAMPLE}:{path_line}: data.path = '/data/my_corpus': no such file or folder\n"
        f"{EXAMPLE}:{tokenizer_line}: data.tokenizer = '/models/my_tokenizer': no such folder"
    ), result.stderr


def test_tokenizer_larger_than_the_model_vocabulary_is_refused():
    small_model = SimpleNamespace(model_spec=SimpleNamespace(model=SimpleNamespace(vocab_size=10)))
    errors = tokenizer_vocabulary_errors(TOKENIZER_DIR, "data.tokenizer", small_model)
    assert len(errors) == 1 and "vocabulary of 10" in errors[0]
    fitting_model = SimpleNamespace(model_spec=SimpleNamespace(model=SimpleNamespace(vocab_size=10**6)))
    assert tokenizer_vocabulary_errors(TOKENIZER_DIR, "data.tokenizer", fitting_model) == []
