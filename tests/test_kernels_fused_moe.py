"""CPU checks of the fused MoE kernels through Triton's interpreter (TRITON_INTERPRET=1).

Forward and every gradient are compared with the per-expert-loop references on random
inputs: fp32 tightly, fp16 within half-precision rounding. Shapes are tiny because the
interpreter is slow; D and F are deliberately not multiples of the 16-wide test tiles.
"""

import contextlib
import functools
import os
from collections.abc import Callable

import pytest
import torch
from helpers import assert_weight_gradient_matches, fresh_buffers_hold_nan, unset_rows_after_the_experts

from torchtitan_ext.bench.common import relative_error
from torchtitan_ext.kernels.availability import interpreter_enabled
from torchtitan_ext.kernels.fused_moe import (
    fused_moe_grouped,
    fused_moe_routed,
    fused_moe_row_weighted,
    reference_grouped,
    reference_routed,
    reference_row_weighted,
    triton_available_reason,
)
from torchtitan_ext.kernels.moe_permute import reference_routing_metadata, routing_metadata

pytestmark = pytest.mark.skipif(
    not interpreter_enabled(),
    reason="CPU tensors through Triton's interpreter (TRITON_INTERPRET=1); test_kernels_fused_moe_gpu.py checks CUDA",
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3}


def make_experts(num_experts, dim, hidden, dtype, generator):
    def param(*shape, fan_in):
        return (torch.randn(*shape, generator=generator) * fan_in**-0.5).to(dtype).requires_grad_()

    return [
        param(num_experts, hidden, dim, fan_in=dim),
        param(num_experts, dim, hidden, fan_in=hidden),
        param(num_experts, hidden, dim, fan_in=dim),
    ]


def fp64_copies(tensors):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def assert_matches(fused, reference, inputs, dtype, generator, expert_rows: int | None = None):
    """Forward and the gradient of every differentiable input, against an fp64 reference.

    With ``expert_rows`` (grouped rows, fewer than x's), the rows after them are as EP's static
    receive rows leave them: x and the output gradient NaN there, and every fresh buffer NaN
    (``fresh_buffers_hold_nan``); the output and the row-indexed gradients (x, scores) are compared
    on the experts' rows, the weights' gradients whole."""
    grad_out = torch.randn(inputs[0].shape[0], inputs[0].shape[1], generator=generator).to(dtype)
    fused_inputs, fused_grad_out = inputs, grad_out
    if expert_rows is not None:
        unset_x, fused_grad_out, grad_out = unset_rows_after_the_experts(inputs[0].detach(), grad_out, expert_rows)
        fused_inputs = [unset_x.requires_grad_(), *inputs[1:]]
    with fresh_buffers_hold_nan() if expert_rows is not None else contextlib.nullcontext():
        out = fused(*fused_inputs)
        differentiable = [t for t in fused_inputs if t.is_floating_point() and t.requires_grad]
        grads = torch.autograd.grad(out, differentiable, fused_grad_out)
    ref_inputs = [t if not t.is_floating_point() else c for t, c in zip(inputs, fp64_copies(inputs))]
    expected = reference(*ref_inputs)
    ref_differentiable = [t for t in ref_inputs if t.is_floating_point() and t.requires_grad]
    expected_grads = torch.autograd.grad(expected, ref_differentiable, grad_out.double())
    rows = slice(expert_rows)
    assert out.dtype == inputs[0].dtype
    assert out.shape == expected.shape
    if expert_rows is not None:
        assert out[expert_rows:].isnan().all(), "the output rows after the experts' are not written"
        assert grads[0][expert_rows:].isnan().all(), "the input-gradient rows after the experts' are not written"
    if expert_rows != 0:
        assert relative_error(out[rows], expected[rows]) < TOLERANCE[dtype]
    for grad, expected_grad, tensor in zip(grads, expected_grads, differentiable):
        assert grad.dtype == tensor.dtype
        assert grad.shape == tensor.shape
        compared = slice(None) if tensor.dim() == 3 else rows  # weights whole, x and scores by row
        actual, wanted = grad[compared], expected_grad[compared]
        if actual.numel() == 0:
            continue
        if wanted.abs().max() == 0:
            assert actual.abs().max() == 0
        else:
            assert relative_error(actual, wanted) < TOLERANCE[dtype]


