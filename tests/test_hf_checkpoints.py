"""Hugging Face checkpoints in and out of every family's flavor, against transformers (CPU, fp32).

For each family (Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3) transformers builds random models from
the family's tiny flavor config (the published model's flags, scaled down) and from variants
of its flags, and saves them with ``save_pretrained``:

- the project's model, loaded through the flavor's state-dict adapter, gives transformers'
  logits to rel 1e-5 for every compute backend (``triton`` through Triton's interpreter), and
  HF -> project -> HF is bit-exact;
- through torchtitan's Trainer on two gloo processes (FSDP 2 x EP 2, its CheckpointManager
  reading a sharded checkpoint): the same logits for every backend, and a last save in HF format
  that is bit-exact, carries config.json and the tokenizer, and loads in transformers;
- through the train entry: the loss of the first training step equals transformers' loss on
  the same tokens (EP 1 and EP 2);
- bad input is refused before training with one message and exit code 2.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import cpu_tensor_backends, free_port, relative_error, spawn_workers

pytest.importorskip("transformers", reason="the Hugging Face checks compare with transformers (the test extra)")

from hf_models import (
    FAMILY_FLAVORS,
    TOKENS,
    VARIANTS,
    first_step_loss_of_transformers,
    hf_config_variant,
    hf_logits,
    hub_tensors,
    load_project_model,
    project_config,
    random_hf_model,
    save_hub_folder,
    use_backend,
    write_config,
    write_corpus,
)
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM

from torchtitan_ext.config import ConfigError
from torchtitan_ext.experiments.moe_backends.flavors import tiny_hf_config
from torchtitan_ext.experiments.moe_backends.hf.architectures import (
    PUBLISHED,
    UnsupportedArchitecture,
    model_spec_from_hf_config,
    scaled_down,
)
from torchtitan_ext.experiments.moe_backends.hf.torchtitan_features import STAGING_FOLDER, hf_config_of
from torchtitan_ext.run_training import FlavorConfigManager

BACKENDS = cpu_tensor_backends()
"""The backends these CPU-tensor checks run: triton only through Triton's interpreter (set by
conftest.py where there is no CUDA); on GPUs tests/test_hf_checkpoints_gpu.py runs it on CUDA."""
CASES = [(flavor, index) for flavor in FAMILY_FLAVORS for index in range(len(VARIANTS[flavor]))]
TOLERANCE = 1e-5


def case_id(case) -> str:
    flavor, index = case
    return f"{flavor}-{'published' if index == 0 else f'variant{index}'}"


def load_args(flavor: str, folder: Path, *extra: str) -> list[str]:
    """Train-entry arguments loading the Hugging Face checkpoint in ``folder`` into ``flavor``."""
    return [
        "--flavor",
        flavor,
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(folder),
        "--checkpoint.initial_load_in_hf",
        *extra,
    ]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """``hub(flavor, variant)``: (transformers model, its saved folder), made once per module."""
    made = {}

    def make(flavor: str, variant: int = 0, *, sharded: bool = False):
        key = (flavor, variant, sharded)
        if key not in made:
            model = random_hf_model(hf_config_variant(flavor, VARIANTS[flavor][variant]))
            folder = tmp_path_factory.mktemp(f"{flavor}-{variant}{'-sharded' if sharded else ''}")
            made[key] = (model, save_hub_folder(model, folder, max_shard_size="60KB" if sharded else None))
        return made[key]

    return make


# The project's model against transformers', in this process


@pytest.mark.parametrize(
    "backend",
    # The Triton interpreter takes seconds per model on CPU: those cases run with the slow ones.
    [pytest.param(b, marks=pytest.mark.slow) if b == "triton" else b for b in BACKENDS],
)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_logits_equal_transformers(case, backend, hub):
    flavor, variant = case
    hf_model, folder = hub(flavor, variant)
    model = load_project_model(project_config(hf_config_variant(flavor, VARIANTS[flavor][variant]), backend), folder)
    with torch.no_grad():
        logits = model(TOKENS)
    error = relative_error(logits, hf_logits(hf_model))
    assert error < TOLERANCE, f"{case_id(case)} {backend}: rel error {error:.2e}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_hf_to_project_to_hf_is_bit_exact(case, hub):
    flavor, variant = case
    _, folder = hub(flavor, variant)
    config = project_config(hf_config_variant(flavor, VARIANTS[flavor][variant]), "for_loop")
    model = load_project_model(config, folder)
    spec = config.model_spec
    assert spec is not None and spec.state_dict_adapter is not None
    adapter = spec.state_dict_adapter(spec.model, None)
    saved, original = adapter.to_hf(model.state_dict()), hub_tensors(folder)
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name


def test_stock_torchtitan_moe_loads_and_computes_within_bf16(hub):
    """``olmoe-1b-7b-torchtitan-moe``'s layers (torchtitan's own MoE) load the same checkpoints;
    their experts compute in bf16, so the logits agree to bf16 accuracy only."""
    hf_model, folder = hub("tiny-olmoe")
    model = load_project_model(project_config(tiny_hf_config("tiny-olmoe"), None), folder)
    with torch.no_grad():
        error = relative_error(model(TOKENS), hf_logits(hf_model))
    assert 1e-5 < error < 2e-2, error


def test_full_size_flavors_carry_the_published_configs():
    from torchtitan_ext.registry import get_flavor

    published = {
        "qwen3-30b-a3b": "Qwen3-30B-A3B",
        "qwen3-30b-a3b-torchtitan-moe": "Qwen3-30B-A3B",
        "olmoe-1b-7b": "OLMoE-1B-7B-0924",
        "olmoe-1b-7b-torchtitan-moe": "OLMoE-1B-7B-0924",
        "mixtral-8x7b": "Mixtral-8x7B-v0.1",
        "deepseek-v3-16b": "Moonlight-16B-A3B",
        "deepseek-v3-16b-torchtitan-moe": "Moonlight-16B-A3B",
    }
    for flavor, name in published.items():
        assert hf_config_of(get_flavor(flavor).build()) == PUBLISHED[name], flavor


# torchtitan's Trainer: CheckpointManager, FSDP x EP on two gloo processes (CUDA hidden from them,
# so they run on CPU on any machine, as the transformers references they are compared with)


def trainer_worker(rank: int, world: int, port: int, args: list[str], out: str) -> None:
    """Build torchtitan's Trainer from the train entry's config, load the HF checkpoint, write the
    logits of ``TOKENS`` for every backend, and save the model in HF format as a last step."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    trainer = FlavorConfigManager().parse_args(args).build()
    try:
        trainer.checkpointer.load()
        model = trainer.model_parts[0].eval()
        model._skip_lm_head = False  # the chunked loss applies lm_head in training; here we want logits
        logits = {}
        for backend in BACKENDS:
            use_backend(model, backend)
            with torch.no_grad():
                logits[backend] = model(TOKENS)
        torch.save(logits, Path(out) / f"logits-{rank}.pt")
        trainer.checkpointer.save(curr_step=1, last_step=True)
    finally:
        trainer.close()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("flavor", FAMILY_FLAVORS)
