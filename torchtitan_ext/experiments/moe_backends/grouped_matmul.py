"""``torch._grouped_mm`` as a differentiable op that compiles in every dtype.

torch's fake (meta) implementation of ``torch._grouped_mm`` accepts only bf16 operands, although the
eager op computes fp32 and fp16 too; so ``torch.compile`` cannot trace an fp32 model (the tiny CPU
flavors) through it. ``torchtitan_ext::grouped_mm`` calls the eager op, its fake implementation gives
the output shape for any dtype, and its autograd formula is two more calls of itself:

- ``a [R, K] @ b[e] [K, N]`` over the row groups of ``offs`` -> ``[R, N]`` (the forward), with
  ``d a = d y @ b[e].T`` (the same form) and ``d b[e] = a[rows of e].T @ d y[rows of e]``;
- ``a [K, R] @ b [R, N]`` reduced over the row groups of ``offs`` -> ``[E, K, N]`` (the weight
  gradient; not differentiable itself).

Operands follow ``torch._grouped_mm``'s layout rules (row-major, 16-byte aligned rows); the
gradient arriving from autograd is made row-major first. ``weight_rows`` scales the rows a down
projection reads by the router scores (the ``grouped_mm`` and FP8 experts' row weighting).
"""

import torch

from torchtitan_ext.kernels.library_ops import kernel_op

GROUPED_KERNEL_CAPABILITIES = (9, 10)
"""Compute capability majors (Hopper, Blackwell) where ``torch._grouped_mm`` has one grouped kernel."""


def reads_offsets_on_host(dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether ``torch._grouped_mm`` in ``dtype`` on a GPU of ``capability`` (None: the GPU is not
    known, only the dtype decides) copies its group offsets to the host: it runs one grouped kernel
    only for bf16 on compute capability 9.x or 10.x, and otherwise one matmul per group from offsets
    read on the host (a device sync, which a CUDA graph cannot capture)."""
    on_other_gpu = capability is not None and capability[0] not in GROUPED_KERNEL_CAPABILITIES
    return dtype != torch.bfloat16 or on_other_gpu


@kernel_op("grouped_mm")
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` (module docstring)."""
    return torch._grouped_mm(a, b, offs=offs)


@torch.library.register_fake(grouped_mm)
def _(a, b, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _setup_context(ctx, inputs, output) -> None:
    a, b, offs = inputs
    if b.dim() != 3:
        raise NotImplementedError("torchtitan_ext::grouped_mm: the [E, K, N] weight-gradient form has no gradient")
    ctx.save_for_backward(a, b, offs)


def row_major_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a row-major tensor of ``shape``: each the product of the sizes after it."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with exactly row-major strides, copied when it has others.

    ``torch._grouped_mm`` reads every stride, those of size-1 and size-0 dimensions included, which
    ``is_contiguous`` ignores: one row of a wider buffer (row stride D + 1), a transposed ``[D, 1]``
    gradient or an expanded zero-size gradient (stride 0) counts as contiguous but is refused
    ("strides should be multiple of 16 bytes"). The strides are compared rather than the size
    read, so the row count may be data-dependent (the received rows under expert parallelism,
    compiled).
    """
    if t.stride() == row_major_strides(t.shape):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _backward(ctx, grad_y):
    a, b, offs = ctx.saved_tensors
    grad_y = row_major(grad_y)
    grad_a = grouped_mm(grad_y, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = _weight_gradient(a, b, grad_y, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


def _weight_gradient(a: torch.Tensor, b: torch.Tensor, grad_y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``d b`` [E, K, N] in ``b``'s layout: for column-major weights (``w.transpose(-2, -1)`` of a
    row-major ``w`` [E, N, K], as the experts pass them) it is computed as ``w``'s gradient [E, N, K]
    and returned transposed, so the weight's gradient needs no transposing copy."""
    if b.stride(-2) == 1 and b.stride(-1) != 1:
        return grouped_mm(grad_y.transpose(0, 1), a, offs).transpose(-2, -1)
    return grouped_mm(a.transpose(0, 1), grad_y, offs)


torch.library.register_autograd(grouped_mm, _backward, setup_context=_setup_context)


def weight_rows(h_RF: torch.Tensor, row_scores_R: torch.Tensor | None) -> torch.Tensor:
    """``h_RF`` with row ``r`` times ``row_scores_R[r]`` (``(R,)``, differentiable; the product in fp32,
    returned in ``h_RF``'s dtype); ``h_RF`` itself without scores. The down projection is linear in its
    rows, so weighting its input weights its output, and the scores' gradient is the row-wise dot of the
    input's gradient with ``h_RF``, which a compiled backward recomputes from the gate and up
    pre-activations instead of keeping an expert output."""
    if row_scores_R is None:
        return h_RF
    if row_scores_R.shape != (h_RF.shape[0],):
        raise ValueError(f"row scores must have shape ({h_RF.shape[0]},), got {tuple(row_scores_R.shape)}")
    return (h_RF * row_scores_R.float()[:, None]).to(h_RF.dtype)
