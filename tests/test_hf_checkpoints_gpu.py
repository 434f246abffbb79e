"""Hugging Face checkpoints on CUDA: every family in bf16 against transformers in bf16, and a
real-size OLMoE-1B-7B-shaped random checkpoint loaded and trained 10 steps with FSDP 2 x EP 2.

The bf16 criterion: the project's model with bf16 parameters (fp32 buffers, as FSDP's mixed
precision computes) and transformers' model in bf16 are both compared with transformers in fp32
on the same weights; the project's error may not exceed twice transformers' own bf16 error (plus
a floor of 2^-9 for sums rounded in another order). Skipped without CUDA (the training run:
without 2 GPUs).
"""

import math
import re
import subprocess
import sys

import pytest
import torch
from helpers import relative_error

pytest.importorskip("transformers", reason="the Hugging Face checks compare with transformers (the test extra)")

from hf_models import (
    FAMILY_FLAVORS,
    TOKENS,
    first_step_loss_of_transformers,
    hf_logits,
    load_project_model,
    project_config,
    random_hf_model,
    save_hub_folder,
    write_corpus,
)
from transformers import AutoModelForCausalLM

from torchtitan_ext.experiments.moe_backends.flavors import tiny_hf_config
from torchtitan_ext.experiments.moe_backends.hf.architectures import PUBLISHED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("backend", ["grouped_mm", "triton", "for_loop"])
@pytest.mark.parametrize("flavor", FAMILY_FLAVORS)
def test_bf16_logits_as_accurate_as_transformers(flavor, backend, tmp_path):
    hf_model = random_hf_model(tiny_hf_config(flavor))
    folder = save_hub_folder(hf_model, tmp_path)
    hf_model = hf_model.cuda()
    reference = hf_logits(hf_model)
    hf_error = relative_error(hf_logits(hf_model.to(torch.bfloat16)), reference)
    model = load_project_model(project_config(tiny_hf_config(flavor), backend), folder, device="cuda")
    for parameter in model.parameters():  # bf16 parameters, fp32 buffers: FSDP's mixed precision
        parameter.data = parameter.data.to(torch.bfloat16)
    with torch.no_grad():
        error = relative_error(model(TOKENS.cuda()), reference)
    assert error <= 2 * hf_error + 2**-9, (error, hf_error)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_real_size_olmoe_checkpoint_trains_10_steps_with_fsdp2_ep2(tmp_path):
    """transformers makes a random OLMoE-1B-7B-0924-shaped model (bf16, sharded safetensors);
    the olmoe-1b-7b flavor loads it on 2 GPUs (FSDP 2 x EP 2, triton experts), its first loss
    agrees with transformers' in bf16, it trains 10 steps and saves a model transformers loads."""
    hf_model = random_hf_model(PUBLISHED["OLMoE-1B-7B-0924"], dtype=torch.bfloat16)
    folder = save_hub_folder(hf_model, tmp_path / "hub", max_shard_size="2GB")
    args = [
        "--flavor",
        "olmoe-1b-7b",
        "--moe.compute_backend",
        "triton",
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--hf_assets_path",
        str(folder),
        "--checkpoint.last_save_in_hf",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
        "--data.dataset",
        "jsonl",
        "--data.path",
        str(write_corpus(tmp_path / "corpus", records=4, stories_per_record=60)),
        "--parallelism.expert_parallel_degree",
        "2",
        "--training.steps",
        "10",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "2048",
        "--dump_folder",
        str(tmp_path / "out"),
        "--metrics.disable_color_printing",
        "--metrics.log_freq",
        "1",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", "--nproc_per_node=2", *args],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    losses = [float(v) for v in re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", log)]
    assert len(losses) == 10 and all(map(math.isfinite, losses)) and min(losses[1:]) < losses[0], losses
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")  # the dataloader split the run used
        expected = first_step_loss_of_transformers(hf_model.cuda(), args, world=2)
    assert losses[0] == pytest.approx(expected, rel=2e-2), (losses[0], expected)
    saved = tmp_path / "out" / "checkpoint" / "step-10"
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in hf_model.parameters())
