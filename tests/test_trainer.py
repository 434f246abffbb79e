"""The train entry's Trainer: torchtitan's, with CUDA-graph steps whose gradients the graph owns."""

import inspect
import re
import subprocess
import sys
import weakref

import pytest
import torch
from torchtitan import trainer as titan_trainer
from torchtitan.distributed import cudagraph

from torchtitan_ext import trainer
from torchtitan_ext.run_training import FlavorConfigManager


def test_the_train_entrys_config_builds_the_gradient_owning_trainer_with_the_same_values():
    config = FlavorConfigManager().parse_args(["--flavor", "tiny-moe-grouped-mm", "--training.steps", "7"])
    assert isinstance(config, trainer.Trainer.Config) and type(config)._owner is trainer.Trainer
    assert config.training.steps == 7 and config.model_spec is not None
    assert trainer.with_gradient_owning_trainer(config) is config


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 5)
        self.second = torch.nn.Linear(5, 3)
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))).square().mean()


def train_with_graph_owned_gradients(model, batches, python_steps: int):
    """Steps as the gradient-owning Trainer runs them under a CUDA graph: the first ``python_steps``
    forward-backwards run in Python (warm-up, then the capture), the later ones as a replay does:
    gradients written into the tensors the capture created, ``.grad`` left unset."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradients = trainer.GraphOwnedGradients(list(model.parameters()))
    for step, x in enumerate(batches):
        gradients.before_step()
        optimizer.zero_grad(set_to_none=False)  # torchtitan's, with graphs on: nothing left to fill
        if step < python_steps:
            model(x).backward()
            gradients.record()
            gradients.captured = step == python_steps - 1  # what record() learns from CUDA inside a capture
        else:
            kept = [g for g in gradients.recorded if g is not None]
            params = [p for p, g in zip(model.parameters(), gradients.recorded) if g is not None]
            for into, grad in zip(kept, torch.autograd.grad(model(x), params), strict=True):
                into.copy_(grad)
        gradients.restore()
        optimizer.step()


def test_graph_owned_gradients_train_as_fresh_gradients_through_warm_up_capture_and_replays():
    torch.manual_seed(0)
    batches = [torch.randn(4, 6) for _ in range(6)]
    model = Model()
    reference = Model()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x in batches:
        optimizer.zero_grad(set_to_none=True)
        reference(x).backward()
        optimizer.step()

    train_with_graph_owned_gradients(model, batches, python_steps=2)

    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, reference.get_parameter(name), rtol=0, atol=0, msg=name)
    assert model.unused.weight.grad is None  # a parameter without a gradient keeps none


def test_until_a_graph_captured_the_step_the_recorded_gradients_are_let_go_before_it_and_kept_after():
    model = Model()
    gradients = trainer.GraphOwnedGradients(list(model.parameters()))
    model(torch.randn(2, 6)).backward()
    gradients.record()
    assert not gradients.captured  # no CUDA capture here
    old = weakref.ref(model.first.weight.grad)
    gradients.before_step()
    assert old() is None and model.first.weight.grad is None
    model(torch.randn(2, 6)).backward()
    gradients.record()
    gradients.captured = True
    gradients.before_step()
    assert model.first.weight.grad is None and gradients.recorded[0] is not None
    gradients.restore()
    assert model.first.weight.grad is gradients.recorded[0]


@pytest.mark.parametrize(
    ("cuda_graphs", "accumulation", "pipeline", "reason"),
    [
        (True, 1, False, None),
        (False, 1, False, "CUDA graphs are off"),
        (True, 2, False, "gradient accumulation runs 2 forward-backwards per step"),
        (True, 1, True, "pipeline parallelism runs several forward-backwards per step"),
    ],
)
def test_gradients_live_in_the_graph_only_with_one_forward_backward_per_step(
    monkeypatch, cuda_graphs, accumulation, pipeline, reason
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = titan_trainer.Trainer.Config()
    config.training.disable_cuda_graphs = not cuda_graphs
    assert trainer.graph_owned_gradients_reason(config, accumulation, pipeline) == reason


def test_without_cuda_the_gradients_are_torchtitans(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = titan_trainer.Trainer.Config()
    config.training.disable_cuda_graphs = False
    assert trainer.graph_owned_gradients_reason(config, 1, False) == "CUDA graphs are off"


def test_torchtitan_still_runs_the_step_the_way_the_gradient_owning_trainer_relies_on():
    """The Trainer overrides ``train_step``, ``forward_backward_step`` and ``_forward_backward_body``
    on these facts of torchtitan 0.3.0; a torchtitan that changes one of them breaks it."""
    init = inspect.getsource(titan_trainer.Trainer.__init__)
    assert "self.fwd_bwd_fn = self._forward_backward_body" in init
    assert "self.fwd_bwd_fn = wrap_with_cuda_graph(self.fwd_bwd_fn)" in init
    step = inspect.getsource(titan_trainer.Trainer.train_step)
    zero_grad = step.index("self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)")
    assert zero_grad < step.index("self.forward_backward_step(") < step.index("self.optimizers.step()")
    assert "self.fwd_bwd_fn(" in inspect.getsource(titan_trainer.Trainer.forward_backward_step)
    replay = inspect.getsource(cudagraph.CUDAGraphWrapper.__call__)
    after_capture = replay[replay.index("logger.info") :]
    assert "self._graph.replay()" in after_capture and "self._fn(" not in after_capture


GRAPH_OWNED_ON_CPU = """
import sys
import torchtitan_ext.trainer as trainer
trainer.graph_owned_gradients_reason = lambda *args: None
from torchtitan_ext.run_training import run
sys.exit(run(sys.argv[1:]))
"""


def test_the_trainer_steps_with_graph_owned_gradients_train_like_torchtitans(tmp_path):
    """On CPU (no graph to capture, every step runs in Python) the overridden steps drop, record and
    restore the gradients around torchtitan's real step: the same losses as its own gradients."""
    args = ["--flavor", "tiny-moe-grouped-mm", "--training.steps", "4", "--metrics.disable_color_printing"]

    def losses(*command: str, dump: str) -> tuple[list[str], str]:
        result = subprocess.run(
            [sys.executable, *command, *args, "--dump_folder", str(tmp_path / dump)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-3000:]
        return re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", output), output

    graph_owned, output = losses("-c", GRAPH_OWNED_ON_CPU, dump="graph_owned")
    assert "each step's gradients are created by its backward" in output
    kept, _ = losses("-m", "torchtitan_ext.train", dump="kept")
    assert len(kept) == 4 and graph_owned == kept
