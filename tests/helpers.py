"""Helpers shared by the tests: fresh buffers that hold NaN, unset rows after the experts',
weight-gradient and bf16 rounding checks, a free TCP port, spawned gloo workers and their EP mesh, a
backend made unavailable, the model config of a flavor and the configs inside it."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.decoder import Decoder

from torchtitan_ext.bench.common import relative_error
from torchtitan_ext.compat.cpu import exit_skipping_finalization
from torchtitan_ext.experiments.moe_backends.experts import BACKENDS, runnable_backends
from torchtitan_ext.experiments.moe_backends.fp8_experts import quantize_rowwise
from torchtitan_ext.kernels.availability import interpreter_enabled
from torchtitan_ext.kernels.fp8_swiglu import swiglu_backward_quantize_rows, swiglu_quantize_rows

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer


@contextlib.contextmanager
def fresh_buffers_hold_nan() -> Iterator[None]:
    """Inside, every fresh ``torch.empty`` buffer holds NaN (torch's deterministic mode fills them),
    so that reading a row nobody wrote shows in the result."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    # torch.utils.deterministic.fill_uninitialized_memory's getter and setter (a module property
    # that type checkers do not see)
    fill = torch._C._get_deterministic_fill_uninitialized_memory()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch._C._set_deterministic_fill_uninitialized_memory(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch._C._set_deterministic_fill_uninitialized_memory(fill)


def unset_rows_after_the_experts(x: torch.Tensor, grad_out: torch.Tensor, grouped: int):
    """``x`` and ``grad_out`` as EP's static receive rows leave them: the rows after the experts' unset
    (NaN here, so that reading any of them shows), and ``grad_out`` with zeros there for the reference."""
    unset_x, unset_grad_out, reference_grad_out = x.clone(), grad_out.clone(), grad_out.clone()
    unset_x[grouped:] = float("nan")
    unset_grad_out[grouped:] = float("nan")
    reference_grad_out[grouped:] = 0
    return unset_x, unset_grad_out, reference_grad_out


def assert_weight_gradient_matches(
    out_EMN: torch.Tensor, a_RM: torch.Tensor, b_RN: torch.Tensor, counts: list[int], tolerance: float
) -> None:
    """Each expert's out[e] against a[rows of e].T @ b[rows of e] in fp64 (consecutive row
    segments of ``counts``); an expert without rows must be exactly zero."""
    start = 0
    for expert, count in enumerate(counts):
        expected = a_RM[start : start + count].double().T @ b_RN[start : start + count].double()
        if count:
            assert relative_error(out_EMN[expert].double(), expected) < tolerance, f"expert {expert}"
        else:
            assert out_EMN[expert].abs().max() == 0, f"expert {expert} has no rows"
        start += count


def assert_bf16_rounds_like(actual: torch.Tensor | None, expected_fp32: torch.Tensor | None) -> None:
    """``actual`` (bf16) is ``expected_fp32`` rounded to bf16, up to sums taken in another order:
    at least 99% of the elements equal the rounded value and none is more than one bf16 step
    off (sums that cancel to near zero may be off by the rounding of tensor-core fp32 sums:
    2^-16 of the largest value). Either may be a ``.grad``: one backward did not set fails."""
    assert actual is not None and expected_fp32 is not None, "a gradient was not set"
    assert actual.dtype == torch.bfloat16
    rounded = expected_fp32.to(torch.bfloat16)
    assert (actual == rounded).float().mean() >= 0.99
    scale = float(expected_fp32.abs().max())
    torch.testing.assert_close(actual.float(), expected_fp32, rtol=2**-7, atol=2**-16 * scale)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(worker: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``worker(rank, *args)`` in ``world`` spawned processes and wait for all of them. A worker
    that returns ends through ``exit_skipping_finalization`` (gloo can abort a finished process at
    interpreter exit); one that raises fails the caller with its traceback."""
    mp.spawn(_run_then_exit, args=(worker, args), nprocs=world, join=True)


@contextlib.contextmanager
def gloo_ep_mesh(rank: int, world: int, port: int) -> Iterator[DeviceMesh]:
    """In a spawned worker: a gloo process group of ``world`` ranks on ``port`` with the SPMD backend CPU
    training uses, one thread, and a 1-D "ep" mesh over all ranks; the group is destroyed on exit."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    set_spmd_backend("partial_dtensor")
    torch.set_num_threads(1)
    try:
        yield init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def _run_then_exit(rank: int, worker: Callable[..., None], args: tuple) -> None:
    worker(rank, *args)
    exit_skipping_finalization(0)


def cpu_tensor_backends() -> list[str]:
    """The backends that compute on CPU tensors here: every runnable one, ``triton`` only through
    Triton's interpreter (set by conftest.py where there is no CUDA)."""
    return [name for name in runnable_backends() if name != "triton" or interpreter_enabled()]


def make_backend_unavailable(monkeypatch, name: str, reason: str | None) -> None:
    """For this test, backend ``name``'s spec reports ``reason`` (None: it runs here)."""
    spec = dataclasses.replace(BACKENDS[name], unavailable_reason=lambda: reason)
    monkeypatch.setitem(BACKENDS, name, spec)


def model_config(config: Trainer.Config) -> Decoder.Config:
    """The model config of a flavor's ``Trainer.Config``: every flavor here has a decoder model spec
    (torchtitan types the spec as optional and its model as any model's config)."""
    assert config.model_spec is not None and isinstance(config.model_spec.model, Decoder.Config)
    return config.model_spec.model


NestedConfig = TypeVar("NestedConfig")


def nested_configs(config: Trainer.Config, config_class: type[NestedConfig]) -> list[NestedConfig]:
    """Every ``config_class`` config inside the flavor's model, in model order (torchtitan's
    ``traverse`` finds them, typed as any config)."""
    return [c for _, c, _, _ in model_config(config).traverse(config_class) if isinstance(c, config_class)]


SavedTensor = tuple[str, torch.dtype, tuple[int, ...]]
"""A tensor a graph saves for the backward: which input it is (or "computed"), its dtype and shape."""


def tensors_saved_for_backward(compute, inputs: list[torch.Tensor], *args, **kwargs) -> list[SavedTensor]:
    """``compute(*inputs, *args, **kwargs)`` compiled (``aot_eager``, whole graph) and run forward once:
    each tensor its graph saves for the backward as (which input it is, or "computed", its dtype and
    shape), in a sorted list. The inputs are plain tensors, not parameters the partitioner may save for
    free, as FSDP's gathered weights are."""
    names = {t.untyped_storage().data_ptr(): f"input {i}" for i, t in enumerate(inputs)}
    saved: list[SavedTensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((names.get(t.untyped_storage().data_ptr(), "computed"), t.dtype, tuple(t.shape)))
        return t

    torch._dynamo.reset()
    compiled = torch.compile(compute, fullgraph=True, backend="aot_eager")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(*inputs, *args, **kwargs)
    return sorted(saved, key=str)


def saved_elements(saved: list[SavedTensor]) -> int:
    return sum(math.prod(shape) for _, _, shape in saved)


def fp8_experts_saved(x_RD: torch.Tensor, w1_EFD: torch.Tensor, num_experts: int) -> list[SavedTensor]:
    """What the FP8 experts' graph saves for the backward (as ``tensors_saved_for_backward`` lists it), for
    inputs ``[x_RD, w1, w2, w3]`` with no padding: the four inputs, the expert groups' int32 ends, the gate
    and up outputs as one [R, 2F] tensor in the activations' dtype, and one fp32 inverse scale per expert
    for each weight stack ([E, 1, 1]), which the input gradients quantise the weights with. No e4m3 copy
    of a weight or an activation."""
    (rows, dim), hidden = x_RD.shape, w1_EFD.shape[1]
    weight_shapes = [(num_experts, hidden, dim), (num_experts, dim, hidden), (num_experts, hidden, dim)]
    saved = [("input 0", x_RD.dtype, (rows, dim))]
    saved += [(f"input {i}", w1_EFD.dtype, shape) for i, shape in enumerate(weight_shapes, start=1)]
    saved += [("computed", torch.int32, (num_experts,)), ("computed", x_RD.dtype, (rows, 2 * hidden))]
    saved += [("computed", torch.float32, (num_experts, 1, 1))] * 2
    return sorted(saved, key=str)


def assert_swiglu_kernels_match_torch(
    gate_up_RF2: torch.Tensor,
    grad_a_RF: torch.Tensor,
    row_scores_R: torch.Tensor | None,
    group_end_E: torch.Tensor,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both FP8 SwiGLU kernels (``kernels.fp8_swiglu``) on these inputs, with every fresh buffer NaN: the
    forward's e4m3 rows bit-equal to the plain-torch rule applied to ``a`` as the backward writes it; the
    backward's ``[d gate, d up]`` rows bit-equal to the rule applied to the gradients it writes; ``a`` and
    the gate, up and score gradients within ``tolerance`` (relative) of torch's autograd in fp64, each in
    its dtype; the rows after the experts' unwritten (NaN), their score gradient zero. Returns the
    forward's values and inverse scales and ``a``, on the experts' rows."""
    rows = int(group_end_E[-1])
    with fresh_buffers_hold_nan():
        values, inverse = swiglu_quantize_rows(gate_up_RF2, row_scores_R, group_end_E)
        grad_gate, grad_up, a, grad_scores, grad_values, grad_inverse = swiglu_backward_quantize_rows(
            grad_a_RF, gate_up_RF2, row_scores_R, group_end_E
        )
    for quantized, rule in (
        ((values, inverse), quantize_rowwise(a[:rows])),
        ((grad_values, grad_inverse), quantize_rowwise(torch.cat([grad_gate, grad_up], dim=1)[:rows])),
    ):
        assert torch.equal(quantized[0][:rows].view(torch.uint8), rule[0].view(torch.uint8))
        assert torch.equal(quantized[1][:rows], rule[1])
        assert quantized[1][rows:].isnan().all()
        assert (quantized[0][rows:].view(torch.uint8) & 0x7F == 0x7F).all()  # e4m3 NaN: 0x7f or 0xff

    with_scores = row_scores_R is not None
    leaves = [
        t.double().requires_grad_() for t in (*gate_up_RF2.chunk(2, dim=1), *([row_scores_R] if with_scores else []))
    ]
    expected_a = torch.nn.functional.silu(leaves[0]) * leaves[1] * (leaves[2][:, None] if with_scores else 1)
    expected = [expected_a, *torch.autograd.grad(expected_a, leaves, grad_a_RF.double())]
    written = {"a": a, "gate": grad_gate, "up": grad_up}
    if with_scores:
        written["scores"] = grad_scores
    for (name, actual), wanted in zip(written.items(), expected, strict=True):
        assert relative_error(actual[:rows].double(), wanted[:rows]) <= tolerance, name
        if name == "scores":
            assert row_scores_R is not None and actual.dtype == row_scores_R.dtype
            assert (actual[rows:] == 0).all()
        else:
            assert actual.dtype == gate_up_RF2.dtype, name
            assert actual[rows:].isnan().all(), name
    assert grad_scores.shape == ((gate_up_RF2.shape[0],) if with_scores else (0,))
    return values[:rows], inverse[:rows], a[:rows]
