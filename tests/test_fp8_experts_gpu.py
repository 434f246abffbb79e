"""FP8 rowwise experts on the GPU (compute capability 9.0+), with each FP8 GEMM of ``FP8_GEMMS``
(``torch._scaled_grouped_mm``, the Triton kernel): held to the plain-torch reference and to the fp32
emulation in bf16, forward and every gradient, eager and compiled, and weighting their rows by the
router scores with rows after the experts' (static received rows); bit-equal replayed from a CUDA graph."""

import pytest
import torch
from helpers import (
    assert_swiglu_kernels_match_torch,
    fp8_experts_saved,
    fresh_buffers_hold_nan,
    saved_elements,
    tensors_saved_for_backward,
)

from torchtitan_ext.bench.common import relative_error
from torchtitan_ext.bench.ep_dispatch import captured
from torchtitan_ext.experiments.moe_backends.experts import grouped_mm_experts
from torchtitan_ext.experiments.moe_backends.fp8_experts import (
    FP8_GEMMS,
    fp8_grouped_experts,
    fp8_routed_experts,
    fp8_unavailable_reason,
    quantize_rowwise,
    quantize_stacked_rows,
    quantize_stacked_rows_transposed,
    reference_fp8_experts,
    reference_routed_fp8_experts,
)
from torchtitan_ext.kernels.fp8_quantize import quantize_activation_rows, quantize_rows, quantize_rows_transposed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(fp8_unavailable_reason("fp8_rowwise") is not None, reason="needs a CUDA GPU of 9.0+"),
]

NAMES = ["out", "x", "w1", "w2", "w3"]
COUNTS = [37, 0, 128, 5, 90, 1]


