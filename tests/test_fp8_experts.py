"""FP8 rowwise experts on CPU: the quantisation rule, the emulated GEMMs and the Triton FP8 GEMM (in
Triton's interpreter, e4m3 operands) held to the plain-torch reference (forward and every gradient),
compiled equal to eager, and the switches (``moe.expert_precision`` and torchtitan's float8
grouped-experts converter) with their refusals. GPU: test_fp8_experts_gpu.py."""

import logging

import pytest
import torch
from helpers import (
    assert_swiglu_kernels_match_torch,
    fp8_experts_saved,
    fresh_buffers_hold_nan,
    model_config,
    nested_configs,
    saved_elements,
    tensors_saved_for_backward,
)
from torchtitan.components.quantization.float8 import Float8GroupedExpertsConverter
from torchtitan.components.quantization.mx import MXFP8GroupedExpertsConverter
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from torchtitan_ext import registry
from torchtitan_ext.bench.common import relative_error
from torchtitan_ext.config import ConfigError
from torchtitan_ext.experiments.moe_backends.dispatcher import RoutingDispatcher
from torchtitan_ext.experiments.moe_backends.ep_check import seeded_layer
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts, grouped_mm_experts
from torchtitan_ext.experiments.moe_backends.fp8_experts import (
    E4M3_MAX,
    fp8_grouped_experts,
    fp8_routed_experts,
    fp8_unavailable_reason,
    quantize_dequantize,
    quantize_rowwise,
    quantize_stacked_rows,
    quantize_stacked_rows_transposed,
    reference_fp8_experts,
    reference_routed_fp8_experts,
)
from torchtitan_ext.experiments.moe_backends.layer import moe_layer_config, with_expert_precision
from torchtitan_ext.kernels import fp8_quantize, fp8_swiglu
from torchtitan_ext.kernels.availability import interpreter_enabled
from torchtitan_ext.kernels.fp8_grouped_gemm import fp8_grouped_gemm
from torchtitan_ext.kernels.fp8_quantize import (
    permute_quantize_rows,
    quantize_activation_rows,
    quantize_rows,
    quantize_rows_transposed,
)
from torchtitan_ext.kernels.fp8_swiglu import swiglu_backward_quantize_rows, swiglu_quantize_rows
from torchtitan_ext.registry import Flavor, get_flavor
from torchtitan_ext.run_training import FlavorConfigManager