def routed_inputs(tokens, dim, hidden, num_experts, top_k, dtype, seed, skew=0.0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=generator) + torch.linspace(skew, 0, num_experts)
    scores, ids = logits.softmax(-1).topk(top_k, dim=-1)
    x = torch.randn(tokens, dim, generator=generator).to(dtype).requires_grad_()
    return [
        x,
        *make_experts(num_experts, dim, hidden, dtype, generator),
        ids,
        scores.to(dtype).requires_grad_(),
    ], generator


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("top_k,num_experts", [(1, 4), (2, 5), (6, 6), (8, 8)])
def test_routed_matches_reference(dtype, top_k, num_experts):
    inputs, generator = routed_inputs(11, 40, 24, num_experts, top_k, dtype, seed=top_k)
    assert_matches(fused_moe_routed, reference_routed, inputs, dtype, generator)


@pytest.mark.parametrize("frozen", ["x", "w1", "w2", "w3", "weights"])
def test_routed_gradients_of_a_subset_of_inputs(frozen):
    """Backward skips the work of inputs that need no gradient (d w2's grouped d y rows, x's rows for
    d w1 and d w3) and the gradients that remain still match."""
    inputs, generator = routed_inputs(13, 40, 24, 5, 3, torch.float32, seed=21)
    frozen_names = ["w1", "w2", "w3"] if frozen == "weights" else [frozen]
    for name, tensor in zip(["x", "w1", "w2", "w3"], inputs):
        if name in frozen_names:
            tensor.requires_grad_(False)
    assert_matches(fused_moe_routed, reference_routed, inputs, torch.float32, generator)


def test_routed_skewed_even_dims():
    inputs, generator = routed_inputs(21, 32, 48, 6, 2, torch.float32, seed=7, skew=4.0)
    assert_matches(fused_moe_routed, reference_routed, inputs, torch.float32, generator)