def test_trainer_loads_and_saves_hf_under_fsdp_and_ep2(flavor, hub, tmp_path, monkeypatch):
    hf_model, folder = hub(flavor, sharded=True)
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    args = [
        *load_args(flavor, folder),
        "--hf_assets_path",
        str(folder),
        "--checkpoint.last_save_in_hf",
        "--checkpoint.last_save_model_only",
        "--parallelism.expert_parallel_degree",
        "2",
        "--training.seq_len",
        "32",
        "--dump_folder",
        str(tmp_path),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the workers inherit it before they import torch
    spawn_workers(trainer_worker, 2, 2, free_port(), args, str(tmp_path))
    expected = hf_logits(hf_model)
    for rank in range(2):
        for backend, logits in torch.load(tmp_path / f"logits-{rank}.pt").items():
            error = relative_error(logits, expected)
            assert error < TOLERANCE, f"rank {rank} {backend}: rel error {error:.2e}"
    saved = tmp_path / "checkpoint" / "step-1"
    original, written = hub_tensors(folder), hub_tensors(saved)
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[name], tensor) for name, tensor in original.items())
    assert not (saved / STAGING_FOLDER).exists()
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= {p.name for p in saved.iterdir()}
    reloaded = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    assert torch.equal(hf_logits(reloaded), expected)