interpreted_kernels = pytest.mark.skipif(
    not interpreter_enabled(),
    reason="the Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py "
    "where there is no CUDA); test_fp8_experts_gpu.py checks them on CUDA",
)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton kernels run here: the refusals of their launchers are checked on tensors there."""
COUNT_CASES = {"mixed_with_an_empty_expert": [9, 0, 17, 6], "one_expert": [13], "one_row_each": [1, 1, 1]}


def expert_inputs(counts: list[int], dim: int, hidden: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    experts = len(counts)
    shapes = [(sum(counts), dim), (experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim)]
    scales = [1.0, dim**-0.5, hidden**-0.5, dim**-0.5]
    return [(torch.randn(*s, generator=generator) * c).requires_grad_() for s, c in zip(shapes, scales, strict=True)]


def forward_and_gradients(
    compute, inputs: list[torch.Tensor], counts: list[int], *after_counts: torch.Tensor, **kwargs
) -> list[torch.Tensor]:
    """The output and the gradient of every input, ``after_counts`` (the row scores) passed after the
    counts and differentiated too."""
    out = compute(*inputs, torch.tensor(counts), *after_counts, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return [out.detach(), *torch.autograd.grad(out, [*inputs, *after_counts], grad)]


def test_rowwise_scales_are_powers_of_two_and_fill_the_e4m3_range():
    x = torch.tensor([[3.0, -0.5, 0.25], [0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3], [500.0, 1.0, -1.0]])
    values, inverse = quantize_rowwise(x)
    assert values.dtype == torch.float8_e4m3fn and inverse.shape == (4, 1)
    assert torch.equal(torch.exp2(torch.log2(inverse).round()), inverse)
    row_amax = values.float().abs().amax(dim=-1)
    assert torch.all((row_amax[[0, 2, 3]] > E4M3_MAX / 2) & (row_amax[[0, 2, 3]] <= E4M3_MAX))
    assert torch.equal(values[1].float(), torch.zeros(3))
    assert torch.equal(quantize_dequantize(x[[0]]), torch.tensor([[3.0, -0.5, 0.25]]))  # exact in e4m3


def test_quantize_dequantize_rounds_to_three_mantissa_bits():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    rounded = quantize_dequantize(x)
    normal = x.abs() > x.abs().amax(dim=-1, keepdim=True) * 2**-6  # e4m3 normals below the row's amax
    assert torch.all((rounded - x).abs()[normal] <= x.abs()[normal] * 2**-4)
    assert (rounded - x).abs().max() > 0


def rounding_cases(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Normal values times powers of two from 2^-12 to 2^3, so that scaled to a row's or column's range
    they round every way e4m3 rounds: within a binade, up into the next exponent, to subnormals and to
    zero (Triton's interpreter casts the carries and the subnormals wrongly; the kernels round in fp32
    first)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * 2.0 ** torch.randint(-12, 4, shape, generator=generator)


def assert_rounds_into_the_next_exponent_and_to_subnormals(values: torch.Tensor, inverse: torch.Tensor, x) -> None:
    """``x``'s e4m3 ``values`` include a value rounded up into the next power of two and subnormals, so
    the test holding a kernel to the rule sees both roundings (``x`` scaled as ``values``)."""
    scaled = x / inverse
    rounded = values.float()
    mantissa_carried = (
        (rounded.abs() == 2.0 ** torch.floor(torch.log2(rounded.abs())))
        & (rounded.abs() > scaled.abs())
        & (rounded.abs() >= 2**-6)
    )
    assert mantissa_carried.any()
    assert ((rounded.abs() < 2**-6) & (rounded != 0)).any()


@interpreted_kernels
@pytest.mark.parametrize(
    "part_shapes",
    [[(3, 140, 70)], [(2, 24, 33), (2, 72, 33)]],
    ids=["one_part_masked_tiles", "gate_and_up_in_one_tile"],
)
def test_the_transposing_kernel_stores_each_expert_quantised_whole_transposed(part_shapes):
    """Each expert's stack scaled by the largest of its inverse row scales from the row kernel, laid out
    [E, K, N]: bit-equal to the plain-torch rule transposed, every rounding included, and to the rule
    applied to the whole expert (its scale the row kernel's largest inverse)."""
    parts = [rounding_cases(shape, seed) for seed, shape in enumerate(part_shapes)]
    for part in parts:
        part[1] = 0  # an expert of zeros: scaled as SMALLEST_AMAX, values zero
    _, row_inverse = quantize_rows(parts)
    inverse = row_inverse.amax(1, keepdim=True)
    values = quantize_rows_transposed(parts, inverse)
    expected = quantize_stacked_rows_transposed(parts, inverse, emulated=True)
    stacked = torch.cat(parts, dim=1)
    assert values.shape == (part_shapes[0][0], part_shapes[0][2], stacked.shape[1]) and values.is_contiguous()
    assert torch.equal(values.view(torch.uint8), expected.view(torch.uint8))
    whole_experts, whole_inverse = quantize_rowwise(stacked.flatten(1))
    assert torch.equal(whole_inverse[:, :, None], inverse)
    assert torch.equal(values.mT.flatten(1).view(torch.uint8), whole_experts.view(torch.uint8))
    assert (values[1].view(torch.uint8) == 0).all()
    assert_rounds_into_the_next_exponent_and_to_subnormals(values, inverse, stacked.mT)


@pytest.mark.parametrize(
    "inverse_shape, dtype", [((2, 8, 1), torch.float32), ((2, 1), torch.float32), ((2, 1, 1), torch.float16)]
)
def test_the_transposing_kernel_refuses_scales_of_another_shape_or_dtype(inverse_shape, dtype):
    parts = [torch.ones(2, 4, 8, device=KERNEL_DEVICE)] * 2
    with pytest.raises(ValueError, match=r"experts' inverse scales must be fp32 \[E, 1, 1\] = \[2, 1, 1\]"):
        quantize_rows_transposed(parts, torch.ones(inverse_shape, dtype=dtype, device=KERNEL_DEVICE))


@interpreted_kernels
@pytest.mark.parametrize(
    "part_shapes",
    [[(3, 40, 70)], [(2, 24, 33), (2, 75, 33)], [(2, 5, 5000)]],
    ids=["one_part_masked_row", "gate_and_up_rows_of_both_in_one_program", "one_row_per_program"],
)
def test_the_row_quantisation_kernel_is_the_plain_torch_rule(part_shapes):
    parts = [rounding_cases(shape, seed) for seed, shape in enumerate(part_shapes)]
    parts[0][1, 2] = 0  # a row of zeros: scaled as SMALLEST_AMAX, values zero
    values, inverse = quantize_rows(parts)
    expected_values, expected_inverse = quantize_stacked_rows(parts, emulated=True)
    stacked_rows = sum(shape[1] for shape in part_shapes)
    assert values.shape == (part_shapes[0][0], stacked_rows, part_shapes[0][2]) and values.is_contiguous()
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(inverse, expected_inverse)
    assert_rounds_into_the_next_exponent_and_to_subnormals(values, inverse, torch.cat(parts, dim=1))


@interpreted_kernels
@pytest.mark.parametrize(
    "part_cols, block",
    [((70,), None), ((24, 40), None), ((24, 40), 16), ((300,), 128)],
    ids=["one_part", "gradients_of_gate_and_up", "two_parts_in_blocks", "one_part_in_blocks"],
)
def test_the_activation_quantisation_kernel_is_the_plain_torch_rule_on_the_experts_rows(part_cols, block, monkeypatch):
    """The rows of the parts joined along K (``[d gate, d up]``), one part read through a row stride
    wider than its columns; rows longer than the kernel's block (``block``) in two passes; an empty
    expert between two others. The experts' rows equal the
    plain-torch rule; the rows after them are not written (NaN from the fresh buffers: e4m3 NaN is 0x7f
    or 0xff)."""
    if block is not None:
        monkeypatch.setattr(fp8_quantize, "ACTIVATION_BLOCK", block)
    experts_rows, after = 37, 4
    wide = rounding_cases((experts_rows + after, part_cols[0] + 8), 0)
    parts = [wide[:, : part_cols[0]], *(rounding_cases((experts_rows + after, c), 1) for c in part_cols[1:])]
    parts[0][3] = 0  # a row of zeros: scaled as SMALLEST_AMAX, values zero
    group_end = torch.tensor([10, 10, experts_rows], dtype=torch.int32)
    joined = torch.cat(parts, dim=1)[:experts_rows]
    with fresh_buffers_hold_nan():
        values, inverse = quantize_activation_rows(parts, group_end)
    expected_values, expected_inverse = quantize_rowwise(joined)
    assert values.shape == (experts_rows + after, sum(part_cols)) and values.is_contiguous()
    assert torch.equal(values[:experts_rows].view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(inverse[:experts_rows], expected_inverse)
    assert_rounds_into_the_next_exponent_and_to_subnormals(values[:experts_rows], inverse[:experts_rows], joined)
    assert inverse[experts_rows:].isnan().all()
    assert (values[experts_rows:].view(torch.uint8) & 0x7F == 0x7F).all()


@pytest.mark.parametrize(
    "parts, message",
    [
        ([], "1 to 2 activation parts"),
        ([torch.zeros(4, 8)] * 3, "1 to 2 activation parts"),
        ([torch.zeros(4, 8), torch.zeros(5, 8)], r"must be \[R, P\] tensors of one R and dtype"),
        ([torch.zeros(4, 8), torch.zeros(4, 8).half()], r"must be \[R, P\] tensors of one R and dtype"),
        ([torch.zeros(4, 2, 8)], r"must be \[R, P\] tensors of one R and dtype"),
    ],
)
def test_the_activation_quantisation_kernel_refuses_mismatched_parts(parts, message):
    with pytest.raises(ValueError, match=message):
        quantize_activation_rows([p.to(KERNEL_DEVICE) for p in parts], torch.tensor([4], dtype=torch.int32))


def swiglu_kernel_inputs(hidden: int, dtype: torch.dtype, with_scores: bool, experts_rows: int, after: int):
    """``(gate_up [R, 2F], the gradient of a [R, F], row scores or None)`` for the SwiGLU kernels, values
    spread over 2^-12 to 2^3 so that the quantised rows round every way e4m3 rounds."""
    num_rows = experts_rows + after
    gate_up = rounding_cases((num_rows, 2 * hidden), 0).to(dtype)
    grad_a = rounding_cases((num_rows, hidden), 1).to(dtype)
    scores = row_scores(num_rows).detach() if with_scores else None
    return gate_up, grad_a, scores


SWIGLU_KERNEL_CASES = {
    "one_block_fp32": (40, None, False, torch.float32),
    "one_block_scores_fp16": (40, None, True, torch.float16),
    "in_blocks_scores_fp32": (40, 16, True, torch.float32),
    "in_blocks_fp16": (40, 16, False, torch.float16),
}


@interpreted_kernels
@pytest.mark.parametrize(
    "hidden, block, with_scores, dtype", SWIGLU_KERNEL_CASES.values(), ids=list(SWIGLU_KERNEL_CASES)
)
def test_the_swiglu_kernels_compute_the_swiglu_and_quantise_what_they_write(
    hidden, block, with_scores, dtype, monkeypatch
):
    """Forward: e4m3 rows bit-equal to the plain-torch rule applied to ``a = silu(gate) * up * score`` as the
    backward writes it. Backward: ``a``, the gate, up and score gradients equal plain torch's autograd
    (fp64) up to rounding to the activations' dtype, and ``[d gate, d up]`` quantised bit-equal to the rule
    applied to the gradients it writes. Rows longer than the kernels' block (``block``) in blocks; the
    rows after the experts' are not written (NaN from the fresh buffers) and get a zero score gradient."""
    if block is not None:
        monkeypatch.setattr(fp8_swiglu, "SWIGLU_BLOCK", block)
    experts_rows, after = 37, 4
    gate_up, grad_a, scores = swiglu_kernel_inputs(hidden, dtype, with_scores, experts_rows, after)
    group_end = torch.tensor([10, 10, experts_rows], dtype=torch.int32)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-3
    values, inverse, a = assert_swiglu_kernels_match_torch(gate_up, grad_a, scores, group_end, tolerance)
    assert_rounds_into_the_next_exponent_and_to_subnormals(values[:experts_rows], inverse[:experts_rows], a.float())


@interpreted_kernels
@pytest.mark.parametrize("dim, block", [(70, None), (300, 128)], ids=["one_block", "in_blocks"])
def test_the_permute_kernel_copies_and_quantises_each_token_to_its_slots_rows(dim, block, monkeypatch):
    """Each kept slot's row holds its token's row and the token's e4m3 row, bit-equal to the plain-torch
    rule (one scale per token); dropped slots (-1) and rows no slot maps to are not written (NaN from the
    fresh buffers); rows longer than the kernel's block (``block``) in two passes."""
    if block is not None:
        monkeypatch.setattr(fp8_quantize, "ACTIVATION_BLOCK", block)
    tokens, top_k = 9, 2
    x = rounding_cases((tokens, dim), 0)
    x[3] = 0  # a token of zeros: scaled as SMALLEST_AMAX, values zero
    num_rows = tokens * top_k + 3
    dest = torch.randperm(num_rows, generator=torch.Generator().manual_seed(2))[: tokens * top_k].to(torch.int32)
    dest[[1, 6]] = -1
    with fresh_buffers_hold_nan():
        rows, values, inverse = permute_quantize_rows(x, dest, top_k, num_rows)
    kept = dest >= 0
    written = dest[kept].long()
    tokens_rows = x[torch.arange(tokens * top_k)[kept] // top_k]
    expected_values, expected_inverse = quantize_rowwise(tokens_rows)
    assert torch.equal(rows[written], tokens_rows)
    assert torch.equal(values[written].view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(inverse[written], expected_inverse)
    assert_rounds_into_the_next_exponent_and_to_subnormals(values[written], inverse[written], tokens_rows)
    unwritten = torch.ones(num_rows, dtype=torch.bool)
    unwritten[written] = False
    assert rows[unwritten].isnan().all() and inverse[unwritten].isnan().all()
    assert (values[unwritten].view(torch.uint8) & 0x7F == 0x7F).all()


@interpreted_kernels
@pytest.mark.parametrize("dim, hidden", [(32, 48), (40, 24)], ids=["aligned", "padded"])
def test_routed_triton_fp8_experts_equal_the_reference(dim, hidden):
    """The single-device FP8 path (tokens permuted and quantised in one kernel, the output gradient too):
    forward and the gradients of the tokens, the weights and the scores, with a dropped slot and an
    expert no token chose; compiled whole (``fullgraph=True``), the same as eager."""
    tokens, top_k = 12, 2
    x, w1, w2, w3 = expert_inputs([3, 3, 3, 3], dim, hidden)
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 3, (tokens, top_k), generator=generator)
    ids[2, 1] = 4  # dropped (expert E); expert 3 gets no slot
    scores = (torch.rand(tokens, top_k, generator=generator) * 0.9 + 0.1).requires_grad_()
    leaves = [x, w1, w2, w3, scores]
    grad = torch.randn(tokens, dim, generator=generator)
    out = fp8_routed_experts(x, w1, w2, w3, ids, scores, gemm="triton")
    actual = [out.detach(), *torch.autograd.grad(out, leaves, grad)]
    expected_out = reference_routed_fp8_experts(x, w1, w2, w3, ids, scores)
    expected = [expected_out.detach(), *torch.autograd.grad(expected_out, leaves, grad)]
    for name, got, wanted in zip(["out", "x", "w1", "w2", "w3", "scores"], actual, expected, strict=True):
        assert relative_error(got, wanted) <= 1e-5, name
    assert (actual[-1][2, 1] == 0).all()
    torch._dynamo.reset()
    compiled = torch.compile(fp8_routed_experts, fullgraph=True, backend="aot_eager")
    out = compiled(x, w1, w2, w3, ids, scores, gemm="triton")
    for name, got, wanted in zip(
        ["compiled out", "compiled x", "compiled w1", "compiled w2", "compiled w3", "compiled scores"],
        [out.detach(), *torch.autograd.grad(out, leaves, grad)],
        actual,
        strict=True,
    ):
        assert relative_error(got, wanted) <= 1e-6, name


@pytest.mark.parametrize(
    "gate_up_shape, scores_shape, group_end_dtype, grad_shape, message",
    [
        ((8, 7), None, torch.int32, (8, 3), r"one \[R, 2F\] tensor with unit column stride"),
        ((8, 8), (7,), torch.int32, (8, 4), r"row scores must have shape \(8,\)"),
        ((8, 8), None, torch.int64, (8, 4), "group_end must be a 1-D int32 tensor"),
        ((8, 8), None, torch.int32, (8, 8), r"the gradient must be \[R, F\] = \[8, 4\]"),
    ],
    ids=["odd_columns", "scores_of_other_rows", "int64_group_ends", "gradient_of_other_columns"],
)
def test_the_swiglu_kernels_refuse_mismatched_arguments(
    gate_up_shape, scores_shape, group_end_dtype, grad_shape, message
):
    gate_up = torch.zeros(gate_up_shape, device=KERNEL_DEVICE)
    scores = torch.ones(scores_shape, device=KERNEL_DEVICE) if scores_shape is not None else None
    group_end = torch.tensor([8], dtype=group_end_dtype, device=KERNEL_DEVICE)
    grad = torch.zeros(grad_shape, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=message):
        swiglu_backward_quantize_rows(grad, gate_up, scores, group_end)
    if grad_shape[1] * 2 == gate_up_shape[1]:
        with pytest.raises(ValueError, match=message):
            swiglu_quantize_rows(gate_up, scores, group_end)


@pytest.mark.parametrize(
    "quantize",
    [quantize_rows, lambda parts: quantize_rows_transposed(parts, torch.ones(2, 1, 1, device=KERNEL_DEVICE))],
    ids=["rows", "rows_transposed"],
)
def test_the_weight_quantisation_kernels_refuse_mismatched_parts(quantize):
    with pytest.raises(ValueError, match=r"must be \[E, P, K\] tensors of one E, K and dtype"):
        quantize([torch.ones(2, 4, 8, device=KERNEL_DEVICE), torch.ones(2, 4, 16, device=KERNEL_DEVICE)])
    with pytest.raises(ValueError, match="1 to 2 weight parts"):
        quantize([torch.ones(2, 4, 8, device=KERNEL_DEVICE)] * 3)


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("dim, hidden", [(32, 48), (40, 24)], ids=["aligned", "padded"])
def test_emulated_fp8_experts_equal_the_reference(case, dim, hidden):
    counts = COUNT_CASES[case]
    inputs = expert_inputs(counts, dim, hidden)
    emulated = forward_and_gradients(fp8_grouped_experts, inputs, counts, emulated=True)
    reference = forward_and_gradients(reference_fp8_experts, inputs, counts)
    for name, actual, expected in zip(["out", "x", "w1", "w2", "w3"], emulated, reference, strict=True):
        assert relative_error(actual, expected) <= 1e-6, name


@interpreted_kernels
@pytest.mark.parametrize("case", COUNT_CASES)
def test_the_triton_fp8_gemm_is_the_gemm_of_the_dequantised_operands(case):
    """Each expert's rows times its e4m3 weight, scaled per row and column; the rows past the last
    expert are not written (NaN from the fresh buffer here)."""
    counts = COUNT_CASES[case]
    generator = torch.Generator().manual_seed(3)
    grouped = sum(counts)
    num_rows, dim, cols = grouped + 2, 48, 40
    a_values, a_inverse = quantize_rowwise(torch.randn(num_rows, dim, generator=generator))
    w_values, w_inverse = quantize_rowwise(torch.randn(len(counts), cols, dim, generator=generator))
    group_end = torch.tensor(counts).cumsum(0).to(torch.int32)
    with fresh_buffers_hold_nan():
        out = fp8_grouped_gemm(a_values, a_inverse, w_values, w_inverse, group_end, torch.float32)
    expected = torch.zeros(grouped, cols)
    start = 0
    for expert, count in enumerate(counts):
        rows = slice(start, start + count)
        expected[rows] = (a_values[rows].float() * a_inverse[rows]) @ (w_values[expert].float() * w_inverse[expert]).T
        start += count
    torch.testing.assert_close(out[:grouped], expected, rtol=1e-6, atol=1e-5)
    assert out[grouped:].isnan().all()


@interpreted_kernels
@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("dim, hidden", [(32, 48), (40, 24)], ids=["aligned", "padded"])
def test_triton_fp8_experts_equal_the_reference(case, dim, hidden):
    counts = COUNT_CASES[case]
    inputs = expert_inputs(counts, dim, hidden)
    triton_fp8 = forward_and_gradients(fp8_grouped_experts, inputs, counts, emulated=False, gemm="triton")
    reference = forward_and_gradients(reference_fp8_experts, inputs, counts)
    for name, actual, expected in zip(["out", "x", "w1", "w2", "w3"], triton_fp8, reference, strict=True):
        assert relative_error(actual, expected) <= 1e-5, name


def row_scores(num_rows: int, seed: int = 5) -> torch.Tensor:
    """One router score per row, in (0.1, 1), differentiable."""
    scores = torch.rand(num_rows, generator=torch.Generator().manual_seed(seed)) * 0.9 + 0.1
    return scores.requires_grad_()


ROW_WEIGHTED_FP8_GEMMS = {
    "emulated": ({"emulated": True}, expert_inputs, 1e-6),
    "triton": pytest.param(({"emulated": False, "gemm": "triton"}, expert_inputs, 1e-5), marks=interpreted_kernels),
}


@pytest.mark.parametrize("gemm", ROW_WEIGHTED_FP8_GEMMS.values(), ids=list(ROW_WEIGHTED_FP8_GEMMS))
@pytest.mark.parametrize("case", COUNT_CASES)
def test_row_weighted_fp8_experts_equal_the_reference(gemm, case):
    """FP8 experts weighting their rows (``experts_apply_scores``): the down projection's input rows times
    their scores, then quantised; forward and every gradient, the scores' too."""
    kwargs, make_inputs, tolerance = gemm
    counts = COUNT_CASES[case]
    inputs = make_inputs(counts, 40, 24)
    scores = row_scores(sum(counts))
    fp8 = forward_and_gradients(fp8_grouped_experts, inputs, counts, scores, **kwargs)
    reference = forward_and_gradients(reference_fp8_experts, inputs, counts, scores)
    for name, actual, expected in zip(["out", "x", "w1", "w2", "w3", "scores"], fp8, reference, strict=True):
        assert relative_error(actual, expected) <= tolerance, name


@pytest.mark.parametrize("gemm", ROW_WEIGHTED_FP8_GEMMS.values(), ids=list(ROW_WEIGHTED_FP8_GEMMS))
def test_row_weighted_fp8_experts_read_no_row_after_the_experts(gemm):
    """Static received rows: rows after the experts' unset (NaN here) with score 0, their output
    gradients unset (NaN), and every fresh buffer NaN (rows a GEMM leaves unwritten). The experts'
    rows of the output and of the input and score gradients, and every weight gradient, equal the
    reference's: no quantisation, GEMM or gradient reads them."""
    kwargs, make_inputs, tolerance = gemm
    counts, after = COUNT_CASES["mixed_with_an_empty_expert"], 5
    grouped = sum(counts)
    x, w1, w2, w3 = make_inputs(counts, 40, 24)
    x = torch.cat([x.detach(), torch.full((after, x.shape[1]), float("nan"))]).requires_grad_()
    scores = torch.cat([row_scores(grouped).detach(), torch.zeros(after)]).requires_grad_()
    leaves = [x, w1, w2, w3, scores]
    grad = torch.randn(grouped + after, x.shape[1], generator=torch.Generator().manual_seed(1))
    grad[grouped:] = float("nan")
    with fresh_buffers_hold_nan():
        out = fp8_grouped_experts(x, w1, w2, w3, torch.tensor(counts), scores, **kwargs)
        actual = [out.detach(), *torch.autograd.grad(out, leaves, grad)]
    reference_out = reference_fp8_experts(x, w1, w2, w3, torch.tensor(counts), scores)
    expected = [reference_out.detach(), *torch.autograd.grad(reference_out, leaves, grad[:grouped])]
    for name, got, wanted in zip(["out", "x", "w1", "w2", "w3", "scores"], actual, expected, strict=True):
        rows = slice(None) if name.startswith("w") else slice(grouped)
        assert relative_error(got[rows], wanted[rows]) <= tolerance, name


def test_row_weighted_fp8_experts_weight_each_row_by_its_score():
    """The reference's weighting is the native one up to e4m3 rounding: each output row times its score."""
    counts = COUNT_CASES["mixed_with_an_empty_expert"]
    x, w1, w2, w3 = expert_inputs(counts, 64, 96)
    scores = row_scores(sum(counts))
    weighted = reference_fp8_experts(x, w1, w2, w3, torch.tensor(counts), scores)
    unweighted = reference_fp8_experts(x, w1, w2, w3, torch.tensor(counts))
    assert relative_error(weighted, unweighted * scores[:, None]) < 0.1
    assert relative_error(weighted, unweighted) > 0.2


@interpreted_kernels
def test_compiled_triton_fp8_experts_equal_eager():
    counts = COUNT_CASES["mixed_with_an_empty_expert"]
    inputs = expert_inputs(counts, 40, 24)
    eager = forward_and_gradients(fp8_grouped_experts, inputs, counts, emulated=False, gemm="triton")
    torch._dynamo.reset()
    compiled = torch.compile(fp8_grouped_experts, fullgraph=True, backend="aot_eager")
    for name, actual, expected in zip(
        ["out", "x", "w1", "w2", "w3"],
        forward_and_gradients(compiled, inputs, counts, emulated=False, gemm="triton"),
        eager,
        strict=True,
    ):
        assert relative_error(actual, expected) <= 1e-6, name


@interpreted_kernels
def test_compiled_triton_fp8_experts_save_no_more_than_the_native_experts():
    """No e4m3 copy is kept from the forward to the backward (FSDP frees the gathered weights after the
    forward, not copies of them): the compiled graph saves ``fp8_experts_saved``, no more elements than
    the bf16 experts save besides the two per-expert weight scales (the SwiGLU output is written again
    in the backward)."""
    counts = COUNT_CASES["mixed_with_an_empty_expert"]
    inputs = expert_inputs(counts, 32, 48)
    native = tensors_saved_for_backward(grouped_mm_experts, inputs, torch.tensor(counts))
    fp8 = tensors_saved_for_backward(fp8_grouped_experts, inputs, torch.tensor(counts), emulated=False, gemm="triton")
    assert fp8 == fp8_experts_saved(inputs[0], inputs[1], len(counts))
    assert saved_elements(fp8) <= saved_elements(native) + 2 * len(counts)


@interpreted_kernels
def test_compiled_triton_fp8_experts_keep_fp32_weights_as_they_are():
    """fp32 weights beside fp16 activations (the routed experts outside FSDP, or fp32 parameters under autocast):
    the compiled graph saves the weights themselves for the backward, no copy in the activations' dtype,
    and the same tensors as when the weights come in the activations' dtype."""
    counts = COUNT_CASES["mixed_with_an_empty_expert"]
    x, *weights = expert_inputs(counts, 32, 48)
    x = x.detach().half().requires_grad_()
    half_weights = [w.detach().half().requires_grad_() for w in weights]
    fp32 = tensors_saved_for_backward(
        fp8_grouped_experts, [x, *weights], torch.tensor(counts), emulated=False, gemm="triton"
    )
    half = tensors_saved_for_backward(
        fp8_grouped_experts, [x, *half_weights], torch.tensor(counts), emulated=False, gemm="triton"
    )
    assert [("input 1", torch.float32), ("input 2", torch.float32), ("input 3", torch.float32)] == [
        (name, dtype) for name, dtype, _ in fp32 if name in ("input 1", "input 2", "input 3")
    ]
    assert [(name, shape) for name, _, shape in fp32] == [(name, shape) for name, _, shape in half]


def test_fp8_experts_quantise_fp32_weights_from_their_own_values():
    """Weights 1.0634765625 x 2^j: e4m3 rounds them to 1.125 x 2^j, but rounded to bf16 first (1.0625, a tie)
    to 1.0 x 2^j. Beside bf16 activations the FP8 experts quantise the fp32 weights as the reference does
    (bf16 rounding of the activations aside) and return fp32 weight gradients."""
    counts = COUNT_CASES["mixed_with_an_empty_expert"]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 32, generator=generator).bfloat16().requires_grad_()

    def weight(*shape: int) -> torch.Tensor:
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        return (sign * (1 + 2**-4 + 2**-10) * 2.0 ** torch.randint(0, 3, shape, generator=generator)).requires_grad_()

    inputs = [x, weight(4, 48, 32), weight(4, 32, 48), weight(4, 48, 32)]
    fp8 = forward_and_gradients(fp8_grouped_experts, inputs, counts, emulated=True)
    reference = forward_and_gradients(reference_fp8_experts, inputs, counts)
    assert [t.dtype for t in fp8[2:]] == [torch.float32] * 3
    for name, actual, expected in zip(["out", "x", "w1", "w2", "w3"], fp8, reference, strict=True):
        assert relative_error(actual.float(), expected.float()) <= 0.05, name


def test_fp8_experts_differ_from_native_by_e4m3_rounding():
    """FP8 is really on (not bf16 under another name): every output and gradient moves by a few percent."""
    counts = COUNT_CASES["mixed_with_an_empty_expert"]
    inputs = expert_inputs(counts, 64, 96)
    fp8 = forward_and_gradients(fp8_grouped_experts, inputs, counts, emulated=True)
    native = forward_and_gradients(grouped_mm_experts, inputs, counts)
    for name, actual, expected in zip(["out", "x", "w1", "w2", "w3"], fp8, native, strict=True):
        assert 1e-3 < relative_error(actual, expected) < 0.15, name


def test_compiled_fp8_experts_equal_eager():
    counts = COUNT_CASES["mixed_with_an_empty_expert"]
    inputs = expert_inputs(counts, 40, 24)
    eager = forward_and_gradients(fp8_grouped_experts, inputs, counts, emulated=True)
    torch._dynamo.reset()
    compiled = torch.compile(fp8_grouped_experts, fullgraph=True, backend="aot_eager")
    for name, actual, expected in zip(
        ["out", "x", "w1", "w2", "w3"],
        forward_and_gradients(compiled, inputs, counts, emulated=True),
        eager,
        strict=True,
    ):
        assert relative_error(actual, expected) <= 1e-6, name


@pytest.mark.parametrize("backend, gemm", [("triton", "triton"), ("grouped_mm", "torch")])
@pytest.mark.parametrize(
    "precision, routed",
    [pytest.param("fp8_rowwise", True, marks=interpreted_kernels), ("fp8_rowwise_emulated", False)],
    ids=["fp8_rowwise", "emulated"],
)
def test_fp8_experts_take_the_routed_path_on_one_device_unless_emulated(backend, gemm, precision, routed):
    """FP8 ``triton`` and ``grouped_mm`` on one device permute their tokens themselves
    (``fp8_routed_experts`` with the backend's FP8 GEMM); the emulation takes the dispatcher's rows."""
    shape = {"dim": 32, "hidden_dim": 48, "num_experts": 4, "top_k": 2}
    layer = seeded_layer(with_expert_precision(moe_layer_config(compute_backend=backend, **shape), precision))
    experts = layer.routed_experts.inner_experts
    assert (experts.routed is not None) == routed
    if routed:
        assert experts.routed.func is fp8_routed_experts
        assert experts.routed.keywords == {"gemm": gemm}


@pytest.mark.parametrize(
    "backend, precision, tolerance",
    [
        ("grouped_mm", "fp8_rowwise_emulated", 1e-5),
        pytest.param("triton", "fp8_rowwise", 0.1, marks=interpreted_kernels),
    ],
    ids=["grouped_mm", "triton"],
)
def test_a_layer_built_with_fp8_computes_in_fp8(backend, precision, tolerance):
    """The layer's experts compute in FP8 (Triton's kernels in the interpreter here): e4m3 rounding away
    from the native layer, and the emulation's numbers. On one device ``triton`` takes its FP8 routed
    path, which weights each row before the down projection (the emulation weights the outputs), so
    they differ by e4m3 rounding there (the path is held to its own reference above)."""
    shape = {"dim": 32, "hidden_dim": 48, "num_experts": 4, "top_k": 2}
    native = seeded_layer(moe_layer_config(compute_backend=backend, **shape))
    fp8 = seeded_layer(with_expert_precision(moe_layer_config(compute_backend=backend, **shape), precision))
    emulated = seeded_layer(
        with_expert_precision(moe_layer_config(compute_backend="grouped_mm", **shape), "fp8_rowwise_emulated")
    )
    x = torch.randn(2, 8, 32)
    assert f"compute_backend={backend}, expert_precision={precision}" in repr(fp8)
    assert 1e-3 < relative_error(fp8(x), native(x)) < 0.15
    assert relative_error(fp8(x), emulated(x)) <= tolerance


def parse(monkeypatch, *args: str):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return FlavorConfigManager().parse_args([*args, "--training.steps", "1"])


def precisions(config) -> set[str]:
    return {e.expert_precision for e in nested_configs(config, BackendGroupedExperts.Config)}


def test_expert_precision_key_sets_every_layer_and_the_start_up_line_says_so(monkeypatch, caplog):
    with caplog.at_level(logging.INFO):
        config = parse(monkeypatch, "--flavor", "tiny-moe-grouped-mm", "--moe.expert_precision", "fp8_rowwise_emulated")
    assert precisions(config) == {"fp8_rowwise_emulated"}
    assert "compute_backend=grouped_mm, expert_precision=fp8_rowwise_emulated," in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of FP8 GEMMs without CUDA")
def test_fp8_on_cpu_is_refused_naming_the_emulation(monkeypatch):
    with pytest.raises(
        ConfigError, match=r"moe\.expert_precision = 'fp8_rowwise'.*need a CUDA GPU.*fp8_rowwise_emulated"
    ):
        parse(monkeypatch, "--flavor", "tiny-moe-grouped-mm", "--moe.expert_precision", "fp8_rowwise")


@pytest.mark.parametrize("backend", ["for_loop", "batched_mm_padded", "auto"])
def test_backends_without_fp8_gemms_are_refused_naming_those_with(monkeypatch, backend):
    args = ["--flavor", "tiny-moe-grouped-mm", "--moe.compute_backend", backend]
    with pytest.raises(
        ConfigError,
        match=r"^command line: moe\.expert_precision = 'fp8_rowwise_emulated'.*compute with grouped_mm or triton",
    ):
        parse(monkeypatch, *args, "--moe.expert_precision", "fp8_rowwise_emulated")


def test_fp8_with_recomputed_preactivations_in_some_layers_is_refused_naming_that_key(monkeypatch):
    args = ["--flavor", "tiny-moe-triton", "--moe.expert_precision", "fp8_rowwise_emulated"]
    with pytest.raises(
        ConfigError,
        match=r"^command line: moe\.recompute_preactivations_layers sets moe\.recompute_preactivations = true: ",
    ):
        parse(monkeypatch, *args, "--moe.recompute_preactivations_layers", "1")


def test_fp8_on_a_gpu_before_compute_capability_9_is_refused_naming_the_emulation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (8, 0))
    reason = fp8_unavailable_reason("fp8_rowwise")
    assert reason is not None
    assert "compute capability 9.0 or newer (H100, H200); this GPU has 8.0" in reason
    assert "moe.expert_precision = 'fp8_rowwise_emulated' computes the same numerics in fp32 here" in reason
    assert fp8_unavailable_reason("fp8_rowwise_emulated") is None


def test_the_triton_backend_takes_fp8_and_the_start_up_line_says_so(monkeypatch, caplog):
    with caplog.at_level(logging.INFO):
        config = parse(monkeypatch, "--flavor", "tiny-moe-triton", "--moe.expert_precision", "fp8_rowwise_emulated")
    assert precisions(config) == {"fp8_rowwise_emulated"}
    assert "compute_backend=triton, expert_precision=fp8_rowwise_emulated," in caplog.text


def test_an_unknown_precision_is_refused_with_the_choices(monkeypatch):
    with pytest.raises(ConfigError, match="fp8_rowwise_emulated"):
        parse(monkeypatch, "--flavor", "tiny-moe-grouped-mm", "--moe.expert_precision", "fp8")


def float8_converted_flavor(monkeypatch, base: str = "tiny-moe-grouped-mm") -> str:
    """A flavor registered for the test: ``base`` through torchtitan's ``Float8GroupedExpertsConverter``
    (its ``convert``; its constructor asks for torchao and an SM89+ GPU, which the CPU tests lack)."""
    base_flavor = get_flavor(base)

    def tiny_moe_float8_converted():
        config = base_flavor.build()
        assert config.model_spec is not None
        config.model_spec.model = object.__new__(Float8GroupedExpertsConverter).convert(model_config(config))
        return config

    name = f"{base}-float8-converted"
    monkeypatch.setitem(
        registry._FLAVORS, name, Flavor(name, "test", base_flavor.experiment, tiny_moe_float8_converted)
    )
    return name


def test_torchtitans_float8_converter_switches_the_experts_to_fp8_rowwise(monkeypatch):
    flavor = get_flavor(float8_converted_flavor(monkeypatch))
    converted = flavor.build()
    experts = nested_configs(converted, BackendGroupedExperts.Config)
    dispatchers = nested_configs(converted, AllToAllTokenDispatcher.Config)
    assert experts and all(type(e) is not BackendGroupedExperts.Config for e in experts)
    assert dispatchers and not any(isinstance(d, RoutingDispatcher.Config) for d in dispatchers)
    adopted = flavor.build_config()
    experts = nested_configs(adopted, BackendGroupedExperts.Config)
    assert all(type(e) is BackendGroupedExperts.Config and e.expert_precision == "fp8_rowwise" for e in experts)
    assert all(type(d) is RoutingDispatcher.Config for d in nested_configs(adopted, AllToAllTokenDispatcher.Config))


def test_the_converted_flavor_takes_the_moe_keys(monkeypatch):
    """The converter's choice is the starting point: TOML files and the command line set the rest."""
    flavor = float8_converted_flavor(monkeypatch)
    config = parse(
        monkeypatch,
        "--flavor",
        flavor,
        "--moe.expert_precision",
        "fp8_rowwise_emulated",
        "--moe.permute_backend",
        "torch",
    )
    assert precisions(config) == {"fp8_rowwise_emulated"}
    assert {d.permute_backend for d in nested_configs(config, RoutingDispatcher.Config)} == {"torch"}


@pytest.mark.parametrize("base", ["tiny-moe-for-loop", "tiny-moe-batched-mm-padded"])
def test_a_converted_flavor_whose_backend_has_no_fp8_gemms_takes_another_backend(monkeypatch, base):
    """The converter asks for FP8 experts of a flavor whose backend has none: the command line can still
    choose a backend that has them; left as it is, the refusal names the converter and the key."""
    flavor = float8_converted_flavor(monkeypatch, base)
    config = parse(
        monkeypatch, "--flavor", flavor, "--moe.compute_backend", "grouped_mm", "--moe.expert_precision",
        "fp8_rowwise_emulated",
    )  # fmt: skip
    assert precisions(config) == {"fp8_rowwise_emulated"}
    assert {e.compute_backend for e in nested_configs(config, BackendGroupedExperts.Config)} == {"grouped_mm"}
    with pytest.raises(
        ConfigError,
        match=r"^the flavor's model converters \(torchtitan's Float8GroupedExpertsConverter\): "
        r"moe\.expert_precision = 'fp8_rowwise': compute_backend '\w+' has no FP8 expert GEMMs",
    ):
        parse(monkeypatch, "--flavor", flavor)


def test_torchtitans_mxfp8_converter_is_refused_naming_its_experts_config(monkeypatch):
    """The MXFP8 converter's experts would stay in bf16 here: refused, the class named as torchtitan names it."""
    converter = object.__new__(MXFP8GroupedExpertsConverter)
    converter.config = MXFP8GroupedExpertsConverter.Config()
    base_flavor = get_flavor("tiny-moe-grouped-mm")

    def tiny_moe_mxfp8_converted():
        config = base_flavor.build()
        assert config.model_spec is not None
        config.model_spec.model = converter.convert(model_config(config))
        return config

    name = "tiny-moe-grouped-mm-mxfp8-converted"
    monkeypatch.setitem(registry._FLAVORS, name, Flavor(name, "test", base_flavor.experiment, tiny_moe_mxfp8_converted))
    with pytest.raises(ConfigError, match=r"experts config MXFP8GroupedExperts\.Config \(from a quantizing") as error:
        parse(monkeypatch, "--flavor", name)
    assert "<locals>" not in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of FP8 GEMMs without CUDA")
def test_torchtitans_float8_converter_on_cpu_is_refused_as_fp8_not_run_in_bf16(monkeypatch):
    with pytest.raises(ConfigError, match=r"expert_precision = 'fp8_rowwise'.*need a CUDA GPU"):
        parse(monkeypatch, "--flavor", float8_converted_flavor(monkeypatch))
