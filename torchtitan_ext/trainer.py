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

    Protocol per optimizer step: ``drop()`` before the step (the backward then creates every
    gradient), ``forget()`` and ``record()`` around each forward-backward that runs in Python (eager,
    or the one a CUDA graph captures; ``forget`` lets the recorded tensors go before it allocates new
    ones), ``restore()`` after the step's forward-backward: a parameter whose ``.grad`` is unset after
    it (a replay) gets back the tensor recorded for it, which the replay wrote.
    """

    def __init__(self, parameters: list[torch.nn.Parameter]):
        self.parameters = parameters
        self.recorded: list[torch.Tensor | None] = [None] * len(parameters)
        self.recorded_since_restore = False

    def drop(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    def forget(self) -> None:
        self.recorded = [None] * len(self.parameters)

    def record(self) -> None:
        self.recorded = [parameter.grad for parameter in self.parameters]
        self.recorded_since_restore = True

    def restore(self) -> bool:
        """Put the recorded tensors back where ``.grad`` is unset; True when the step's forward-backward
        ran in Python (created new gradient tensors) rather than replayed."""
        for parameter, grad in zip(self.parameters, self.recorded, strict=True):
            if parameter.grad is None:
                parameter.grad = grad
        ran_in_python, self.recorded_since_restore = self.recorded_since_restore, False
        return ran_in_python


def graph_owned_gradients_reason(config, gradient_accumulation_steps: int, pipeline_parallel: bool) -> str | None:
    """Why a run's step keeps torchtitan's accumulated gradients (None: its gradients can live in the
    CUDA graph's memory)."""
    if config.training.disable_cuda_graphs or not torch.cuda.is_available():
        return "CUDA graphs are off"
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
            self.graph_owned_gradients.drop()  # torchtitan's zero_grad then finds nothing to fill
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
        if self.graph_owned_gradients is not None and self.graph_owned_gradients.restore():
            # Eager warm-up or capture: the memory the previous gradients and the warm-up's activations
            # left cached outside the graph's pool goes back to the device (twice a run).
            torch.cuda.empty_cache()
        return loss

    def _forward_backward_body(self, *args, **kwargs) -> torch.Tensor:
        """torchtitan's forward-backward; runs in Python only when eager or captured, never in a replay."""
        gradients = self.graph_owned_gradients
        if gradients is None:
            return super()._forward_backward_body(*args, **kwargs)
        gradients.forget()
        loss = super()._forward_backward_body(*args, **kwargs)
        gradients.record()
        return loss


def with_gradient_owning_trainer(config: titan_trainer.Trainer.Config) -> Trainer.Config:
    """``config`` as a ``Trainer.Config`` of this module (the same values): ``config.build()`` then
    builds this module's ``Trainer``."""
    if isinstance(config, Trainer.Config):
        return config
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config) if field.init}
    return Trainer.Config(**values)