@pytest.mark.parametrize(
    "counts",
    [
        [5, 0, 9, 3, 0, 2],  # empty experts between busy ones, R not a multiple of the tile
        [0, 0, 19, 0],  # one expert takes every row
        [0, 0, 0],  # every expert empty: every row is unassigned
        [4, 6, 0, 3],  # sum < R: trailing rows unset, read by nothing
        [7, 12],  # every row assigned
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_matches_reference(counts, dtype):
    """Rows after the experts' (R > the counts' sum) unset, as EP's static receive rows: NaN in x, in
    the output gradient and in every fresh buffer, none of which reaches the experts' rows or a
    weight gradient."""
    generator = torch.Generator().manual_seed(len(counts))
    num_rows = max(sum(counts), 19)
    x = torch.randn(num_rows, 40, generator=generator).to(dtype).requires_grad_()
    inputs = [x, *make_experts(len(counts), 40, 24, dtype, generator), torch.tensor(counts)]
    assert_matches(fused_moe_grouped, reference_grouped, inputs, dtype, generator, expert_rows=sum(counts))


@pytest.mark.parametrize("counts", [[5, 0, 9, 3, 0, 2], [4, 6, 0, 3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("two_passes", [False, True])
def test_row_weighted_grouped_matches_reference(counts, dtype, two_passes, monkeypatch):
    """Each row's output times its own score, and the scores' gradient, from the experts' backward
    (both gate/up forwards); rows after the experts' unset (NaN: ``assert_matches``) change nothing."""
    from torchtitan_ext.kernels import swiglu_passes

    monkeypatch.setattr(swiglu_passes, "GATE_UP_TWO_PASS_MIN_WEIGHT", 1 if two_passes else 2**40)
    generator = torch.Generator().manual_seed(sum(counts))
    num_rows = max(sum(counts), 19)
    x = torch.randn(num_rows, 40, generator=generator).to(dtype).requires_grad_()
    scores = torch.rand(num_rows, generator=generator).requires_grad_()
    inputs = [x, *make_experts(len(counts), 40, 24, dtype, generator), torch.tensor(counts), scores]
    assert_matches(fused_moe_row_weighted, reference_row_weighted, inputs, dtype, generator, expert_rows=sum(counts))


@pytest.mark.parametrize("row_weighted", [False, True])
@pytest.mark.parametrize("two_passes", [False, True])
def test_recomputed_preactivations_give_the_same_output_and_gradients_bit_for_bit(
    row_weighted, two_passes, monkeypatch
):
    """The backward that recomputes gate and up (both gate/up forwards) gives exactly what the one
    reading the kept ones gives, and matches the reference."""
    from torchtitan_ext.kernels import swiglu_passes

    monkeypatch.setattr(swiglu_passes, "GATE_UP_TWO_PASS_MIN_WEIGHT", 1 if two_passes else 2**40)
    generator = torch.Generator().manual_seed(7)
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(21, 40, generator=generator).requires_grad_()
    inputs = [x, *make_experts(4, 40, 24, torch.float32, generator), counts]
    if row_weighted:
        inputs.append(torch.rand(21, generator=generator).requires_grad_())
    fused: Callable[..., torch.Tensor] = fused_moe_row_weighted if row_weighted else fused_moe_grouped
    reference = reference_row_weighted if row_weighted else reference_grouped
    recomputing = functools.partial(fused, recompute_preactivations=True)

    assert_matches(recomputing, reference, inputs, torch.float32, generator, expert_rows=17)
    grad_out = torch.randn(21, 40, generator=generator)
    differentiable = [t for t in inputs if t.is_floating_point()]
    kept = torch.autograd.grad(fused(*inputs), differentiable, grad_out)
    recomputed = torch.autograd.grad(recomputing(*inputs), differentiable, grad_out)
    for a, b in zip(kept, recomputed, strict=True):
        rows = slice(None) if a.dim() == 3 else slice(17)  # the rows after the experts' are unset
        assert torch.equal(a[rows], b[rows])


def test_recomputing_preactivations_saves_no_hidden_sized_tensor_for_backward():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(12, 40, generator=generator).requires_grad_()
    w1, w2, w3 = make_experts(2, 40, 24, torch.float32, generator)
    counts = torch.tensor([5, 7])
    saved_shapes = []

    def shapes_of(compute, **kwargs):
        saved_shapes.clear()

        def pack(t):
            saved_shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            compute(x, w1, w2, w3, counts, **kwargs)
        return list(saved_shapes)

    assert shapes_of(fused_moe_grouped).count((12, 24)) == 2  # gate and up
    assert (12, 24) not in shapes_of(fused_moe_grouped, recompute_preactivations=True)


def test_recomputed_preactivations_compile_as_one_graph_with_the_eager_gradients():
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(12, 40, generator=generator).requires_grad_()
    experts = make_experts(2, 40, 24, torch.float32, generator)
    counts = torch.tensor([5, 7])
    grad_out = torch.randn(12, 40, generator=generator)

    def gradients(compute):
        return torch.autograd.grad(compute(x, *experts, counts, recompute_preactivations=True), [x, *experts], grad_out)

    torch._dynamo.reset()
    compiled = torch.compile(fused_moe_grouped, fullgraph=True, backend="aot_eager")
    for eager, traced in zip(gradients(fused_moe_grouped), gradients(compiled), strict=True):
        assert torch.equal(eager, traced)


def test_routed_mode_refuses_to_recompute_its_preactivations():
    from torchtitan_ext.kernels.swiglu_experts import swiglu_experts

    with pytest.raises(ValueError, match="grouped mode only"):
        swiglu_experts(
            torch.randn(4, 8),
            torch.randn(2, 8, 8),
            torch.randn(2, 8, 8),
            torch.randn(2, 8, 8),
            torch.tensor([2, 4], dtype=torch.int32),
            row_slot_S=torch.zeros(4, dtype=torch.int32),
            scores_S=torch.ones(4),
            slot_row_S=torch.zeros(4, dtype=torch.int32),
            recompute_preactivations=True,
        )


def test_row_scores_must_have_one_score_per_row():
    generator = torch.Generator().manual_seed(0)
    w1, w2, w3 = make_experts(2, 16, 8, torch.float32, generator)
    with pytest.raises(ValueError, match=r"row scores must have shape \(6,\), got \(5,\)"):
        fused_moe_row_weighted(torch.randn(6, 16), w1, w2, w3, torch.tensor([3, 3]), torch.rand(5))


def test_fp32_weights_with_fp16_activations():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32, generator=generator).half().requires_grad_()
    w1, w2, w3 = (w.detach().float().requires_grad_() for w in make_experts(3, 32, 16, torch.float16, generator))
    scores, ids = torch.randn(9, 3, generator=generator).softmax(-1).topk(2, dim=-1)
    scores.requires_grad_()
    out = fused_moe_routed(x, w1, w2, w3, ids, scores)
    grads = torch.autograd.grad(out, [x, w1, w2, w3, scores], torch.ones_like(out))
    assert out.dtype == torch.float16
    assert [g.dtype for g in grads] == [torch.float16] + [torch.float32] * 4
    w1_ref, w2_ref, w3_ref = (w.half().double() for w in (w1, w2, w3))
    expected = reference_routed(x.double(), w1_ref, w2_ref, w3_ref, ids, scores.double())
    assert relative_error(out, expected) < TOLERANCE[torch.float16]


def test_results_repeat_bit_for_bit():
    inputs, _ = routed_inputs(10, 40, 24, 4, 2, torch.float32, seed=11)
    runs = []
    for _ in range(2):
        out = fused_moe_routed(*inputs)
        runs.append([out, *torch.autograd.grad(out, [inputs[i] for i in (0, 1, 2, 3, 5)], torch.ones_like(out))])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_second_backward_through_the_same_graph_gives_the_same_gradients():
    """Backward reads the saved pre-activations and writes their gradients elsewhere: a second
    backward (retain_graph=True) gives the first one's gradients."""
    inputs, _ = routed_inputs(10, 40, 24, 4, 2, torch.float32, seed=12)
    differentiable = [inputs[i] for i in (0, 1, 2, 3, 5)]
    out = fused_moe_routed(*inputs)
    first = torch.autograd.grad(out.sum(), differentiable, retain_graph=True)
    second = torch.autograd.grad(out.sum(), differentiable)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_backward_frees_d_gate_before_allocating_d_w3(monkeypatch):
    """d gate is released once d w1 is done and before d w3 is allocated, so at most two of the three
    expert weight gradients are alive next to it; the saved pre-activations stay intact."""
    from torchtitan_ext.kernels import swiglu_passes

    num_experts, dim, hidden = 4, 40, 24
    inputs, _ = routed_inputs(10, dim, hidden, num_experts, 2, torch.float32, seed=13)
    events = []
    release, weight_gradient = swiglu_passes._release, swiglu_passes._weight_gradient
    monkeypatch.setattr(swiglu_passes, "_release", lambda buffer: (events.append("release d gate"), release(buffer)))
    monkeypatch.setattr(
        swiglu_passes,
        "_weight_gradient",
        lambda *args: (events.append(f"weight gradient {tuple(args[-1].shape)}"), weight_gradient(*args)),
    )
    saved = []

    def keep(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = fused_moe_routed(*inputs)
    out.sum().backward()
    assert events == [
        f"weight gradient {(num_experts, dim, hidden)}",
        f"weight gradient {(num_experts, hidden, dim)}",
        "release d gate",
        f"weight gradient {(num_experts, hidden, dim)}",
    ]
    pre_activations = [t for t in saved if t.dim() == 2 and t.shape == (10 * 2, hidden)]
    assert len(pre_activations) == 2
    assert all(t.untyped_storage().size() > 0 for t in pre_activations)


@pytest.mark.parametrize("weights_frozen", [False, True])
def test_routed_forward_keeps_x_in_expert_order_only_for_weight_gradients(weights_frozen):
    """Routed mode saves x copied into expert order (row r = x[row_slot[r] // K]) for the weight
    gradients, and no copy of x when no expert weight needs a gradient."""
    num_tokens, dim, hidden, num_experts, top_k = 10, 40, 24, 4, 2
    inputs, _ = routed_inputs(num_tokens, dim, hidden, num_experts, top_k, torch.float32, seed=5)
    if weights_frozen:
        for weight in inputs[1:4]:
            weight.requires_grad_(False)
    saved = []

    def keep(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        fused_moe_routed(*inputs)
    grouped_x = [t for t in saved if t.shape == (num_tokens * top_k, dim)]
    if weights_frozen:
        assert grouped_x == []
        return
    row_slot_S, _, _ = routing_metadata(inputs[4], num_experts)
    assert len(grouped_x) == 1
    assert torch.equal(grouped_x[0], inputs[0].detach().index_select(0, (row_slot_S // top_k).long()))


@pytest.mark.parametrize("num_experts", [7, 255, 256, 40000])
def test_stable_expert_order_sorts_on_narrow_keys_like_a_stable_argsort(num_experts):
    """Ids in [0, num_experts] (num_experts: dropped) at the edges of uint8, int16 and int32 keys."""
    from torchtitan_ext.kernels.moe_permute import stable_expert_order

    generator = torch.Generator().manual_seed(0)
    ids_S = torch.randint(0, num_experts + 1, (4000,), generator=generator)
    ids_S[:50] = num_experts
    assert torch.equal(stable_expert_order(ids_S, num_experts), torch.argsort(ids_S, stable=True))


@pytest.mark.parametrize("slots_per_program", [None, 8, 16])
@pytest.mark.parametrize("num_experts", [9, 30, 1025])
def test_routing_metadata_matches_reference(num_experts, slots_per_program):
    """One or several programs (blocks of 8 or 16 slots), experts left empty, one popular expert,
    dropped slots (id num_experts), and a slot count that no block size divides; past
    GROUPING_MAX_EXPERTS (1024) experts, the stable sort."""
    ids = torch.randint(0, 7, (13, 3), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 2
    ids[3:5, 1] = num_experts
    ids[-1, -1] = num_experts - 1
    expected = reference_routing_metadata(ids, num_experts)
    for actual, wanted in zip(routing_metadata(ids, num_experts, slots_per_program), expected):
        assert torch.equal(actual, wanted)


def test_grouped_token_rows_match_index_select():
    """Filling the grouped rows through the inverse of row_slot gives x[row_slot[r] // K], with D
    not a multiple of the column step; a slot count that is not tokens x K is refused."""
    from torchtitan_ext.kernels.moe_permute import scatter_token_rows, slot_rows

    generator = torch.Generator().manual_seed(3)
    num_tokens, top_k = 11, 3
    x_TD = torch.randn(num_tokens, 40, generator=generator)
    row_slot_S = torch.randperm(num_tokens * top_k, generator=generator).to(torch.int32)
    slot_row_S = slot_rows(row_slot_S)
    assert torch.equal(slot_row_S[row_slot_S.long()], torch.arange(num_tokens * top_k, dtype=torch.int32))
    rows_RD = scatter_token_rows(x_TD, slot_row_S, top_k, torch.full((num_tokens * top_k, 40), float("nan")))
    assert torch.equal(rows_RD, x_TD.index_select(0, (row_slot_S // top_k).long()))
    with pytest.raises(ValueError, match="expected 11 tokens x top_k 2"):
        scatter_token_rows(x_TD, slot_row_S, 2, rows_RD)


def test_clear_error_without_cuda_or_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the error of a machine without CUDA (and the interpreter off); this one has CUDA")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = triton_available_reason()
    assert reason is not None and "CUDA" in reason
    inputs, _ = routed_inputs(4, 16, 16, 2, 1, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="CUDA"):
        fused_moe_routed(*inputs)
    assert os.environ["TRITON_INTERPRET"] == "0"


@pytest.mark.parametrize("use_descriptors", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_gradient_with_and_without_tensor_descriptors(use_descriptors, dtype, monkeypatch):
    """c[e] = a[rows of e].T @ b[rows of e]: descriptor (TMA) loads for full row steps, pointer loads otherwise."""
    from torchtitan_ext.kernels import swiglu_passes
    from torchtitan_ext.kernels.launch_configs import tensor_descriptors_usable

    generator = torch.Generator().manual_seed(5)
    counts = [37, 0, 16, 5, 0, 21]  # partial and exact 16-row steps, empty experts, 4 trailing unassigned rows
    a_RM = torch.randn(83, 48, generator=generator).to(dtype)
    b_RN = torch.randn(83, 40, generator=generator).to(dtype)
    assert tensor_descriptors_usable(a_RM, b_RN)
    if not use_descriptors:
        monkeypatch.setattr(swiglu_passes, "tensor_descriptors", lambda *tensors: (False, [None] * len(tensors)))
    out_EMN = torch.full((len(counts), 48, 40), float("nan"), dtype=torch.float32)
    swiglu_passes._weight_gradient(a_RM, b_RN, torch.tensor(counts).cumsum(0).to(torch.int32), out_EMN)
    assert_weight_gradient_matches(out_EMN, a_RM, b_RN, counts, TOLERANCE[dtype])


def test_tensor_descriptors_need_aligned_rows():
    from torchtitan_ext.kernels.launch_configs import tensor_descriptors_usable

    assert not tensor_descriptors_usable(torch.zeros(8, 20, dtype=torch.float16))  # 40-byte rows
    assert not tensor_descriptors_usable(torch.zeros(0, 32, dtype=torch.float16))
    assert not tensor_descriptors_usable(torch.zeros(32, 8, dtype=torch.float16).T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pointer_loads_where_tensor_descriptors_cannot_be_used(dtype, monkeypatch):
    """GPUs without TMA (and rows that are not 16-byte aligned) take the kernels' pointer loads."""
    from torchtitan_ext.kernels import swiglu_passes

    monkeypatch.setattr(swiglu_passes, "tensor_descriptors", lambda *tensors: (False, [None] * len(tensors)))
    inputs, generator = routed_inputs(13, 40, 24, 5, 2, dtype, seed=9)
    assert_matches(fused_moe_routed, reference_routed, inputs, dtype, generator)


@pytest.mark.parametrize("use_descriptors", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_up_in_two_passes(use_descriptors, dtype, monkeypatch):
    """Large experts compute gate and up in two one-accumulator passes; same results, routed and grouped."""
    from torchtitan_ext.kernels import swiglu_passes

    monkeypatch.setattr(swiglu_passes, "gate_up_in_two_passes", lambda dim, hidden: True)
    if not use_descriptors:
        monkeypatch.setattr(swiglu_passes, "tensor_descriptors", lambda *tensors: (False, [None] * len(tensors)))
    inputs, generator = routed_inputs(13, 40, 24, 5, 2, dtype, seed=4)
    assert_matches(fused_moe_routed, reference_routed, inputs, dtype, generator)
    x = torch.randn(21, 40, generator=generator).to(dtype).requires_grad_()
    grouped = [x, *make_experts(4, 40, 24, dtype, generator), torch.tensor([6, 0, 9, 3])]
    assert_matches(fused_moe_grouped, reference_grouped, grouped, dtype, generator, expert_rows=18)
    with torch.no_grad():
        assert (
            relative_error(
                fused_moe_routed(*inputs),
                reference_routed(*[t.double() if t.is_floating_point() else t for t in inputs]),
            )
            < TOLERANCE[dtype]
        )


def test_only_large_experts_take_two_gate_up_passes():
    from torchtitan_ext.kernels.swiglu_passes import gate_up_in_two_passes

    assert gate_up_in_two_passes(dim=4096, hidden=14336)
    assert not gate_up_in_two_passes(dim=2048, hidden=768)


def test_hopper_weight_gradient_is_not_used_off_hopper():
    """The Gluon weight-gradient kernel needs a Hopper GPU: under the interpreter and on CPU
    tensors the Triton kernel runs."""
    from torchtitan_ext.kernels import hopper_weight_gradient

    a_RM = torch.randn(64, 128, dtype=torch.bfloat16)
    b_RN = torch.randn(64, 256, dtype=torch.bfloat16)
    assert not hopper_weight_gradient.usable(a_RM, b_RN, torch.empty(2, 128, 256, dtype=torch.bfloat16))
