"""torchtitan's Trainer, with CUDA-graph steps whose gradients live in the graph's memory.

With CUDA graphs on (``training.disable_cuda_graphs = false``), torchtitan 0.3.0 captures each
step's forward and backward in one graph (``torchtitan/distributed/cudagraph.py``
``wrap_with_cuda_graph``) and keeps every gradient from step to step: ``Trainer.train_step`` zeroes
them in place (``zero_grad(set_to_none=False)``) and the captured backward adds each new gradient
into them. Those gradients, fp32 shards as large as the parameters under FSDP, then hold memory
through the whole forward, next to the activations, and every step pays a fill and an add over all
of them.

``Trainer`` lets the step's backward create the gradients instead (``GraphOwnedGradients``): they are
dropped before each step, so the backward allocates them where the graph captured it, in the graph's
memory pool, which the activations freed earlier in the backward are returned to. A replay runs no
Python, so it writes the gradients into the tensors the capture created and leaves ``.grad`` unset;
those tensors are then put back, and the optimizer reads them before the next replay overwrites
them. This needs one forward-backward per optimizer step: with gradient accumulation or pipeline
parallelism the gradients are torchtitan's, kept and accumulated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torchtitan import trainer as titan_trainer
from torchtitan.tools.logging import logger


class GraphOwnedGradients:
    """The gradients of ``parameters`` as the last forward-backward that ran in Python created them.

    Protocol per optimizer step: ``before_step()`` (the backward then creates every gradient; until a
    CUDA graph has captured the step, the recorded gradients are let go and the allocator's cached
    memory returned to the device first, so the capture's pool does not sit next to the warm-up's
    leftovers), ``record()`` after each forward-backward that runs in Python (eager, or the one a CUDA
    graph captures), ``restore()`` after the step's forward-backward: a parameter whose ``.grad`` is
    unset after it (a replay) gets back the tensor recorded for it, which the replay wrote.
    """

    def __init__(self, parameters: list[torch.nn.Parameter]):
        self.parameters = parameters
        self.recorded: list[torch.Tensor | None] = [None] * len(parameters)
        self.captured = False
        """A CUDA graph captured the forward-backward: every later step is a replay."""

    def before_step(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None
        if not self.captured:
            self.recorded = [None] * len(self.parameters)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def record(self) -> None:
        self.recorded = [parameter.grad for parameter in self.parameters]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.captured = True

    def restore(self) -> None:
        for parameter, grad in zip(self.parameters, self.recorded, strict=True):
            if parameter.grad is None:
                parameter.grad = grad


def graph_owned_gradients_reason(config, gradient_accumulation_steps: int, pipeline_parallel: bool) -> str | None:
    """Why a run's step keeps torchtitan's accumulated gradients (None: its gradients can live in the
    CUDA graph's memory)."""
    if config.training.disable_cuda_graphs or not torch.cuda.is_available() or torch.version.hip is not None:
        return "CUDA graphs are off"  # torchtitan captures them on NVIDIA CUDA only
    if pipeline_parallel:
        return "pipeline parallelism runs several forward-backwards per step"
    if gradient_accumulation_steps > 1:
        return f"gradient accumulation runs {gradient_accumulation_steps} forward-backwards per step"
    return None


class Trainer(titan_trainer.Trainer):
    """torchtitan's Trainer; with CUDA graphs and one forward-backward per step, the step's gradients
    live in the graph's memory (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(titan_trainer.Trainer.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.graph_owned_gradients: GraphOwnedGradients | None = None
        reason = graph_owned_gradients_reason(config, self.gradient_accumulation_steps, self.parallel_dims.pp_enabled)
        if reason is None:
            parameters = [p for model in self.model_parts for p in model.parameters() if p.requires_grad]
            self.graph_owned_gradients = GraphOwnedGradients(parameters)
            logger.info("CUDA graphs: each step's gradients are created by its backward in the graph's memory")
        elif not config.training.disable_cuda_graphs:
            logger.info(f"CUDA graphs: gradients kept and accumulated between steps ({reason})")

    def train_step(self, data_iterator):
        if self.graph_owned_gradients is not None:
            self.graph_owned_gradients.before_step()  # torchtitan's zero_grad then finds nothing to fill
        super().train_step(data_iterator)

    def forward_backward_step(
        self,
        *,
        input_dict: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
        labels: torch.Tensor | list[torch.Tensor],
        global_valid_tokens: torch.Tensor,
    ) -> torch.Tensor:
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        if self.graph_owned_gradients is not None:
            self.graph_owned_gradients.restore()
        return loss

    def _forward_backward_body(self, *args, **kwargs) -> torch.Tensor:
        """torchtitan's forward-backward; runs in Python only when eager or captured, never in a replay."""
        loss = super()._forward_backward_body(*args, **kwargs)
        if self.graph_owned_gradients is not None:
            self.graph_owned_gradients.record()
        return loss


def with_gradient_owning_trainer(config: titan_trainer.Trainer.Config) -> Trainer.Config:
    """``config`` as a ``Trainer.Config`` of this module (the same values): ``config.build()`` then
    builds this module's ``Trainer``."""
    if isinstance(config, Trainer.Config):
        return config
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config) if field.init}
    return Trainer.Config(**values)
