"""Routed experts outside FSDP where each expert lives on one rank (``moe.experts_fsdp = "auto"``).

Which layouts leave them out; on 2 CPU processes (gloo, FSDP 2 x EP 2) the built Trainer's expert
weights are EP's DTensors (mesh ``("ep",)``) with ``auto`` and FSDP's (``efsdp`` in the mesh) with
``always``; both train the same losses, and a checkpoint written with either resumes with the other.
"""

import ast
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from helpers import free_port, spawn_workers
from torch.distributed.tensor import DTensor
from torchtitan.models.qwen3 import parallelize_qwen3

from torchtitan_ext.experiments.moe_backends import parallelize as parallelize_module
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts
from torchtitan_ext.experiments.moe_backends.parallelize import experts_outside_fsdp_reason
from torchtitan_ext.run_training import FlavorConfigManager


def layout(*, dp_shard=2, ep=2, cp=1, tp=1, dp_replicate=1, cpu_offload=False, spmd_backend="partial_dtensor"):
    parallel_dims = SimpleNamespace(dp_shard=dp_shard, ep=ep, cp=cp, tp=tp, dp_replicate=dp_replicate)
    training = SimpleNamespace(enable_cpu_offload=cpu_offload)
    return dict(parallel_dims=parallel_dims, training=training, parallelism=SimpleNamespace(spmd_backend=spmd_backend))


@pytest.mark.parametrize(
    "arguments, outside",
    [
        (dict(), True),  # FSDP 2 x EP 2
        (dict(dp_shard=4, ep=4), True),
        (dict(dp_shard=2, cp=2, ep=4), True),
        (dict(dp_shard=4, ep=2), False),  # each expert on 2 ranks: FSDP shards it
        (dict(ep=1), False),
        (dict(dp_replicate=2), False),  # its replicas all-reduce through FSDP
        (dict(cpu_offload=True), False),
        (dict(spmd_backend="spmd_types"), False),
    ],
)
def test_the_experts_stay_out_of_fsdp_only_where_each_lives_on_one_rank(arguments, outside):
    reason = experts_outside_fsdp_reason(**layout(**arguments))
    assert (reason is not None) == outside
    assert reason is None or ("efsdp" in reason and "= 1" in reason)


def _keywords_of_call(function, callee: str) -> set[str]:
    """The keyword names of the one call of ``callee`` in ``function``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    (call,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == callee
    ]
    return {keyword.arg for keyword in call.keywords if keyword.arg is not None}


def test_the_fsdp_step_is_torchtitans_own_call_but_the_layouts_it_refuses():
    """``_fsdp_of_decoder`` repeats ``parallelize_qwen3``'s ``apply_fsdp_to_decoder`` call; a torchtitan
    that passes something new there, or whose ``parallelize_qwen3`` stops taking ``skip_dp``, fails here."""
    assert "skip_dp" in inspect.signature(parallelize_qwen3).parameters
    torchtitans = _keywords_of_call(parallelize_qwen3, "apply_fsdp_to_decoder")
    ours = _keywords_of_call(parallelize_module._fsdp_of_decoder, "apply_fsdp_to_decoder")
    # CPU offload and the full_dtensor / spmd_types mesh dims: experts_outside_fsdp_reason refuses those layouts.
    assert torchtitans - ours == {"cpu_offload", "dp_mesh_dims", "edp_mesh_dims"}
    assert ours <= torchtitans


def test_the_choice_is_checked_and_the_short_key_sets_every_layer():
    config = FlavorConfigManager().parse_args(["--flavor", "tiny-moe-grouped-mm", "--moe.experts_fsdp", "always"])
    experts = [e for _, e, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)]
    assert experts and {e.fsdp for e in experts} == {"always"}
    experts[0].fsdp = "never"
    assert any("fsdp = 'never'" in error and "auto, always" in error for error in experts[0].validation_errors())


def _expert_meshes(rank: int, port: int, choice: str, out_path: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    args = ["--flavor", "tiny-moe-grouped-mm", "--parallelism.expert_parallel_degree", "2"]
    trainer = FlavorConfigManager().parse_args([*args, "--moe.experts_fsdp", choice]).build()
    try:
        meshes = {
            name: param.device_mesh.mesh_dim_names
            for model in trainer.model_parts
            for name, param in model.named_parameters()
            if isinstance(param, DTensor)
        }
        if rank == 0:
            with open(out_path, "w") as out:
                json.dump(meshes, out)
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["auto", "always"])
def test_the_built_trainers_expert_weights_are_eps_or_fsdps(choice, tmp_path):
    out_path = tmp_path / "meshes.json"
    spawn_workers(_expert_meshes, 2, free_port(), choice, str(out_path))
    meshes = {name: tuple(dims) for name, dims in json.loads(out_path.read_text()).items()}
    experts = {name: dims for name, dims in meshes.items() if "inner_experts" in name}
    others = {name: dims for name, dims in meshes.items() if "inner_experts" not in name}
    assert experts and others
    assert all(dims == ("fsdp",) for dims in others.values()), others
    expected = ("ep",) if choice == "auto" else ("efsdp", "ep")
    assert all(dims == expected for dims in experts.values()), experts


STEP_LOSS = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
OUTSIDE_FSDP_LINE = "Routed experts kept out of FSDP"


def train(dump_folder, choice: str, steps: int = 4) -> tuple[dict[int, float], str]:
    command = [
        *(sys.executable, "-m", "torchtitan_ext.train", "--nproc_per_node=2", "--flavor", "tiny-moe-grouped-mm"),
        *("--parallelism.expert_parallel_degree", "2", "--moe.experts_fsdp", choice),
        *("--checkpoint.enable", "--checkpoint.interval", "2", "--metrics.disable_color_printing"),
        *("--training.steps", str(steps), "--dump_folder", str(dump_folder)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return {int(step): float(loss) for step, loss in STEP_LOSS.findall(log)}, log


@pytest.mark.slow
def test_outside_fsdp_the_experts_train_the_same_losses_and_checkpoints_resume_either_way(tmp_path):
    outside, outside_log = train(tmp_path / "auto", "auto")
    inside, inside_log = train(tmp_path / "always", "always")
    assert OUTSIDE_FSDP_LINE in outside_log and OUTSIDE_FSDP_LINE not in inside_log
    assert sorted(outside) == [1, 2, 3, 4]
    assert outside == pytest.approx(inside, rel=1e-6)
    for saved, resumed in (("always", "auto"), ("auto", "always")):
        folder = tmp_path / f"{saved}_then_{resumed}"
        shutil.copytree(tmp_path / saved / "checkpoint" / "step-2", folder / "checkpoint" / "step-2")
        losses, _ = train(folder, resumed)
        assert losses == pytest.approx({step: inside[step] for step in (3, 4)}, rel=1e-6), (saved, resumed)
