"""Every compute backend matches the plain-torch reference (``reference_grouped``, the for_loop backend):
forward and all gradients; the backend table says which names are valid."""

import dataclasses
import typing

import pytest
import torch
from helpers import fresh_buffers_hold_nan, unset_rows_after_the_experts

from torchtitan_ext.bench.common import relative_error
from torchtitan_ext.config.short_keys import short_key
from torchtitan_ext.experiments.moe_backends.experts import (
    BACKENDS,
    BackendGroupedExperts,
    ComputeBackend,
    ComputeBackendChoice,
    ComputeBackendSpec,
    backend_name_error,
    backend_names,
    backend_unavailable_reason,
    compute_backend_choices,
    get_backend,
    register_backend,
    resolved_at_startup,
    runnable_backends,
)
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config
from torchtitan_ext.kernels.fused_moe import reference_grouped, reference_row_weighted

BACKENDS_UNDER_TEST = [b for b in backend_names() if b != "for_loop"]


def device_of(backend: str) -> torch.device:
    """Where a backend is tested: ``triton`` on CUDA when there is one, else on CPU tensors through Triton's
    interpreter (``TRITON_INTERPRET=1``, set by conftest.py where there is no CUDA); the others on CPU."""
    return torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")


# Relative error bounds (||a - b|| / ||b||) per compute dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

COUNT_CASES = {
    "mixed_with_empty_experts": [3, 0, 6, 1, 0, 5],
    "all_experts_empty": [0, 0, 0, 0],
    "single_expert_takes_all": [0, 0, 11, 0],
    "one_expert": [7],
    "one_row_each": [1, 1, 1, 1, 1],
}