def expert_inputs(dim: int, hidden: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    experts = len(COUNTS)
    shapes = [(sum(COUNTS), dim), (experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim)]
    scales = [1.0, dim**-0.5, hidden**-0.5, dim**-0.5]
    return [
        (torch.randn(*shape, generator=generator) * scale).to("cuda", torch.bfloat16).requires_grad_()
        for shape, scale in zip(shapes, scales, strict=True)
    ]


def forward_and_gradients(compute, inputs: list[torch.Tensor], **kwargs) -> list[torch.Tensor]:
    out = compute(*inputs, torch.tensor(COUNTS, device="cuda"), **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    return [out.detach(), *torch.autograd.grad(out, inputs, grad)]


@pytest.mark.parametrize("gemm", FP8_GEMMS)
@pytest.mark.parametrize("dim, hidden", [(256, 128), (200, 72)], ids=["aligned", "padded"])
def test_fp8_experts_agree_with_the_reference_and_the_emulation(dim, hidden, gemm):
    inputs = expert_inputs(dim, hidden)
    fp8 = forward_and_gradients(fp8_grouped_experts, inputs, emulated=False, gemm=gemm)
    emulated = forward_and_gradients(fp8_grouped_experts, inputs, emulated=True)
    reference = forward_and_gradients(reference_fp8_experts, inputs)
    for name, actual, like, expected in zip(NAMES, fp8, emulated, reference, strict=True):
        assert actual.dtype == torch.bfloat16 and torch.isfinite(actual).all(), name
        assert relative_error(actual, like) <= 1e-2, name
        assert relative_error(actual, expected) <= 3e-2, name


@pytest.mark.parametrize("gemm", FP8_GEMMS)
def test_row_weighted_fp8_experts_with_rows_after_the_experts_agree_with_the_reference(gemm):
    """``experts_apply_scores`` under static received rows: rows after the experts' as the transports
    give them, unset (NaN here) with score 0, and their output gradients unset (NaN). The experts' rows
    of the output and of the input and score gradients, and every weight gradient, agree with the
    reference; the rows after are never read."""
    grouped, after, dim = sum(COUNTS), 7, 256
    x, w1, w2, w3 = expert_inputs(dim, 128)
    x = torch.cat([x.detach(), torch.full((after, dim), float("nan"), device="cuda", dtype=x.dtype)]).requires_grad_()
    scores = torch.rand(grouped + after, generator=torch.Generator().manual_seed(2)).cuda()
    scores[grouped:] = 0
    scores.requires_grad_()
    leaves, counts = [x, w1, w2, w3, scores], torch.tensor(COUNTS, device="cuda")
    out = fp8_grouped_experts(x, w1, w2, w3, counts, scores, emulated=False, gemm=gemm)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grad[grouped:] = float("nan")
    actual = [out.detach(), *torch.autograd.grad(out, leaves, grad)]
    reference_out = reference_fp8_experts(x, w1, w2, w3, counts, scores)
    expected = [reference_out.detach(), *torch.autograd.grad(reference_out, leaves, grad[:grouped])]
    for name, got, wanted in zip([*NAMES, "scores"], actual, expected, strict=True):
        rows = slice(None) if name.startswith("w") else slice(grouped)
        assert torch.isfinite(got[rows]).all(), name
        assert relative_error(got[rows], wanted[rows]) <= 3e-2, name


@pytest.mark.parametrize("gemm", FP8_GEMMS)
def test_compiled_fp8_experts_equal_eager(gemm):
    inputs = expert_inputs(256, 128)
    eager = forward_and_gradients(fp8_grouped_experts, inputs, emulated=False, gemm=gemm)
    torch._dynamo.reset()
    compiled = torch.compile(fp8_grouped_experts, fullgraph=True)
    for name, actual, expected in zip(
        NAMES, forward_and_gradients(compiled, inputs, emulated=False, gemm=gemm), eager, strict=True
    ):
        assert relative_error(actual, expected) <= 3e-2, name


@pytest.mark.parametrize("gemm", FP8_GEMMS)
@pytest.mark.parametrize("dim, hidden", [(256, 128), (200, 72)], ids=["aligned", "padded"])
def test_routed_fp8_experts_agree_with_the_reference_eager_and_compiled(dim, hidden, gemm):
    """The single-device FP8 path (``fp8_routed_experts``: the permute quantises the tokens, and in the
    backward the output gradient) in bf16: forward and every gradient, the scores' too, with a dropped
    slot, against the plain-torch reference, eager and compiled."""
    tokens, top_k = 256, 4
    x, w1, w2, w3 = expert_inputs(dim, hidden)
    x = x[:tokens].detach().requires_grad_()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, len(COUNTS), (tokens, top_k), generator=generator).cuda()
    ids[0, 0] = len(COUNTS)
    scores = torch.rand(tokens, top_k, generator=generator).cuda().requires_grad_()
    leaves = [x, w1, w2, w3, scores]
    grad = torch.randn(tokens, dim, generator=generator).to("cuda", torch.bfloat16)

    def forward_and_gradients(compute, **kwargs) -> list[torch.Tensor]:
        out = compute(x, w1, w2, w3, ids, scores, **kwargs)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad)]

    eager = forward_and_gradients(fp8_routed_experts, gemm=gemm)
    reference = forward_and_gradients(reference_routed_fp8_experts)
    torch._dynamo.reset()
    compiled = forward_and_gradients(torch.compile(fp8_routed_experts, fullgraph=True), gemm=gemm)
    for name, actual, expected, again in zip([*NAMES, "scores"], eager, reference, compiled, strict=True):
        assert torch.isfinite(actual).all(), name
        assert relative_error(actual, expected) <= 3e-2, name
        assert relative_error(again, actual) <= 1e-2, name
    assert (eager[-1][0, 0] == 0).all()


