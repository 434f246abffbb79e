"""``moe.compute_backend = "auto"``: the fastest available backend for a model's MoE shapes here.

Resolution happens once at start-up (a config check, before any process group or model is
built) and writes a concrete backend into every ``BackendGroupedExperts.Config``, so the
model never sees "auto". The choice is the backend with the smallest forward+backward time
summed over the model's MoE layers, at the run's tokens per step (local batch size x sequence
length), balanced routing, of what the run will execute:

- one device (expert parallel degree 1): the whole MoE layer (router, then the dispatcher and
  combine, or a backend's fused routed path that skips them);
- expert parallelism: the expert block on rows already grouped by expert
  (``expert_timing.expert_inputs``), which is what every backend computes after the all-to-all.

Choices are cached in ``$TORCHTITAN_EXT_CACHE/auto_backend.json`` (default
``~/.cache/torchtitan_ext/``), keyed by device name, torch version, dtype, the MoE shapes,
what is measured and the candidate backends (the backends of the table that run here). A single
process measures on a cache miss; under torchrun (a world of several ranks) every rank reads
the cache and a miss is an error asking for ``python -m torchtitan_ext.bench auto --flavor NAME``
first, so all ranks choose alike.
"""

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torchtitan.models.common.moe import MoE
from torchtitan.tools.logging import logger

from torchtitan_ext.place_in_launch import is_rank_zero, world_size

from .cache import CACHE_ENV, cache_dir
from .expert_timing import BenchShape, TimedCall, expert_inputs, make_timer, seeded_generator
from .experts import (
    BackendGroupedExperts,
    fp8_backends,
    get_backend,
    resolved_at_startup,
    runnable_backends,
)
from .fp8_experts import FP8_PRECISIONS
from .layer import moe_layer_config


class AutoBackendError(ValueError):
    """``auto`` cannot be resolved here (a cache miss where measuring is not allowed)."""


AUTO_COMMAND_OUTLINE = (
    "python -m torchtitan_ext.bench auto --flavor NAME [--toml FILE] [--batch-size B --seq-len L] "
    "[--expert-parallel-degree N]"
)


class UncachedAutoChoice(AutoBackendError):
    """No cached choice for ``key`` in ``path``, where this process may not measure (several ranks
    would measure apart); ``message(command)`` names the command that measures it."""

    def __init__(self, key: str, path: Path):
        self.key, self.path = key, path
        super().__init__(self.message(AUTO_COMMAND_OUTLINE, "with the run's settings "))

    def message(self, command: str, settings: str = "") -> str:
        return (
            f"moe.compute_backend = 'auto': no cached choice for {self.key} in {self.path}, and several "
            f"processes would measure apart; run the single-process `{command}` {settings}first "
            f"(same {CACHE_ENV}), or set a backend: {', '.join(runnable_backends())} (those that run here)"
        )


CACHE_FILE_NAME = "auto_backend.json"

Measure = Callable[[BenchShape, list[str]], dict[str, float]]
"""``measure(shape, backends) -> {backend: forward+backward ms}`` of one MoE layer or expert block,
the backends timed against each other (``Timer.round``: on a GPU they take turns call by call)."""

MEASURED_ON_ONE_DEVICE = "MoE layer"
MEASURED_UNDER_EP = "expert block"


@dataclass(frozen=True)
class AutoChoice:
    backend: str
    ms_per_step: dict[str, float]
    """Forward+backward ms per training step (all MoE layers) of ``measured``, per candidate."""
    cached: bool
    cache_key: str
    measured: str
    """``MEASURED_ON_ONE_DEVICE`` or ``MEASURED_UNDER_EP``."""


def cache_file() -> Path:
    return cache_dir() / CACHE_FILE_NAME