# The train entry: the first step's loss


@pytest.mark.slow
@pytest.mark.parametrize("flavor,world", [*((flavor, 1) for flavor in FAMILY_FLAVORS), ("tiny-olmoe", 2)], ids=str)
def test_first_training_step_loss_equals_transformers(flavor, world, hub, tmp_path):
    hf_model, folder = hub(flavor)
    args = [
        "--flavor",
        flavor,
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--hf_assets_path",
        str(folder),
        "--data.dataset",
        "jsonl",
        "--data.path",
        str(write_corpus(tmp_path / "corpus")),
        "--training.steps",
        "1",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--parallelism.expert_parallel_degree",
        str(world),
        "--dump_folder",
        str(tmp_path / "out"),
        "--metrics.disable_color_printing",
    ]
    launcher = [f"--nproc_per_node={world}"] if world > 1 else []
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", *launcher, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    (loss,) = [float(v) for v in re.findall(r"step:\s+1\s+loss:\s+([0-9.]+)", log)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORLD_SIZE", str(world))  # the dataloader split the run used
        expected = first_step_loss_of_transformers(hf_model, args, world)
    assert loss == pytest.approx(expected, abs=2e-5), (loss, expected)


# Bad input: one message, before training


def refusal(args: list[str]) -> str:
    with pytest.raises(ConfigError) as raised:
        FlavorConfigManager().parse_args(args)
    return str(raised.value)


def test_loads_into_the_matching_flavor_pass_the_checks(hub):
    for flavor in FAMILY_FLAVORS:
        _, folder = hub(flavor, sharded=True)
        FlavorConfigManager().parse_args(load_args(flavor, folder, "--hf_assets_path", str(folder)))


def test_a_checkpoint_of_another_architecture_names_the_first_mismatching_tensor(hub):
    _, olmoe = hub("tiny-olmoe")
    message = refusal(load_args("tiny-qwen3-moe", olmoe))
    assert "its tensor model.layers.0.self_attn.k_proj.weight has shape [64, 64], the model's has [32, 64]" in message
    assert "describes a 'olmoe' model" in message


def test_a_checkpoint_of_another_size_names_the_first_mismatching_tensor(tmp_path):
    deeper = save_hub_folder(random_hf_model({**tiny_hf_config("tiny-mixtral"), "num_hidden_layers": 3}), tmp_path)
    message = refusal(load_args("tiny-mixtral", deeper))
    assert re.search(
        r"it has a tensor model\.layers\.2\.\S+ \(shape \[\d+(, \d+)*\]\) that the model does not have", message
    )


def test_a_checkpoint_with_other_flags_names_the_flag(tmp_path):
    folder = save_hub_folder(random_hf_model(tiny_hf_config("tiny-qwen3-moe")), tmp_path)
    write_config(folder, norm_topk_prob=False)
    assert "its config.json has norm_topk_prob = False, the flavor's model True" in refusal(
        load_args("tiny-qwen3-moe", folder)
    )


def test_missing_shards_are_named(hub, tmp_path):
    _, folder = hub("tiny-olmoe", sharded=True)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    shards = sorted(folder.glob("model-*.safetensors"))
    for path in folder.iterdir():
        if path != shards[1]:
            (damaged / path.name).write_bytes(path.read_bytes())
    message = refusal(load_args("tiny-olmoe", damaged))
    assert f"1 of the {len(shards)} shards model.safetensors.index.json lists are missing: {shards[1].name}" in message


