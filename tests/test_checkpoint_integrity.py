"""Checkpoints are verified before a resume: damage of each kind is named, intact ones resume."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import free_port
from torch import nn

from torchtitan_ext.checkpoint_integrity import (
    MANIFEST_NAME,
    CheckpointIntegrityError,
    IntegrityCheckpointManager,
)


class OptimizerState:
    """The ``Stateful`` torchtitan expects for its optimizers entry."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)


def build_manager(base_folder, seed: int, **config) -> tuple[IntegrityCheckpointManager, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().sum().backward()
    optimizer.step()
    manager = IntegrityCheckpointManager.Config(enable=True, keep_latest_k=0, interval=1, **config).build(
        dataloader=None,
        model_parts=[model],
        optimizers=OptimizerState(optimizer),
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=str(base_folder),
    )
    return manager, model


@pytest.fixture
def saved(tmp_path):
    """A checkpoint folder with step-2 saved by the manager; returns (base folder, saved weights)."""
    manager, model = build_manager(tmp_path, seed=0)
    assert manager.save(curr_step=2)
    manager.close()
    return tmp_path, {k: v.clone() for k, v in model.state_dict().items()}


def step_folder(base_folder, step: int = 2):
    return base_folder / "checkpoint" / f"step-{step}"


def distcp_shard(folder):
    return next(folder.glob("*.distcp"))


def flip_bytes(path, offset_fraction: float = 0.5, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * offset_fraction)
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def empty_folder(folder) -> None:
    for entry in folder.iterdir():
        entry.unlink()


DAMAGE = {
    "missing .metadata": (lambda f: (f / ".metadata").unlink(), r"\.metadata: missing"),
    "emptied folder": (empty_folder, r"no integrity\.json \(the folder is empty\)"),
    "flipped bytes in a .distcp shard": (lambda f: flip_bytes(distcp_shard(f)), r"\.distcp: sha256 differs"),
    "truncated .distcp shard": (
        lambda f: os.truncate(distcp_shard(f), 1000),
        r"\.distcp: size 1000 bytes, \d+ when saved",
    ),
    "garbage .metadata": (
        lambda f: (f / ".metadata").write_bytes(os.urandom((f / ".metadata").stat().st_size)),
        r"\.metadata: sha256 differs",
    ),
    "missing manifest": (lambda f: (f / MANIFEST_NAME).unlink(), r"no integrity\.json \(files: \.metadata, "),
    "garbage manifest": (lambda f: (f / MANIFEST_NAME).write_bytes(b"\x80garbage"), r"integrity\.json is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_with_the_step_folder_and_the_problem(saved, damage):
    base_folder, _ = saved
    apply_damage, problem = DAMAGE[damage]
    apply_damage(step_folder(base_folder))
    manager, _ = build_manager(base_folder, seed=1)
    with pytest.raises(CheckpointIntegrityError) as error:
        manager.load()
    message = str(error.value)
    assert str(step_folder(base_folder)) in message
    assert re.search(problem, message), message
    assert "--checkpoint.start_fresh" in message


def test_intact_checkpoint_loads_the_saved_weights(saved):
    base_folder, saved_weights = saved
    manager, model = build_manager(base_folder, seed=1)
    assert not torch.equal(model.state_dict()["0.weight"], saved_weights["0.weight"])
    assert manager.load()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, saved_weights[name], rtol=0, atol=0)


def test_manifest_records_every_file_of_the_save(saved):
    base_folder, _ = saved
    folder = step_folder(base_folder)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["step"] == 2
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST_NAME)
    assert sorted(manifest["files"]) == on_disk
    assert manifest["files"][".metadata"]["size"] == (folder / ".metadata").stat().st_size


def test_checkpoint_without_manifest_loads_only_when_allowed(saved, caplog):
    base_folder, saved_weights = saved
    (step_folder(base_folder) / MANIFEST_NAME).unlink()
    manager, model = build_manager(base_folder, seed=1, allow_unverified=True)
    with caplog.at_level(logging.WARNING):
        assert manager.load()
    assert "UNVERIFIED" in caplog.text
    torch.testing.assert_close(model.state_dict()["0.weight"], saved_weights["0.weight"], rtol=0, atol=0)


def test_start_fresh_is_logged_and_loads_nothing(saved, caplog):
    base_folder, saved_weights = saved
    manager, model = build_manager(base_folder, seed=1, start_fresh=True)
    with caplog.at_level(logging.WARNING):
        assert not manager.load()
    assert "checkpoint.start_fresh" in caplog.text and "[2]" in caplog.text
    assert not torch.equal(model.state_dict()["0.weight"], saved_weights["0.weight"])


def test_missing_load_step_is_named(saved):
    base_folder, _ = saved
    manager, _ = build_manager(base_folder, seed=1)
    with pytest.raises(CheckpointIntegrityError, match=r"step-7: the step folder does not exist"):
        manager.load(step=7)


def test_a_chosen_step_that_is_damaged_lists_the_intact_choices(saved):
    base_folder, _ = saved
    flip_bytes(distcp_shard(step_folder(base_folder)))
    manager, _ = build_manager(base_folder, seed=1)
    with pytest.raises(CheckpointIntegrityError) as error:
        manager.load(step=2)
    message = str(error.value)
    assert f"steps present in {base_folder / 'checkpoint'}: 2" in message
    assert "move it away" not in message  # it was chosen, not found as the latest


# --- start-up checks of a resume: before any process group or model ------------------------


def refused_resume(capsys, dump_folder, *args) -> str:
    """The start-up error of a checkpointed run of the tiny flavor with ``args`` in ``dump_folder``."""
    from torchtitan_ext.train import main

    code = main(["--flavor", "tiny-moe-grouped-mm", "--checkpoint.enable", "--dump_folder", str(dump_folder), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def step_folders(tmp_path):
    """``checkpoint/step-5`` and ``checkpoint/step-17`` under ``tmp_path`` (names are what the checks read)."""
    for step in (5, 17):
        step_folder(tmp_path, step).mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("steps", ["10", "17"])
def test_resuming_at_or_past_the_last_step_is_refused_with_how_to_go_on(step_folders, capsys, steps):
    err = refused_resume(capsys, step_folders, "--training.steps", steps)
    assert f"command line: training.steps = {steps}: the run would resume from {step_folders}" in err
    assert "step-17, at or past its last step" in err
    assert "--training.steps" in err and "--checkpoint.start_fresh" in err and "--checkpoint.load_step" in err
    assert f"steps present in {step_folders / 'checkpoint'}: 5, 17" in err


def test_a_load_step_without_its_folder_lists_the_steps_present(step_folders, capsys):
    err = refused_resume(capsys, step_folders, "--checkpoint.load_step", "7")
    assert f"checkpoint.load_step = 7: no step folder; steps present in {step_folders / 'checkpoint'}: 5, 17" in err
    assert "move it away" not in err


def test_a_resume_before_the_last_step_or_a_fresh_start_passes_the_checks(step_folders):
    from torchtitan_ext.registry import get_flavor
    from torchtitan_ext.validation import resume_errors

    config = get_flavor("tiny-moe-grouped-mm").build()
    checkpoint = config.checkpoint
    assert isinstance(checkpoint, IntegrityCheckpointManager.Config)
    config.dump_folder, checkpoint.enable, config.training.steps = str(step_folders), True, 18
    assert resume_errors(config) == []
    config.training.steps = 10
    checkpoint.load_step = 5
    assert resume_errors(config) == []
    checkpoint.load_step, checkpoint.start_fresh = -1, True
    assert resume_errors(config) == []
    checkpoint.enable = False
    assert resume_errors(config) == []


@pytest.fixture
def world_of_one(monkeypatch):
    """A one-process gloo group, as torchtitan's async checkpointing needs one."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_async_save_gets_its_manifest_when_waited_for(tmp_path, world_of_one):
    manager, _ = build_manager(tmp_path, seed=0, async_mode="async")
    assert manager.save(curr_step=2)
    manager.maybe_wait_for_saving()
    assert manager.save(curr_step=3, last_step=True)
    manager.close()
    for step in (2, 3):
        assert (step_folder(tmp_path, step) / MANIFEST_NAME).is_file(), step
    flip_bytes(distcp_shard(step_folder(tmp_path, 3)))
    reader, _ = build_manager(tmp_path, seed=1, async_mode="async")
    with pytest.raises(CheckpointIntegrityError, match="step-3 is damaged"):
        reader.load()
    reader.close()


# --- through the train entry: exit codes and resumed losses --------------------------------

STEP_LOSS = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
CHECKPOINTED_RUN = [
    "--flavor",
    "tiny-moe-grouped-mm",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--metrics.disable_color_printing",
]


def train(dump_folder, steps: int = 4, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *(sys.executable, "-m", "torchtitan_ext.train", *CHECKPOINTED_RUN, *extra),
            *("--training.steps", str(steps), "--dump_folder", str(dump_folder)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def losses(result: subprocess.CompletedProcess) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP_LOSS.findall(result.stdout + result.stderr)}


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    """Four steps, checkpoints at steps 2 and 4: (dump folder, {step: loss})."""
    dump_folder = tmp_path_factory.mktemp("uninterrupted")
    result = train(dump_folder)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return dump_folder, losses(result)


@pytest.mark.slow
def test_resume_from_intact_checkpoint_continues_with_the_same_losses(uninterrupted_run, tmp_path):
    dump_folder, reference = uninterrupted_run
    shutil.copytree(dump_folder / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    result = train(tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    resumed = losses(result)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step


@pytest.mark.slow
def test_a_worker_process_loads_the_same_batches_and_its_checkpoint_resumes_after_the_last_trained_one(
    uninterrupted_run, tmp_path
):
    """With ``data.workers 1`` the worker loads batches ahead of the step; the checkpoint holds the
    data position of the batches trained on, not of those loaded ahead, so the resumed run goes on
    with the batches the uninterrupted run trained on next."""
    _, reference = uninterrupted_run
    worker = ("--data.workers", "1")
    with_worker = train(tmp_path / "with_worker", extra=worker)
    assert with_worker.returncode == 0, (with_worker.stdout + with_worker.stderr)[-4000:]
    assert losses(with_worker) == pytest.approx(reference, rel=1e-6)
    resumed_folder = tmp_path / "resumed"
    shutil.copytree(tmp_path / "with_worker" / "checkpoint" / "step-2", resumed_folder / "checkpoint" / "step-2")
    resumed = train(resumed_folder, extra=worker)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert losses(resumed) == pytest.approx({step: reference[step] for step in (3, 4)}, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped bytes in a .distcp shard", "emptied folder"])
def test_damaged_checkpoint_ends_the_run_with_exit_code_2(uninterrupted_run, tmp_path, damage):
    dump_folder, _ = uninterrupted_run
    shutil.copytree(dump_folder / "checkpoint", tmp_path / "checkpoint")
    apply_damage, problem = DAMAGE[damage]
    apply_damage(tmp_path / "checkpoint" / "step-4")
    result = train(tmp_path, steps=6)
    assert result.returncode == 2, (result.stdout + result.stderr)[-4000:]
    assert re.search(r"error: checkpoint \S*step-4\b.*" + problem, result.stderr), result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    assert not losses(result)
