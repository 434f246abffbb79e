"""What the ``auto`` backend choice and the benchmarks measure: expert-block shapes, seeded
inputs and a timer.

GPU timings are medians from CUDA events after warm-up (``triton.testing.do_bench`` for one
function; functions compared in a round take turns call by call, ``interleaved_round``); CPU
timings are medians of ``torch.utils.benchmark.Timer.blocked_autorange`` blocks after warm-up
calls, on one thread, in process CPU time: time the process spends computing, not time it
waits for a core. On a busy 2-core machine, wall-clock timings of the tiny shapes on all
threads varied up to a thousandfold from run to run; these stay within a few percent.
Routing and inputs come from seeded generators, so every run measures the same tokens.
"""

import abc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.utils.benchmark as torch_benchmark

from .model_shapes import MoELayerShape

SEED = 0
"""Seed of every measurement's routing and inputs."""


@dataclass(frozen=True)
class BenchShape:
    """One MoE layer's dimensions and the tokens it sees per step."""

    name: str
    tokens: int
    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int

    @classmethod
    def of_layer(cls, name: str, tokens: int, layer: MoELayerShape) -> "BenchShape":
        """The dimensions of ``layer`` seeing ``tokens`` tokens per step."""
        return cls(name, tokens, layer.dim, layer.moe_hidden_dim, layer.num_experts, layer.top_k)

    @property
    def routed_rows(self) -> int:
        return self.tokens * self.top_k

    def layer_kwargs(self) -> dict:
        return dict(dim=self.dim, hidden_dim=self.hidden_dim, num_experts=self.num_experts, top_k=self.top_k)


def seeded_generator(device, seed: int = SEED) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def route(
    num_tokens: int, num_experts: int, top_k: int, skew: float, device, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK, scores_TK): top-k of random softmax logits, renormalised; skew favours low ids."""
    logits_TE = torch.randn(num_tokens, num_experts, device=device, generator=generator)
    if skew:
        logits_TE = logits_TE + torch.linspace(skew, 0, num_experts, device=device)
    scores_TK, ids_TK = logits_TE.softmax(dim=-1).topk(top_k, dim=-1)
    return ids_TK, scores_TK / scores_TK.sum(dim=-1, keepdim=True)


class ExpertInputs(NamedTuple):
    """Leaf tensors of one expert-block measurement (``weights`` = (w1_EFD, w2_EDF, w3_EFD))."""

    ids_TK: torch.Tensor
    scores_TK: torch.Tensor
    counts_E: torch.Tensor
    x_TD: torch.Tensor
    x_RD: torch.Tensor
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def expert_inputs(shape: BenchShape, skew: float, device, dtype) -> ExpertInputs:
    """Seeded random routing (see ``route``), tokens, the same tokens grouped by expert, and weights."""
    generator = seeded_generator(device)
    ids_TK, scores_TK = route(shape.tokens, shape.num_experts, shape.top_k, skew, device, generator)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=shape.num_experts)
    slot_S = torch.argsort(ids_TK.reshape(-1), stable=True)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, generator=generator).to(dtype)

    x_TD = randn(shape.tokens, shape.dim).requires_grad_()
    x_RD = x_TD.detach()[slot_S // shape.top_k].clone().requires_grad_()
    E, D, F = shape.num_experts, shape.dim, shape.hidden_dim
    weights = (
        (randn(E, F, D) * D**-0.5).requires_grad_(),
        (randn(E, D, F) * F**-0.5).requires_grad_(),
        (randn(E, F, D) * D**-0.5).requires_grad_(),
    )
    return ExpertInputs(ids_TK, scores_TK.to(dtype).requires_grad_(), counts_E, x_TD, x_RD, weights)


def _resetting_grads(fn: Callable[[], object], grad_to_none) -> Callable[[], None]:
    """``fn`` preceded by setting the ``grad`` of every tensor in ``grad_to_none`` to None."""

    def call():
        for tensor in grad_to_none or ():
            tensor.grad = None
        fn()

    return call


def host_issue_ms(
    fn: Callable[[], object],
    grad_to_none=(),
    *,
    calls: int = 3,
    rounds: int = 5,
    synchronize: Callable[[], None] = torch.cuda.synchronize,
) -> float:
    """Host ms to issue one call of ``fn`` while the GPU is busy with the calls before it.

    Each of ``rounds`` rounds synchronizes, issues one untimed call (the first call after a
    synchronize costs the host more), then times ``calls`` calls issued back to back; the result
    is the median over rounds of the time per call. A few calls per round keep CUDA's launch
    queue (about a thousand kernels) from filling, which would make the host wait for the GPU.
    ``grad_to_none`` tensors lose their grads before each call. On a GPU, when this comes near
    the time per call, the GPU waits on the host (Python, launches, any host sync inside ``fn``).
    """
    call = _resetting_grads(fn, grad_to_none)
    per_call = []
    for _ in range(rounds):
        synchronize()
        call()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - start) / calls)
    synchronize()
    return statistics.median(per_call) * 1e3


TimedCall = tuple[Callable[[], object], Sequence[torch.Tensor]]
"""A function to time and the tensors whose ``grad`` is set to None before each of its calls."""


class Timer(abc.ABC):
    """Median milliseconds of calls on one device.

    ``timer(fn, grad_to_none=None)`` times one function; ``timer.round(calls)`` times several
    against each other, one round of a comparison (see ``time_in_rounds`` in the benchmarks).
    """

    @abc.abstractmethod
    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
        """``fn``'s median ms; ``grad_to_none`` tensors lose their grads before each call."""

    def round(self, calls: dict[str, TimedCall]) -> dict[str, float]:
        """Each name's median ms, the names timed one after the other."""
        return {name: self(fn, grad_to_none=grads) for name, (fn, grads) in calls.items()}