@pytest.mark.parametrize("gemm", FP8_GEMMS)
@pytest.mark.parametrize("path", ["routed", "grouped"])
def test_fp8_experts_read_only_what_they_write_and_replay_in_a_cuda_graph(path, gemm):
    """The same bits eager, with every fresh buffer NaN (no unset element is read), and replayed from a
    CUDA graph (the graph pool's memory, as under ``--training.disable_cuda_graphs false``): forward and
    every gradient, with a dropped slot on the routed path."""
    tokens, top_k = 256, 4
    x, w1, w2, w3 = expert_inputs(256, 128)
    generator = torch.Generator().manual_seed(5)
    if path == "routed":
        x = x[:tokens].detach().requires_grad_()
        ids = torch.randint(0, len(COUNTS), (tokens, top_k), generator=generator).cuda()
        ids[3, 1] = len(COUNTS)
        scores = torch.rand(tokens, top_k, generator=generator).cuda().requires_grad_()
        leaves = [x, w1, w2, w3, scores]

        def forward():
            return fp8_routed_experts(x, w1, w2, w3, ids, scores, gemm=gemm)
    else:
        counts = torch.tensor(COUNTS, device="cuda")
        leaves = [x, w1, w2, w3]

        def forward():
            return fp8_grouped_experts(x, w1, w2, w3, counts, emulated=False, gemm=gemm)

    grad = torch.randn(x.shape, generator=generator).to("cuda", torch.bfloat16)

    def step() -> list[torch.Tensor]:
        out = forward()
        return [out.detach(), *torch.autograd.grad(out, leaves, grad)]

    eager = step()
    with fresh_buffers_hold_nan():
        nan_filled = step()
    outputs: list[list[torch.Tensor]] = []
    replay = captured(lambda: outputs.append(step()))  # the last call is the captured one
    replay()
    torch.cuda.synchronize()
    replayed = outputs[-1]
    names = [*NAMES, "scores"][: len(eager)]
    for name, actual, again, expected in zip(names, nan_filled, replayed, eager, strict=True):
        assert torch.isfinite(expected).all(), name
        assert torch.equal(actual, expected), f"{name}: fresh buffers of NaN"
        assert torch.equal(again, expected), f"{name}: replayed from a CUDA graph"


@pytest.mark.parametrize(
    "part_shapes",
    [[(8, 200, 72)], [(16, 768, 2048), (16, 768, 2048)], [(4, 40, 14336)]],
    ids=["masked", "gate_up", "long_rows"],
)
def test_the_weight_quantisation_kernels_round_as_torch(part_shapes):
    """Both layouts bit-equal to the plain-torch rule: the row kernel's values and scales, and the
    transposing kernel's values from the largest of each expert's inverse row scales (the rule applied
    to the whole expert)."""
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randn(*shape, generator=generator).to("cuda", torch.bfloat16) for shape in part_shapes]
    values, inverse = quantize_rows(parts)
    expected_values, expected_inverse = quantize_stacked_rows(parts, emulated=True)
    assert torch.equal(inverse, expected_inverse)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    expert_inverse = inverse.amax(1, keepdim=True)
    transposed = quantize_rows_transposed(parts, expert_inverse)
    expected_transposed = quantize_stacked_rows_transposed(parts, expert_inverse, emulated=True)
    assert torch.equal(transposed.view(torch.uint8), expected_transposed.view(torch.uint8))
    whole_experts, whole_inverse = quantize_rowwise(torch.cat(parts, dim=1).flatten(1))
    assert torch.equal(whole_inverse[:, :, None], expert_inverse)
    assert torch.equal(transposed.mT.flatten(1).view(torch.uint8), whole_experts.view(torch.uint8))