def make_inputs(counts, dim, hidden, x_dtype, w_dtype, seed, device="cpu", rows_after_experts=0):
    generator = torch.Generator().manual_seed(seed)
    num_experts, num_rows = len(counts), sum(counts) + rows_after_experts

    def randn(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    x = randn(num_rows, dim, dtype=x_dtype)
    w1 = randn(num_experts, hidden, dim, dtype=w_dtype, scale=max(dim, 1) ** -0.5)
    w2 = randn(num_experts, dim, hidden, dtype=w_dtype, scale=max(hidden, 1) ** -0.5)
    w3 = randn(num_experts, hidden, dim, dtype=w_dtype, scale=max(dim, 1) ** -0.5)
    grad_out = randn(num_rows, dim, dtype=x_dtype)
    return (x, w1, w2, w3), torch.tensor(counts, dtype=torch.int64, device=device), grad_out


def run_backend(fn, tensors, counts, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, counts)
    out.backward(grad_out)
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    return out.detach(), grads


def skip_interpreted_bf16(backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("bf16 is unreliable in Triton's CPU interpreter; covered by the GPU kernel tests")


def assert_backend_matches_reference(backend, counts, dim, hidden, x_dtype, w_dtype, seed=0):
    skip_interpreted_bf16(backend, x_dtype)
    tensors, counts_E, grad_out = make_inputs(counts, dim, hidden, x_dtype, w_dtype, seed, device_of(backend))
    expected_out, expected_grads = run_backend(reference_grouped, tensors, counts_E, grad_out)
    actual_out, actual_grads = run_backend(BACKENDS[backend].grouped, tensors, counts_E, grad_out)

    tolerance = TOLERANCE[x_dtype]
    assert actual_out.dtype == x_dtype and actual_out.shape == expected_out.shape
    assert relative_error(actual_out, expected_out) < tolerance, "output"
    for name, actual, expected, leaf in zip(("x", "w1", "w2", "w3"), actual_grads, expected_grads, tensors):
        assert actual.dtype == leaf.dtype, f"grad of {name} has dtype {actual.dtype}"
        assert torch.isfinite(actual).all(), f"grad of {name} is not finite"
        assert relative_error(actual, expected) < tolerance, f"grad of {name}"


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_edge_case_token_counts_fp32(backend, case):
    assert_backend_matches_reference(backend, COUNT_CASES[case], 16, 24, torch.float32, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("counts", [[3, 0, 6, 1], [0, 0, 0]])
def test_rows_after_the_experts_change_nothing_the_experts_compute(backend, counts):
    """Rows after the experts' (EP's static receive rows, unset: NaN here), their output gradients
    (unset too) and every fresh buffer NaN (rows a kernel leaves unwritten): the experts' rows of the
    output and of the input gradient and every weight gradient are the reference's (``ExpertCompute``)."""
    grouped = sum(counts)
    tensors, counts_E, grad_out = make_inputs(counts, 16, 24, torch.float32, torch.float32, 0, device_of(backend), 5)
    unset_x, unset_grad_out, reference_grad_out = unset_rows_after_the_experts(tensors[0], grad_out, grouped)
    expected_out, expected_grads = run_backend(reference_grouped, tensors, counts_E, reference_grad_out)
    with fresh_buffers_hold_nan():
        out, grads = run_backend(BACKENDS[backend].grouped, (unset_x, *tensors[1:]), counts_E, unset_grad_out)
    assert out.shape == expected_out.shape
    assert relative_error(out[:grouped], expected_out[:grouped]) < TOLERANCE[torch.float32], "output"
    assert relative_error(grads[0][:grouped], expected_grads[0][:grouped]) < TOLERANCE[torch.float32], "grad of x"
    for name, actual, expected in zip(("w1", "w2", "w3"), grads[1:], expected_grads[1:]):
        assert relative_error(actual, expected) < TOLERANCE[torch.float32], f"grad of {name}"


ROW_WEIGHTING_BACKENDS = [name for name, spec in BACKENDS.items() if spec.row_weighted is not None]


@pytest.mark.parametrize("backend", ROW_WEIGHTING_BACKENDS)
@pytest.mark.parametrize("counts", [[3, 0, 6, 1], [0, 0, 0], [7]])
@pytest.mark.parametrize("dim,hidden", [(16, 24), (13, 29)])
def test_row_weighted_experts_match_the_reference(backend, counts, dim, hidden):
    """``row_weighted`` (``experts_apply_scores``) against the reference, forward and every gradient (the
    scores' too), with rows after the experts' (EP's static receive rows) as the transports give them:
    unset (NaN here), their output gradients unset too, their scores zero. The experts' rows of the
    output, of the input and score gradients, and every weight gradient match."""
    grouped = sum(counts)
    tensors, counts_E, grad_out = make_inputs(
        counts, dim, hidden, torch.float32, torch.float32, 1, device_of(backend), 5
    )
    unset_x, unset_grad_out, reference_grad_out = unset_rows_after_the_experts(tensors[0], grad_out, grouped)
    scores = torch.rand(grouped + 5, generator=torch.Generator().manual_seed(2)).to(tensors[0].device)
    scores[grouped:] = 0
    leaves = [t.detach().clone().requires_grad_() for t in (*tensors, scores)]
    x, w1, w2, w3, row_scores = leaves
    expected = reference_row_weighted(x, w1, w2, w3, counts_E, row_scores)
    expected_grads = torch.autograd.grad(expected, leaves, reference_grad_out)
    unset_leaves = [t.detach().clone().requires_grad_() for t in (unset_x, *tensors[1:], scores)]
    row_weighted = BACKENDS[backend].row_weighted
    assert row_weighted is not None
    unset_x, w1, w2, w3, row_scores = unset_leaves
    with fresh_buffers_hold_nan():
        out = row_weighted(unset_x, w1, w2, w3, counts_E, row_scores)
        grads = torch.autograd.grad(out, unset_leaves, unset_grad_out)
    tolerance = TOLERANCE[torch.float32]
    assert relative_error(out[:grouped], expected[:grouped]) < tolerance, "output"
    for name, actual, wanted in zip(("x", "w1", "w2", "w3", "scores"), grads, expected_grads, strict=True):
        rows = slice(None) if name.startswith("w") else slice(grouped)
        assert relative_error(actual[rows], wanted[rows]) < tolerance, f"grad of {name}"


@pytest.mark.parametrize("backend", ROW_WEIGHTING_BACKENDS)
def test_row_weighted_experts_refuse_scores_of_another_length(backend):
    (x, w1, w2, w3), counts_E, _ = make_inputs([3, 3], 16, 8, torch.float32, torch.float32, 0, device_of(backend))
    row_weighted = BACKENDS[backend].row_weighted
    assert row_weighted is not None
    with pytest.raises(ValueError, match=r"row scores must have shape \(6,\), got \(5,\)"):
        row_weighted(x, w1, w2, w3, counts_E, torch.rand(5).to(x.device))


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_and_counts_fp32(backend, seed):
    generator = torch.Generator().manual_seed(100 + seed)
    num_experts = int(torch.randint(1, 9, (1,), generator=generator))
    counts = torch.randint(0, 9, (num_experts,), generator=generator)
    counts[torch.rand(num_experts, generator=generator) < 0.3] = 0
    dim = int(torch.randint(3, 40, (1,), generator=generator))
    hidden = int(torch.randint(3, 40, (1,), generator=generator))
    assert_backend_matches_reference(backend, counts.tolist(), dim, hidden, torch.float32, torch.float32, seed)


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dim,hidden", [(7, 5), (13, 29), (33, 17)])
def test_odd_dims_fp32(backend, dim, hidden):
    assert_backend_matches_reference(backend, [4, 0, 3, 5], dim, hidden, torch.float32, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(backend, dtype):
    assert_backend_matches_reference(backend, [5, 0, 9, 2, 7], 32, 48, dtype, dtype)


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim,hidden", [(32, 47), (33, 48)])
def test_half_precision_rows_not_16_byte_aligned(backend, dtype, dim, hidden):
    """An odd F or D leaves 16-bit rows off 16-byte alignment, which ``torch._grouped_mm`` refuses."""
    assert_backend_matches_reference(backend, [5, 0, 9, 2, 7], dim, hidden, dtype, dtype)


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_bf16_inputs_with_fp32_parameters(backend):
    """As under FSDP mixed precision: compute in bf16, weight grads flow back in fp32."""
    assert_backend_matches_reference(backend, [6, 3, 0, 8], 32, 40, torch.bfloat16, torch.float32)


def test_empty_experts_receive_zero_weight_gradients():
    for backend in backend_names():
        inputs = make_inputs([5, 0, 4], 8, 12, torch.float32, torch.float32, 3, device_of(backend))
        _, grads = run_backend(BACKENDS[backend].grouped, *inputs)
        for grad in grads[1:]:
            assert grad[1].abs().max() == 0, backend
            assert grad[0].abs().max() > 0, backend


def test_module_uses_configured_backend_and_matches_reference():
    torch.manual_seed(0)
    outputs = {}
    for backend in backend_names():
        experts = BackendGroupedExperts.Config(dim=16, hidden_dim=24, num_experts=4, compute_backend=backend).build()
        torch.manual_seed(1)
        for weight in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD):
            torch.nn.init.normal_(weight, std=0.1)
        device = device_of(backend)
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(2)).to(device)
        outputs[backend] = experts.to(device)(x, torch.tensor([2, 0, 5, 3], device=device)).cpu()
        assert backend in repr(experts)
    for backend in backend_names():
        assert relative_error(outputs[backend], outputs["for_loop"]) < 1e-5


def test_unknown_backend_is_an_error_listing_valid_ones():
    with pytest.raises(ValueError, match="grouped_mm, for_loop, batched_mm_padded, triton"):
        get_backend("cuda_magic")
    with pytest.raises(ValueError, match="compute_backend = 'cuda_magic': unknown backend"):
        BackendGroupedExperts.Config(dim=4, hidden_dim=4, num_experts=2, compute_backend="cuda_magic")


def test_the_table_says_which_names_are_valid_and_what_auto_means():
    from torchtitan_ext.registry import all_flavors

    all_flavors()  # the experiment registers its TOML keys
    assert compute_backend_choices() == (*backend_names(), "auto")
    assert typing.get_args(ComputeBackend) == backend_names()
    assert typing.get_args(ComputeBackendChoice) == compute_backend_choices()
    key = short_key("moe.compute_backend")
    assert key is not None and key.annotation == ComputeBackendChoice
    assert resolved_at_startup("auto") and not any(resolved_at_startup(name) for name in backend_names())
    assert all(backend_name_error(name) is None for name in backend_names())
    auto_error = backend_name_error("auto")
    assert auto_error is not None and "resolved to a backend at start-up" in auto_error
    assert backend_unavailable_reason("auto") is None  # it picks only backends that run here
    with pytest.raises(ValueError, match="'auto' is already taken"):
        register_backend(ComputeBackendSpec(name="auto", grouped=reference_grouped))


def test_batched_mm_padded_equals_for_loop_up_to_summation_order():
    for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 0.0)):
        tensors, counts_E, grad_out = make_inputs([9, 0, 4, 17, 1], 32, 48, dtype, dtype, 5)
        expected = run_backend(reference_grouped, tensors, counts_E, grad_out)
        actual = run_backend(BACKENDS["batched_mm_padded"].grouped, tensors, counts_E, grad_out)
        for a, e in zip([actual[0], *actual[1]], [expected[0], *expected[1]]):
            assert relative_error(a, e) <= bound, dtype