class CpuTimer(Timer):
    """Warm-up calls for ``warmup_ms`` (at least one), then ``blocked_autorange`` on one thread, in
    process CPU time, for at least ``repeat_ms`` and five calls' time."""

    def __init__(self, warmup_ms: float, repeat_ms: float):
        self.warmup_ms, self.repeat_ms = warmup_ms, repeat_ms

    def __call__(self, fn, grad_to_none=None):
        call = _resetting_grads(fn, grad_to_none)
        calls, start = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - start < self.warmup_ms / 1e3:
            call()
            calls += 1
        seconds_per_call = (time.perf_counter() - start) / calls
        timer = torch_benchmark.Timer(stmt="call()", globals={"call": call}, num_threads=1, timer=time.process_time)
        measurement = timer.blocked_autorange(min_run_time=max(self.repeat_ms / 1e3, 5 * seconds_per_call))
        return measurement.median * 1e3


L2_FLUSH_BYTES = 256 * 2**20
"""Bytes written before every timed GPU call, so that no call finds its operands in the L2 cache
(as ``triton.testing.do_bench`` does)."""
MIN_CALLS_PER_ROUND = 5


def turn_order(names: Sequence[str], calls_per_name: int) -> list[str]:
    """The call order of one interleaved round: each name ``calls_per_name`` times, the names taking
    turns call by call, in reverse order every other turn (no name always follows the same one)."""
    order = []
    for turn in range(calls_per_name):
        order += list(names) if turn % 2 == 0 else list(reversed(names))
    return order


def interleaved_round(
    calls: dict[str, TimedCall],
    time_calls: Callable[[list[Callable[[], None]]], list[float]],
    repeat_ms: float,
    min_calls: int = MIN_CALLS_PER_ROUND,
) -> dict[str, float]:
    """One round of a comparison with the names taking turns call by call (``turn_order``); each
    name's median ms.

    ``time_calls(fns)`` runs the functions in order and returns each one's ms. Each name is called
    once untimed (compilation, caches), then three timed calls estimate its time; each name then
    gets the same number of calls, enough for about ``repeat_ms`` per name on average and at least
    ``min_calls``. Grads of a name's tensors are reset before each of its calls.
    """
    resetting = {name: _resetting_grads(fn, grads) for name, (fn, grads) in calls.items()}
    for call in resetting.values():
        call()
    estimate_ms = sum(statistics.median(time_calls([call] * 3)) for call in resetting.values())
    calls_per_name = max(min_calls, math.ceil(repeat_ms * len(calls) / max(estimate_ms, 1e-6)))
    order = turn_order(list(calls), calls_per_name)
    times = time_calls([resetting[name] for name in order])
    return {name: statistics.median(ms for ran, ms in zip(order, times) if ran == name) for name in calls}


class CudaTimer(Timer):
    """One function: ``triton.testing.do_bench`` (``warmup_ms`` then ``repeat_ms`` of calls).

    A round of several: ``interleaved_round``. Each timed call comes right after an untimed call
    of the same function and an L2 flush, and is timed alone with CUDA events: the host issues it
    while the GPU runs the call before, as in a loop of that function, whatever function ran
    before the pair. A GPU under its power limit changes its clocks from second to second, so
    functions timed one after the other for 100 ms each can see different clocks; taking turns
    call by call, they see the same ones.
    """

    def __init__(self, device: torch.device, warmup_ms: float, repeat_ms: float):
        self.device, self.warmup_ms, self.repeat_ms = device, warmup_ms, repeat_ms
        self._flush = None

    def __call__(self, fn, grad_to_none=None):
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.warmup_ms, rep=self.repeat_ms, return_mode="median", grad_to_none=grad_to_none)

    def _time_calls(self, fns: list[Callable[[], None]]) -> list[float]:
        if self._flush is None:
            self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=self.device)
        events = []
        for fn in fns:
            fn()
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) for start, end in events]

    def round(self, calls):
        return interleaved_round(calls, self._time_calls, self.repeat_ms)


def make_timer(device: torch.device, *, warmup_ms: int = 25, repeat_ms: int = 100) -> Timer:
    """The ``Timer`` of ``device``: ``CudaTimer`` on CUDA, ``CpuTimer`` elsewhere."""
    if device.type == "cuda":
        return CudaTimer(device, warmup_ms, repeat_ms)
    return CpuTimer(warmup_ms, repeat_ms)