@pytest.mark.parametrize(
    "part_cols, dtype",
    [
        ((2048,), torch.bfloat16),
        ((768, 768), torch.bfloat16),
        ((14336,), torch.bfloat16),
        ((1024, 1024), torch.float32),
    ],
    ids=["tokens", "gradients_of_gate_and_up", "long_rows_in_blocks", "fp32"],
)
def test_the_activation_quantisation_kernel_rounds_as_torch(part_cols, dtype):
    """Bit-equal to the plain-torch rule on the experts' rows; the rows after them are not written."""
    generator = torch.Generator().manual_seed(0)
    rows, after = 3000, 100
    parts = [(torch.randn(rows + after, cols, generator=generator) * 3).to("cuda", dtype) for cols in part_cols]
    group_end = torch.tensor([1000, 1000, rows], device="cuda", dtype=torch.int32)
    joined = torch.cat(parts, dim=1)[:rows].float()
    with fresh_buffers_hold_nan():
        values, inverse = quantize_activation_rows(parts, group_end)
    expected_values, expected_inverse = quantize_rowwise(joined)
    assert torch.equal(inverse[:rows], expected_inverse)
    assert torch.equal(values[:rows].view(torch.uint8), expected_values.view(torch.uint8))
    assert inverse[rows:].isnan().all()


@pytest.mark.parametrize(
    "hidden, with_scores",
    [(768, False), (768, True), (1408, True), (14336, True)],
    ids=["qwen3", "qwen3_scores", "deepseek_v2_lite_scores", "long_rows_in_blocks_scores"],
)
def test_the_swiglu_kernels_round_as_torch(hidden, with_scores):
    """bf16: both SwiGLU kernels' e4m3 rows bit-equal to the plain-torch rule applied to what they write,
    which equals torch's autograd in fp64 up to bf16 rounding; rows after the experts' unwritten."""
    generator = torch.Generator().manual_seed(0)
    rows, after = 3000, 100
    gate_up = (torch.randn(rows + after, 2 * hidden, generator=generator) * 3).to("cuda", torch.bfloat16)
    grad_a = torch.randn(rows + after, hidden, generator=generator).to("cuda", torch.bfloat16)
    scores = torch.rand(rows + after, generator=generator).to("cuda") if with_scores else None
    group_end = torch.tensor([1000, 1000, rows], device="cuda", dtype=torch.int32)
    assert_swiglu_kernels_match_torch(gate_up, grad_a, scores, group_end, tolerance=1e-2)


def test_the_triton_fp8_gemm_equals_torchs_scaled_grouped_mm():
    """The same e4m3 operands and scales through both kernels, bf16 out: equal up to the accumulation
    order on the experts' rows; the Triton kernel writes none of the rows after them (NaN from the fresh
    buffer here)."""
    generator = torch.Generator().manual_seed(2)
    counts = [0, 300, 17, 1000, 64]
    a = torch.randn(sum(counts) + 5, 512, generator=generator).to("cuda")
    w = torch.randn(len(counts), 384, 512, generator=generator).to("cuda")
    a_values, a_inverse = quantize_rowwise(a)
    w_values, w_inverse = quantize_rowwise(w)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    with fresh_buffers_hold_nan():
        outputs = [
            gemm(a_values, a_inverse, w_values, w_inverse, offsets, torch.bfloat16) for gemm in FP8_GEMMS.values()
        ]
    rows = int(offsets[-1])
    assert relative_error(outputs[1][:rows], outputs[0][:rows]) <= 1e-2
    assert outputs[1][rows:].isnan().all()


@pytest.mark.parametrize("gemm", FP8_GEMMS)
def test_compiled_fp8_experts_save_no_more_than_the_native_experts(gemm):
    """No e4m3 copy is kept from the forward to the backward (FSDP frees the gathered weights after the
    forward, not copies of them): ``fp8_experts_saved``, no more elements than the bf16 experts save
    besides the two per-expert weight scales."""
    inputs = expert_inputs(256, 128)
    counts = torch.tensor(COUNTS, device="cuda")
    native = tensors_saved_for_backward(grouped_mm_experts, inputs, counts)
    fp8 = tensors_saved_for_backward(fp8_grouped_experts, inputs, counts, emulated=False, gemm=gemm)
    assert fp8 == fp8_experts_saved(inputs[0], inputs[1], len(COUNTS))
    assert saved_elements(fp8) <= saved_elements(native) + 2 * len(COUNTS)