def moe_layer_shapes(model_config, tokens: int) -> dict[BenchShape, int]:
    """{expert-block shape at ``tokens`` tokens: number of MoE layers with it}."""
    counts: dict[BenchShape, int] = {}
    for _, moe, _, _ in model_config.traverse(MoE.Config):
        experts = moe.routed_experts.inner_experts
        shape = BenchShape(
            f"D{experts.dim}-F{experts.hidden_dim}-E{experts.num_experts}-K{moe.router.top_k}",
            tokens,
            experts.dim,
            experts.hidden_dim,
            experts.num_experts,
            moe.router.top_k,
        )
        counts[shape] = counts.get(shape, 0) + 1
    return counts


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cache_key(
    device: torch.device, dtype: torch.dtype, layer_shapes: dict[BenchShape, int], candidates: list[str], measured: str
) -> str:
    shapes = ",".join(f"{s.name}-T{s.tokens}x{n}" for s, n in sorted(layer_shapes.items(), key=lambda i: i[0].name))
    return "|".join(
        [
            device_name(device),
            f"torch {torch.__version__}",
            str(dtype).removeprefix("torch."),
            shapes,
            measured,
            "+".join(candidates),
        ]
    )


def expert_block_measure(device: torch.device, dtype: torch.dtype) -> Measure:
    """A short real measurement: a few forward+backward passes of each backend's expert block on
    the same grouped rows, median ms (``make_timer``'s ``round``)."""
    timer = make_timer(device, warmup_ms=10, repeat_ms=40)

    def measure(shape: BenchShape, backends: list[str]) -> dict[str, float]:
        inputs = expert_inputs(shape, 0.0, device, dtype)
        grad_RD = torch.randn(inputs.x_RD.shape, device=device, dtype=dtype)

        def forward_backward(compute):
            return lambda: torch.autograd.backward(compute(inputs.x_RD, *inputs.weights, inputs.counts_E), grad_RD)

        leaves = [inputs.x_RD, *inputs.weights]
        return timer.round({backend: (forward_backward(get_backend(backend).grouped), leaves) for backend in backends})

    return measure


def layer_measure(device: torch.device, dtype: torch.dtype) -> Measure:
    """The whole single-device MoE layer of each backend (``moe_layer_config``), the same seeded
    weights and tokens for all."""
    timer = make_timer(device, warmup_ms=10, repeat_ms=40)

    def measure(shape: BenchShape, backends: list[str]) -> dict[str, float]:
        def randn(generator: torch.Generator, *size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, generator=generator).to(dtype)

        token_generator = seeded_generator(device)
        x_BLD = randn(token_generator, 1, shape.tokens, shape.dim).requires_grad_()
        grad_BLD = randn(token_generator, *x_BLD.shape)
        calls: dict[str, TimedCall] = {}
        for backend in backends:
            with torch.device(device):
                layer = moe_layer_config(compute_backend=backend, **shape.layer_kwargs()).build()
            layer = layer.to(dtype).train()
            weight_generator = seeded_generator(device)
            with torch.no_grad():
                for _, param in sorted(layer.named_parameters()):
                    param.copy_(randn(weight_generator, *param.shape) * param.shape[-1] ** -0.5)
            calls[backend] = (
                lambda layer=layer: torch.autograd.backward(layer(x_BLD), grad_BLD),
                [x_BLD, *layer.parameters()],
            )
        return timer.round(calls)

    return measure