# Layouts a caller may legally hand a backend: every one is a view of a larger tensor.
def strided_input(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A non-contiguous (or, for "contiguous", plain) tensor equal to ``x``."""
    rows, dim = x.shape
    if layout == "contiguous":
        return x.clone()
    if layout == "row_padded":  # row stride dim + 1: not 16-byte aligned
        wide = x.new_zeros(rows, dim + 1)
        wide[:, :dim] = x
        return wide[:, :dim]
    if layout == "column_major":
        return x.t().contiguous().t()
    if layout == "every_other_row":
        spaced = x.new_zeros(2 * rows, dim)
        spaced[::2] = x
        return spaced[::2]
    raise ValueError(layout)


# Incoming gradients of the shapes autograd hands a backend.
def incoming_gradient(out: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    if kind == "dense":
        return torch.randn(out.shape, generator=generator).to(out.device, out.dtype)
    if kind == "broadcast_scalar":  # out.sum().backward(): stride 0 in every dimension
        return out.new_ones(()).expand(out.shape)
    if kind == "broadcast_row":  # (out * v).sum().backward(): stride 0 across rows
        return torch.randn(out.shape[1], generator=generator).to(out.device, out.dtype).expand(out.shape)
    if kind == "transposed":
        return torch.randn(out.shape[::-1], generator=generator).to(out.device, out.dtype).t()
    raise ValueError(kind)


def run_with_layout(fn, tensors, counts_E, layout, gradient_kind):
    """Forward on a ``layout`` view of x, backward with a ``gradient_kind`` gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    x = strided_input(leaves[0], layout)
    out = fn(x, *leaves[1:], counts_E)
    out.backward(incoming_gradient(out, gradient_kind, torch.Generator().manual_seed(7)))
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    return out.detach(), grads


def assert_same_as_reference_with_layout(backend, counts, dim, hidden, layout, gradient_kind):
    tensors, counts_E, _ = make_inputs(counts, dim, hidden, torch.float32, torch.float32, 11, device_of(backend))
    expected_out, expected_grads = run_with_layout(reference_grouped, tensors, counts_E, layout, gradient_kind)
    actual_out, actual_grads = run_with_layout(BACKENDS[backend].grouped, tensors, counts_E, layout, gradient_kind)
    assert actual_out.shape == expected_out.shape
    assert relative_error(actual_out, expected_out) < TOLERANCE[torch.float32], "output"
    for name, actual, expected in zip(("x", "w1", "w2", "w3"), actual_grads, expected_grads):
        assert actual.shape == expected.shape, f"grad of {name}"
        assert relative_error(actual, expected) < TOLERANCE[torch.float32], f"grad of {name}"


GRADIENT_KINDS = ["dense", "broadcast_scalar", "broadcast_row", "transposed"]
LAYOUTS = ["contiguous", "row_padded", "column_major", "every_other_row"]


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gradient_kind", GRADIENT_KINDS)
def test_non_contiguous_input_with_every_gradient_shape(backend, layout, gradient_kind):
    """D = 16 (16-byte aligned in fp32): the strides, not the padding, are what is tested."""
    assert_same_as_reference_with_layout(backend, [3, 0, 4, 1], 16, 8, layout, gradient_kind)


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gradient_kind", GRADIENT_KINDS)
def test_one_routed_row_with_every_layout_and_gradient_shape(backend, layout, gradient_kind):
    """One row: ``is_contiguous`` ignores the stride of a size-1 dimension, ``torch._grouped_mm`` reads it
    (a row of a wider buffer, or a transposed gradient, has a row stride that is not 16-byte aligned)."""
    assert_same_as_reference_with_layout(backend, [0, 1, 0], 16, 8, layout, gradient_kind)


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dim", [16, 5])
@pytest.mark.parametrize("gradient_kind", GRADIENT_KINDS)
def test_zero_rows_with_every_gradient_shape(backend, dim, gradient_kind):
    assert_same_as_reference_with_layout(backend, [0, 0, 0], dim, 8, "contiguous", gradient_kind)


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dim,hidden", [(0, 8), (8, 0)])
def test_zero_width_features(backend, dim, hidden):
    assert_same_as_reference_with_layout(backend, [2, 0, 3], dim, hidden, "contiguous", "broadcast_scalar")


@pytest.mark.parametrize("backend", runnable_backends())
def test_experts_compute_in_the_autocast_dtype(backend):
    """Single-device training: fp32 parameters under autocast. ``torch._grouped_mm`` and the Triton
    kernels are not on autocast's list, so the layer casts its tokens to the autocast dtype (fp16
    here: Triton's CPU interpreter cannot run bf16) before dispatch and the expert block."""
    device = device_of(backend)
    config = moe_layer_config(compute_backend=backend, dim=16, hidden_dim=24, num_experts=4, top_k=2)
    layer = config.build().to(device)
    torch.manual_seed(0)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.2)
    spec = layer.routed_experts.inner_experts.backend
    seen_dtypes = []

    def spy(compute):
        def record_dtype(x, *args):
            seen_dtypes.append(x.dtype)
            return compute(x, *args)

        return record_dtype

    layer.routed_experts.inner_experts.backend = dataclasses.replace(
        spec, grouped=spy(spec.grouped), routed=spec.routed and spy(spec.routed)
    )
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.float16):
        out = layer(x)
    out.float().sum().backward()
    assert seen_dtypes == [torch.float16]
    assert all(
        param.grad.dtype == torch.float32 and torch.isfinite(param.grad).all()
        for param in layer.parameters()
        if param.grad is not None
    )
    assert x.grad is not None and x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