def test_a_folder_without_weights_is_refused(tmp_path):
    assert "holds no *.safetensors file" in refusal(load_args("tiny-olmoe", tmp_path))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(hub, tmp_path):
    _, folder = hub("tiny-olmoe")
    big = Tokenizer(WordLevel({f"t{i}": i for i in range(700)}, unk_token="t0"))
    big.save(str(tmp_path / "tokenizer.json"))
    message = refusal(load_args("tiny-olmoe", folder, "--hf_assets_path", str(tmp_path)))
    assert "the tokenizer has 700 tokens but this flavor's model has a vocabulary of 640" in message


def test_switches_that_torchtitan_would_ignore_or_assert_on_are_refused(hub):
    _, folder = hub("tiny-qwen3-moe")
    without_enable = load_args("tiny-qwen3-moe", folder)[:2] + load_args("tiny-qwen3-moe", folder)[3:]
    assert "needs checkpoint.enable" in refusal(without_enable)
    message = refusal(["--flavor", "tiny-qwen3-moe", "--checkpoint.enable", "--checkpoint.last_save_in_hf"])
    assert "last_save_in_hf requires last_save_model_only=True" in message  # torchtitan's own check


def test_router_biases_that_hf_cannot_hold_are_refused(hub):
    save = ["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only"]
    message = refusal(["--flavor", "tiny-qwen3-moe", *save, "--moe.load_balance_coeff", "0.001"])
    assert "gives the router a bias that a Qwen3MoeForCausalLM checkpoint cannot hold" in message
    message = refusal(["--flavor", "tiny-deepseek-v3", *save, "--moe.load_balance_coeff", "0"])
    assert "adds e_score_correction_bias" in message


def test_a_refusal_exits_2_from_the_train_entry(hub):
    _, olmoe = hub("tiny-olmoe")
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", *load_args("tiny-mixtral", olmoe)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "does not hold this flavor's model" in line


@pytest.mark.parametrize(
    "published,flags,reason",
    [
        ("Qwen3-30B-A3B", dict(use_sliding_window=True), "use_sliding_window = true"),
        ("Qwen3-30B-A3B", dict(rope_scaling=dict(type="yarn", factor=4.0)), "RoPE scaling 'yarn'"),
        ("Qwen3-30B-A3B", dict(model_type="qwen2_moe"), "model_type 'qwen2_moe' is not supported"),
        ("OLMoE-1B-7B-0924", dict(clip_qkv=8.0), "clip_qkv = 8.0"),
        ("Mixtral-8x7B-v0.1", dict(sliding_window=4096), "sliding_window = 4096"),
        ("Mixtral-8x7B-v0.1", dict(router_jitter_noise=0.1), "router_jitter_noise = 0.1"),
        ("Mixtral-8x7B-v0.1", dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
        ("Moonlight-16B-A3B", dict(tie_word_embeddings=True), "tie_word_embeddings = true"),
        (
            "Moonlight-16B-A3B",
            dict(rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096)),
            "YaRN with attention factor 1.36889",
        ),
    ],
)
def test_flags_that_cannot_be_computed_are_refused(published, flags, reason):
    with pytest.raises(UnsupportedArchitecture, match=re.escape(reason)):
        model_spec_from_hf_config("refused", {**PUBLISHED[published], **flags}, compute_backend="for_loop")


def test_scaled_down_keeps_the_flags_and_refuses_unknown_sizes():
    small = scaled_down({**PUBLISHED["Qwen3-30B-A3B"], "mlp_only_layers": [0, 5]}, num_hidden_layers=2)
    assert small["mlp_only_layers"] == [0] and small["norm_topk_prob"] is True and small["rope_theta"] == 1e6
    with pytest.raises(UnsupportedArchitecture, match="hidden_sise"):
        scaled_down(PUBLISHED["Qwen3-30B-A3B"], hidden_sise=64)
    assert math.isclose(tiny_hf_config("tiny-deepseek-v3")["routed_scaling_factor"], 2.446)