def choose_backend(
    layer_shapes: dict[BenchShape, int], candidates: list[str], measure: Measure
) -> tuple[str, dict[str, float]]:
    """(fastest candidate, ms per step per candidate); ties go to the earlier candidate."""
    ms_per_step = dict.fromkeys(candidates, 0.0)
    for shape, count in layer_shapes.items():
        print(f"  auto backend  measuring {', '.join(candidates)} at {shape.name}", file=sys.stderr, flush=True)
        for backend, ms in measure(shape, candidates).items():
            ms_per_step[backend] += count * ms
    ms_per_step = {backend: round(ms, 4) for backend, ms in ms_per_step.items()}
    return min(ms_per_step, key=ms_per_step.__getitem__), ms_per_step


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def resolve(
    layer_shapes: dict[BenchShape, int],
    device: torch.device,
    dtype: torch.dtype,
    *,
    expert_parallel: bool,
    may_measure: bool,
    remeasure: bool = False,
    measure: Measure | None = None,
) -> AutoChoice:
    """The cached choice for these shapes here, or (``may_measure``) a fresh measurement, cached.

    ``expert_parallel`` selects what is measured (see the module docstring).
    """
    candidates = runnable_backends()
    measured = MEASURED_UNDER_EP if expert_parallel else MEASURED_ON_ONE_DEVICE
    key = cache_key(device, dtype, layer_shapes, candidates, measured)
    path = cache_file()
    cache = _read_cache(path)
    if key in cache and not remeasure:
        entry = cache[key]
        return AutoChoice(entry["backend"], entry["ms_per_step"], True, key, measured)
    if not may_measure:
        raise UncachedAutoChoice(key, path)
    if len(candidates) == 1:
        backend, ms_per_step = candidates[0], {}
    else:
        default_measure = expert_block_measure if expert_parallel else layer_measure
        backend, ms_per_step = choose_backend(layer_shapes, candidates, measure or default_measure(device, dtype))
    cache[key] = {"backend": backend, "ms_per_step": ms_per_step}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(cache, indent=1, sort_keys=True))
    temporary.replace(path)
    return AutoChoice(backend, ms_per_step, False, key, measured)


def training_device_and_dtype(config) -> tuple[torch.device, torch.dtype]:
    """Where and in what dtype the experts of this ``Trainer.Config`` compute (one GPU or CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), getattr(torch, config.training.mixed_precision_param)
    return torch.device("cpu"), torch.float32


def resolve_for_config(config, *, remeasure: bool = False, measure: Measure | None = None) -> AutoChoice:
    """The choice for a ``Trainer.Config``'s MoE layers at its local batch x sequence length."""
    device, dtype = training_device_and_dtype(config)
    tokens = config.training.local_batch_size * config.training.seq_len
    layer_shapes = moe_layer_shapes(config.model_spec.model, tokens)
    may_measure = world_size() == 1
    return resolve(
        layer_shapes,
        device,
        dtype,
        expert_parallel=config.parallelism.expert_parallel_degree > 1,
        may_measure=may_measure,
        remeasure=remeasure,
        measure=measure,
    )


def auto_fp8_precisions(config) -> list[str]:
    """The FP8 precisions of the experts whose backend is "auto" (sorted; none: "auto" can measure them)."""
    return sorted(
        {
            experts.expert_precision
            for _, experts, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)
            if resolved_at_startup(experts.compute_backend) and experts.expert_precision in FP8_PRECISIONS
        }
    )


def auto_fp8_refusal(precision: str, key: Callable[[str], str] = str) -> str:
    """Why "auto" cannot choose the backend of FP8 experts, naming an option ``field`` as ``key(field)``."""
    return (
        f"{key('moe.expert_precision')} = {precision!r}: {key('moe.compute_backend')} = 'auto' measures the "
        "backends in the activations' dtype, not in FP8; FP8 rowwise experts compute with "
        + " or ".join(fp8_backends())
    )


def resolve_auto_compute_backend(
    config, *, measure: Measure | None = None, key: Callable[[str], str] = str
) -> AutoChoice | None:
    """Replace ``"auto"`` in every ``BackendGroupedExperts.Config`` by the chosen backend; log it.

    Returns the choice, or None when no layer asks for "auto". FP8 experts raise ``AutoBackendError``
    (``auto_fp8_refusal``, naming an option ``field`` as ``key(field)``).
    """
    experts = [
        experts
        for _, experts, _, _ in config.model_spec.model.traverse(BackendGroupedExperts.Config)
        if resolved_at_startup(experts.compute_backend)
    ]
    if not experts:
        return None
    if fp8 := auto_fp8_precisions(config):
        raise AutoBackendError(auto_fp8_refusal(fp8[0], key))
    choice = resolve_for_config(config, measure=measure)
    for experts_config in experts:
        experts_config.compute_backend = choice.backend
    if is_rank_zero():
        source = "cached" if choice.cached else "measured"
        logger.info(
            f"moe.compute_backend = 'auto' -> {choice.backend!r} ({source}: {choice.measured} fwd+bwd "
            f"ms per step {choice.ms_per_step}; key {choice.cache_key}; cache {cache_file()})"
        )
    return choice