def test_grouped_mm_op_gradients_match_a_loop_and_keep_the_weights_layout():
    """``torchtitan_ext::grouped_mm``'s gradients against one matmul per group (fp32, an empty group
    included); the gradient of ``w.transpose(-2, -1)`` arrives in ``w``'s row-major layout, with no
    transposing copy, as torch's own formula gives it."""
    from torchtitan_ext.experiments.moe_backends.grouped_matmul import grouped_mm

    generator = torch.Generator().manual_seed(0)
    a_RK = torch.randn(10, 4, generator=generator, requires_grad=True)
    w_ENK = torch.randn(3, 8, 4, generator=generator, requires_grad=True)
    grad_RN = torch.randn(10, 8, generator=generator)
    offs_E = torch.tensor([3, 3, 10], dtype=torch.int32)
    w_EKN = w_ENK.transpose(-2, -1)
    gradient_strides = []
    w_EKN.register_hook(lambda grad: gradient_strides.append(grad.stride()))
    grouped_mm(a_RK, w_EKN, offs_E).backward(grad_RN)
    assert gradient_strides == [w_EKN.stride()]  # the op's weight gradient has the weight's layout
    a_ref, w_ref = a_RK.detach().clone().requires_grad_(), w_ENK.detach().clone().requires_grad_()
    starts = [0, *offs_E.tolist()[:-1]]
    rows = [a_ref[start:end] @ w_ref[e].T for e, (start, end) in enumerate(zip(starts, offs_E.tolist()))]
    torch.cat(rows).backward(grad_RN)
    assert a_RK.grad is not None and w_ENK.grad is not None
    torch.testing.assert_close(a_RK.grad, a_ref.grad)
    torch.testing.assert_close(w_ENK.grad, w_ref.grad)
