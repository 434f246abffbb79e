"""Token-choice top-k routing of gate logits in one Triton kernel each way.

``topk_routing(logits_TE, expert_bias_E, top_k, score_func, route_norm, route_scale)`` takes
the fp32 gate logits of T tokens over E experts and returns, like torchtitan's
``TokenChoiceTopKRouter`` after its gate:

- ``scores_TE = softmax(logits)`` or ``sigmoid(logits)`` (fp32),
- ``topk_expert_ids_TK``: the K experts of largest ``scores + expert_bias`` (the bias only
  chooses), largest first; among equal values the lowest expert id wins,
- ``topk_scores_TK``: their scores, divided by their sum (+1e-20) when ``route_norm``, times
  ``route_scale``,
- ``num_routed_per_expert_E``: int64 count of the slots routed to each expert.

It is differentiable in ``logits_TE`` through ``topk_scores_TK`` and ``scores_TE``. The forward
kernel replaces the score function, bias add, top-k, gather, normalisation and count (about
ten operators), the backward kernel their backward nodes; each reads and writes every [T, E]
tensor once. Scores agree with torch's to fp32 rounding (the kernel's exponential and sums are
its own), so where two experts' values are that close, the choice can differ from torchtitan's.
No host sync. ``topk_routing_reference`` is the plain-torch version, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchtitan_ext.kernels.availability import check_runnable
from torchtitan_ext.kernels.library_ops import kernel_op
from torchtitan_ext.kernels.moe_permute import slot_counts

SCORE_FUNCS = ("softmax", "sigmoid")
MAX_EXPERTS = 1024
"""Largest expert count the kernels route (one [tokens, experts] tile per program)."""
_TILE_ELEMENTS = 4096


def _tile(num_experts: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E): tokens per program and the padded expert count."""
    block_e = triton.next_power_of_2(num_experts)
    return max(1, min(256, _TILE_ELEMENTS // block_e)), block_e


@triton.jit
def _scores(logits, e_mask, SIGMOID: tl.constexpr):
    """Softmax or sigmoid of a [BLOCK_T, BLOCK_E] fp32 logit tile along experts; padding gets 0."""
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        logits = tl.where(e_mask[None, :], logits, -float("inf"))
        exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = exp / tl.sum(exp, axis=1)[:, None]
    return tl.where(e_mask[None, :], scores, 0.0)


@triton.jit
def _topk_routing_forward_kernel(
    logits_ptr,
    bias_ptr,
    scores_ptr,
    topk_scores_ptr,
    topk_ids_ptr,
    counts_ptr,
    num_tokens,
    num_experts,
    route_scale,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program routes BLOCK_T tokens: scores, K rounds of argmax, normalised top-k scores,
    and its tokens' per-expert slot counts added into counts (integer atomics)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    t_mask = tokens < num_tokens
    e_mask = experts < num_experts
    tile_mask = t_mask[:, None] & e_mask[None, :]
    offsets = tokens.to(tl.int64)[:, None] * num_experts + experts[None, :]
    logits = tl.load(logits_ptr + offsets, mask=tile_mask, other=0.0)
    scores = _scores(logits, e_mask, SIGMOID)
    tl.store(scores_ptr + offsets, scores, mask=tile_mask)

    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + experts, mask=e_mask, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(choice != choice, float("inf"), choice)  # NaN ranks first, as in torch.topk
    choice = tl.where(e_mask[None, :], choice, -float("inf"))
    k_cols = tl.arange(0, BLOCK_K)
    topk_scores = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    topk_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    routed = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        expert = tl.min(tl.where(choice == best[:, None], experts[None, :], BLOCK_E), axis=1)
        pick = experts[None, :] == expert[:, None]
        score = tl.sum(tl.where(pick, scores, 0.0), axis=1)
        topk_scores = tl.where(k_cols[None, :] == k, score[:, None], topk_scores)
        topk_ids = tl.where(k_cols[None, :] == k, expert.to(tl.int64)[:, None], topk_ids)
        routed += pick.to(tl.int32)
        choice = tl.where(pick, -float("inf"), choice)
    if ROUTE_NORM:
        topk_scores = topk_scores / (tl.sum(topk_scores, axis=1)[:, None] + 1e-20)
    topk_scores = topk_scores * route_scale
    k_offsets = tokens.to(tl.int64)[:, None] * TOP_K + k_cols[None, :]
    k_mask = t_mask[:, None] & (k_cols[None, :] < TOP_K)
    tl.store(topk_scores_ptr + k_offsets, topk_scores, mask=k_mask)
    tl.store(topk_ids_ptr + k_offsets, topk_ids, mask=k_mask)
    counts = tl.sum(tl.where(t_mask[:, None], routed, 0), axis=0).to(tl.int64)
    tl.atomic_add(counts_ptr + experts, counts, mask=e_mask & (counts > 0))


@triton.jit
def _topk_routing_backward_kernel(
    scores_ptr,
    topk_ids_ptr,
    grad_topk_ptr,
    grad_scores_ptr,
    grad_logits_ptr,
    num_tokens,
    num_experts,
    route_scale,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    ROUTE_NORM: tl.constexpr,
    HAS_GRAD_TOPK: tl.constexpr,
    HAS_GRAD_SCORES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """d logits of BLOCK_T tokens from d topk_scores (through the normalisation and the gather)
    and d scores, through the score function."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    t_mask = tokens < num_tokens
    e_mask = experts < num_experts
    tile_mask = t_mask[:, None] & e_mask[None, :]
    offsets = tokens.to(tl.int64)[:, None] * num_experts + experts[None, :]
    scores = tl.load(scores_ptr + offsets, mask=tile_mask, other=0.0)
    if HAS_GRAD_SCORES:
        grad_scores = tl.load(grad_scores_ptr + offsets, mask=tile_mask, other=0.0)
    else:
        grad_scores = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_GRAD_TOPK:
        slots = tokens.to(tl.int64) * TOP_K
        if ROUTE_NORM:
            total = tl.zeros([BLOCK_T], dtype=tl.float32)
            weighted = tl.zeros([BLOCK_T], dtype=tl.float32)
            for k in tl.static_range(TOP_K):
                expert = tl.load(topk_ids_ptr + slots + k, mask=t_mask, other=0)
                score = tl.sum(tl.where(experts[None, :] == expert[:, None], scores, 0.0), axis=1)
                grad = tl.load(grad_topk_ptr + slots + k, mask=t_mask, other=0.0)
                total += score
                weighted += grad * score
            denominator = total + 1e-20
            shared = weighted / (denominator * denominator)
        for k in tl.static_range(TOP_K):
            expert = tl.load(topk_ids_ptr + slots + k, mask=t_mask, other=0)
            grad = tl.load(grad_topk_ptr + slots + k, mask=t_mask, other=0.0)
            if ROUTE_NORM:
                # pyrefly: ignore[unbound-name]  # Triton: bound under the same constexpr ROUTE_NORM
                grad = grad / denominator - shared
            pick = experts[None, :] == expert[:, None]
            grad_scores += tl.where(pick, (grad * route_scale)[:, None], 0.0)
    if SIGMOID:
        grad_logits = grad_scores * scores * (1.0 - scores)
    else:
        grad_logits = scores * (grad_scores - tl.sum(grad_scores * scores, axis=1)[:, None])
    tl.store(grad_logits_ptr + offsets, grad_logits, mask=tile_mask)


@kernel_op("topk_routing")
def _topk_routing_op(
    logits_TE: torch.Tensor,
    expert_bias_E: torch.Tensor | None,
    top_k: int,
    score_func: str,
    route_norm: bool,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_runnable(logits_TE, *(t for t in (expert_bias_E,) if t is not None))
    logits_TE = logits_TE.contiguous()
    num_tokens, num_experts = logits_TE.shape
    scores_TE = torch.empty_like(logits_TE)
    topk_scores_TK = logits_TE.new_empty(num_tokens, top_k)
    topk_ids_TK = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TE.device)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=logits_TE.device)
    block_t, block_e = _tile(num_experts)
    if num_tokens:
        _topk_routing_forward_kernel[(triton.cdiv(num_tokens, block_t),)](
            logits_TE,
            expert_bias_E.contiguous() if expert_bias_E is not None else logits_TE,
            scores_TE,
            topk_scores_TK,
            topk_ids_TK,
            counts_E,
            num_tokens,
            num_experts,
            float(route_scale),
            TOP_K=top_k,
            SIGMOID=score_func == "sigmoid",
            HAS_BIAS=expert_bias_E is not None,
            ROUTE_NORM=route_norm,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k),
        )
    return topk_scores_TK, topk_ids_TK, scores_TE, counts_E


@torch.library.register_fake(_topk_routing_op)
def _(logits_TE, expert_bias_E, top_k, score_func, route_norm, route_scale):
    num_tokens, num_experts = logits_TE.shape
    index = {"dtype": torch.int64, "device": logits_TE.device}
    return (
        logits_TE.new_empty(num_tokens, top_k),
        torch.empty(num_tokens, top_k, **index),
        torch.empty_like(logits_TE),
        torch.empty(num_experts, **index),
    )


@kernel_op("topk_routing_backward")
def _topk_routing_backward_op(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    grad_topk_scores_TK: torch.Tensor | None,
    grad_scores_TE: torch.Tensor | None,
    score_func: str,
    route_norm: bool,
    route_scale: float,
) -> torch.Tensor:
    """The logits' gradient from the gradients of the top-k scores and of the scores (None: zero)."""
    num_tokens, num_experts = scores_TE.shape
    grad_logits_TE = torch.empty_like(scores_TE)
    block_t, block_e = _tile(num_experts)
    if num_tokens:
        _topk_routing_backward_kernel[(triton.cdiv(num_tokens, block_t),)](
            scores_TE,
            topk_ids_TK,
            grad_topk_scores_TK.float().contiguous() if grad_topk_scores_TK is not None else scores_TE,
            grad_scores_TE.float().contiguous() if grad_scores_TE is not None else scores_TE,
            grad_logits_TE,
            num_tokens,
            num_experts,
            route_scale,
            TOP_K=topk_ids_TK.shape[1],
            SIGMOID=score_func == "sigmoid",
            ROUTE_NORM=route_norm,
            HAS_GRAD_TOPK=grad_topk_scores_TK is not None,
            HAS_GRAD_SCORES=grad_scores_TE is not None,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
        )
    return grad_logits_TE


@torch.library.register_fake(_topk_routing_backward_op)
def _(scores_TE, topk_ids_TK, grad_topk_scores_TK, grad_scores_TE, score_func, route_norm, route_scale):
    return torch.empty_like(scores_TE)


def _setup_context(ctx, inputs, output) -> None:
    _, _, _, score_func, route_norm, route_scale = inputs
    _, topk_ids_TK, scores_TE, counts_E = output
    ctx.mark_non_differentiable(topk_ids_TK, counts_E)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(scores_TE, topk_ids_TK)
    ctx.options = (score_func, route_norm, float(route_scale))


def _backward(ctx, grad_topk_scores_TK, _grad_ids, grad_scores_TE, _grad_counts):
    if grad_topk_scores_TK is None and grad_scores_TE is None:
        return (None,) * 6
    scores_TE, topk_ids_TK = ctx.saved_tensors
    grad_logits_TE = _topk_routing_backward_op(
        scores_TE, topk_ids_TK, grad_topk_scores_TK, grad_scores_TE, *ctx.options
    )
    return grad_logits_TE, None, None, None, None, None


torch.library.register_autograd(_topk_routing_op, _backward, setup_context=_setup_context)


def topk_routing_unsupported_reason(num_experts: int, top_k: int, score_func: str, dtype: torch.dtype) -> str | None:
    """Why :func:`topk_routing` cannot route these logits (None: it can)."""
    if score_func not in SCORE_FUNCS:
        return f"score function {score_func!r} is not one of {', '.join(SCORE_FUNCS)}"
    if dtype != torch.float32:
        return f"logits are {dtype}, the kernels route fp32 logits"
    if not 1 <= top_k <= num_experts <= MAX_EXPERTS:
        return f"needs 1 <= top_k ({top_k}) <= experts ({num_experts}) <= {MAX_EXPERTS}"
    return None


def topk_routing(
    logits_TE: torch.Tensor,
    expert_bias_E: torch.Tensor | None,
    top_k: int,
    score_func: str,
    route_norm: bool,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(topk_scores_TK, topk_expert_ids_TK, scores_TE, num_routed_per_expert_E)``; module docstring."""
    num_experts = logits_TE.shape[-1]
    reason = topk_routing_unsupported_reason(num_experts, top_k, score_func, logits_TE.dtype)
    if reason is not None:
        raise ValueError(f"topk_routing: {reason}")
    return _topk_routing_op(logits_TE, expert_bias_E, top_k, score_func, route_norm, float(route_scale))


def topk_routing_reference(
    logits_TE: torch.Tensor,
    expert_bias_E: torch.Tensor | None,
    top_k: int,
    score_func: str,
    route_norm: bool,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`topk_routing` (ties broken toward the lowest expert id, as the kernel does)."""
    num_experts = logits_TE.shape[-1]
    scores_TE = logits_TE.softmax(dim=-1) if score_func == "softmax" else logits_TE.sigmoid()
    choice_TE = scores_TE.detach() if expert_bias_E is None else scores_TE.detach() + expert_bias_E
    ids_by_value_TE = torch.argsort(choice_TE, dim=-1, descending=True, stable=True)
    topk_ids_TK = ids_by_value_TE[:, :top_k]
    topk_scores_TK = scores_TE.gather(-1, topk_ids_TK)
    if route_norm:
        topk_scores_TK = topk_scores_TK / (topk_scores_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_scores_TK * route_scale, topk_ids_TK, scores_TE, slot_counts(topk_ids_TK.reshape(-1), num_experts)
