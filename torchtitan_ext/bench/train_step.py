"""One full training step of a registered flavor on one device, per compute backend.

A step is: zero grads, forward of the whole model on synthetic tokens (uniform random ids,
``local_batch_size x seq_len`` of the flavor unless overridden), cross-entropy loss,
backward, AdamW step. The model is the flavor's model config built directly (no
parallelism, no FSDP, no activation checkpointing; compiled only as below); the backend is swapped with
the ``moe.compute_backend`` TOML key, so every backend trains the same model from the same
initial weights. On CUDA the step runs under bf16 autocast when the flavor's
``training.mixed_precision_param`` is bfloat16 (fp32 parameters); on CPU it runs in fp32
with torchtitan's FlexAttention replaced by causal SDPA (``compat.cpu``).

Reported: step ms (median, ``common.make_timer``), tokens/s and, on a GPU, model TFLOP/s
and MFU, from torchtitan's FLOP count of the model config (``get_nparams_and_flops``: 6 x
active parameters per token plus attention) and torchtitan's peak dense bf16 table
(H100/H200: 989 TFLOP/s), and the loss of the first timed step (the same for every backend
up to rounding: same weights, same tokens). Full-size flavors are refused on CPU.

A flavor built with torchtitan's own MoE layers (e.g. ``olmoe-1b-7b-torchtitan-moe``) has no
backend to switch: it gives rows of backend ``torchtitan``, the stock step to compare with, either
as the flavor measured or as the ``stock_flavor`` measured first at the same sizes. A backend that
runs out of memory gets a row with its error and no timings; the others still run.

Compiled variants compile the model as torchtitan's Trainer does with ``compile.enable``: its own
``apply_compile`` compiles each transformer block with ``fullgraph=True`` (and
``capture_scalar_outputs``). Every variant's first step, which compiles a compiled one, is timed
apart (``first_step_s``) before the timed steps; a compiled variant whose compilation fails gets a
row with the error. Speed-ups are over the stock step, eager and compiled, where measured.
"""

import gc
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torchtitan.config import CompileConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.attention import FlexAttention
from torchtitan.tools.utils import get_peak_flops

from torchtitan_ext.bench.common import (
    TINY_FLAVORS_HINT,
    compile_failure,
    environment,
    first_call_s,
    progress,
    refuse_full_size_on_cpu,
    speedup,
    variant_name,
    write_json,
)
from torchtitan_ext.compat.cpu import adapt_config_for_cpu, patch_torchtitan_for_cpu
from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import apply_overrides
from torchtitan_ext.config.value_sources import forget_value_sources
from torchtitan_ext.experiments.moe_backends.expert_timing import make_timer
from torchtitan_ext.experiments.moe_backends.experts import BackendGroupedExperts
from torchtitan_ext.run_training import resolve_config
from torchtitan_ext.validation import sequence_length_errors

TABLE = [
    ("flavor", "flavor"),
    ("backend", "backend"),
    ("compiled", "compiled"),
    ("layers", "layers"),
    ("tokens", "tokens/step"),
    ("dtype", "dtype"),
    ("step_ms", "step ms"),
    ("tokens_per_s", "tokens/s"),
    ("tflops", "TFLOP/s"),
    ("mfu", "MFU"),
    ("speedup_vs_stock", "x stock"),
    ("speedup_vs_stock_compiled", "x stock compiled"),
    ("first_loss", "step-1 loss"),
    ("first_step_s", "1st step s"),
    ("error", "error"),
]
STOCK_MOE = "torchtitan"
"""Backend label of a flavor built with torchtitan's own MoE layers (nothing to switch)."""


def has_switchable_experts(config) -> bool:
    """Whether the config's MoE layers take ``moe.compute_backend`` (this project's experts)."""
    return any(True for _ in config.model_spec.model.traverse(BackendGroupedExperts.Config))


def backends_to_run(flavor: str, tomls: list[str], requested: list[str] | None, default: list[str]) -> list[str]:
    """``requested`` (or ``default``) for a flavor with switchable experts, ``[STOCK_MOE]`` for one
    built with torchtitan's own MoE layers; ``ConfigError`` if backends are requested for the latter."""
    if has_switchable_experts(resolve_config(flavor, tomls)):
        return requested or default
    if requested:
        raise ConfigError(
            f"--backends: flavor {flavor} is built with torchtitan's own MoE layers, which have no compute_backend "
            "to switch; leave --backends out to time its stock training step"
        )
    return [STOCK_MOE]


def step_config(
    flavor: str, tomls: list[str], backend: str, *, batch_size: int | None, seq_len: int | None, num_layers: int | None
):
    """The flavor's ``Trainer.Config`` with the TOML files, ``backend`` (``STOCK_MOE``: as built) and the
    size overrides applied."""
    forget_value_sources()
    config = resolve_config(flavor, tomls)
    overrides: dict[str, object] = {} if backend == STOCK_MOE else {"moe.compute_backend": backend}
    if batch_size:
        overrides["training.local_batch_size"] = batch_size
    config = apply_overrides(config, overrides, source="train-step")
    if seq_len:
        config = apply_overrides(config, {"training.seq_len": seq_len}, source="--seq-len")
    if errors := sequence_length_errors(config):
        raise ConfigError("\n".join(errors))
    if num_layers:
        layers = config.model_spec.model.layers
        if not 1 <= num_layers <= len(layers):
            raise ConfigError(f"--num-layers must be in [1, {len(layers)}] for {flavor}, got {num_layers}")
        del layers[num_layers:]
    return config


def uses_flex_attention(model_config) -> bool:
    return any(True for _ in model_config.traverse(FlexAttention.Config))


ONE_DEVICE = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)


def bench_backend(
    config, backend: str, device: torch.device, timer, *, compiled: bool = False, compile_backend: str = "inductor"
) -> dict:
    """Build the model (``compiled``: each block compiled by torchtitan's ``apply_compile``), run its
    first step, time the steps after it, and return the row for ``backend``."""
    model_config = config.model_spec.model
    autocast_dtype = (
        torch.bfloat16 if device.type == "cuda" and config.training.mixed_precision_param == "bfloat16" else None
    )
    batch, seq_len = config.training.local_batch_size, config.training.seq_len
    torch.manual_seed(0)
    with torch.device(device):
        model = model_config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    if compiled:
        apply_compile(
            model, compile_config=CompileConfig(enable=True, backend=compile_backend), parallel_dims=ONE_DEVICE
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    tokens_BL = torch.randint(model_config.vocab_size, (batch, seq_len + 1), device=device, generator=generator)
    inputs_BL, labels_BL = tokens_BL[:, :-1], tokens_BL[:, 1:]
    positions_BL = torch.arange(seq_len, device=device).expand(batch, seq_len)
    masks = model.get_attention_masks(positions_BL) if uses_flex_attention(model_config) else None
    losses = []

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext():
            logits_BLV = model(inputs_BL, attention_masks=masks)
        loss = F.cross_entropy(logits_BLV.flatten(0, 1).float(), labels_BL.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    first_step_s = first_call_s(train_step, device)
    step_ms = timer(train_step)
    _, flops_per_token = model_config.get_nparams_and_flops(model, seq_len)
    tokens = batch * seq_len
    tokens_per_s = tokens / (step_ms / 1e3)
    on_gpu = device.type == "cuda"
    peak = get_peak_flops(torch.cuda.get_device_name(device)) if on_gpu else None
    return {
        **row_identity(config, backend, compiled),
        "dtype": str(autocast_dtype or torch.float32).removeprefix("torch."),
        "step_ms": round(step_ms, 3),
        "tokens_per_s": round(tokens_per_s, 1),
        "flops_per_token": flops_per_token,
        "tflops": round(flops_per_token * tokens_per_s / 1e12, 3) if on_gpu else None,
        "mfu": f"{flops_per_token * tokens_per_s / peak:.1%}" if peak else None,
        "first_loss": round(float(losses[0]), 4),
        "first_step_s": first_step_s,
    }


def run(
    flavor: str,
    tomls: list[str],
    backends: list[str],
    device: torch.device,
    command: str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    num_layers: int | None = None,
    out: str | None = None,
    stock_flavor: str | None = None,
    compile_modes: Sequence[bool] = (False,),
    compile_backend: str = "inductor",
) -> dict:
    """One row per backend and compile mode (``stock_flavor``'s stock rows first); ``out`` is
    rewritten after each row.

    Raises ``ConfigError`` for a full-size flavor on CPU, or a ``stock_flavor`` with this project's
    MoE layers.
    """
    sizes = {"batch_size": batch_size, "seq_len": seq_len, "num_layers": num_layers}
    configs = {}
    if stock_flavor:
        configs[stock_flavor, STOCK_MOE] = step_config(stock_flavor, [], STOCK_MOE, **sizes)
        if has_switchable_experts(configs[stock_flavor, STOCK_MOE]):
            raise ConfigError(
                f"--stock-flavor {stock_flavor} is built with this project's MoE layers; name a flavor built with "
                "torchtitan's own (python -m torchtitan_ext.flavors lists them, e.g. olmoe-1b-7b-torchtitan-moe)"
            )
    configs |= {(flavor, backend): step_config(flavor, tomls, backend, **sizes) for backend in backends}
    model_dim = max(config.model_spec.model.dim for config in configs.values())
    refuse_full_size_on_cpu("train-step", {f"flavor {flavor}": model_dim}, device, hint=TINY_FLAVORS_HINT)
    if device.type == "cpu":
        patch_torchtitan_for_cpu()
        for config in configs.values():
            adapt_config_for_cpu(config)
    timer = make_timer(device)
    results = {"meta": environment(command, device, torch.float32), "rows": []}
    results["meta"]["dtype"] = "see rows"
    if True in compile_modes:
        results["meta"]["compile_backend"] = compile_backend
    for (measured_flavor, backend), config in configs.items():
        for compiled in compile_modes:
            name = variant_name(backend, compiled)
            progress(f"  train step    {measured_flavor}  {name}")
            row = measure_variant(config, backend, device, timer, compiled, compile_backend)
            if "error" in row:
                progress(f"  train step    {measured_flavor}  {name}: {row['error']}; going on with the next")
            results["rows"].append(row)
            add_speedups(results["rows"])
            write_json(out, results)
    return results


def measure_variant(config, backend: str, device: torch.device, timer, compiled: bool, compile_backend: str) -> dict:
    """``bench_backend``'s row, or a row with the error where the step runs out of memory or, for a
    compiled variant, the compilation fails; compiled code is dropped after a compiled variant and the
    CUDA cache emptied after every variant."""
    row = None
    try:
        row = bench_backend(config, backend, device, timer, compiled=compiled, compile_backend=compile_backend)
    except torch.OutOfMemoryError:
        pass  # the model is freed once the exception is gone
    except Exception as error:
        if not compiled:
            raise
        row = failed_row(config, backend, compiled, compile_failure(error), device)
    if compiled:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the step's model is freed before the next backend's
    return row or failed_row(
        config, backend, compiled, "out of memory; try a smaller --batch-size or --num-layers", device
    )


def add_speedups(rows: list[dict]) -> None:
    """Each row's step-time speed-up over the stock step eager (``speedup_vs_stock``) and compiled
    (``speedup_vs_stock_compiled``); None where that stock step was not measured or failed."""
    stock_ms = {row["compiled"]: row["step_ms"] for row in rows if row["backend"] == STOCK_MOE}
    for row in rows:
        row["speedup_vs_stock"] = speedup(stock_ms.get(False), row["step_ms"])
        row["speedup_vs_stock_compiled"] = speedup(stock_ms.get(True), row["step_ms"])


def failed_row(config, backend: str, compiled: bool, error: str, device: torch.device) -> dict:
    """The row of a variant that did not run through, after freeing what it held."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {**row_identity(config, backend, compiled), "step_ms": None, "tokens_per_s": None, "error": error}


def row_identity(config, backend: str, compiled: bool) -> dict:
    """What a row measured: flavor, backend, compiled or not, layers and tokens per step."""
    return {
        "flavor": config.model_spec.flavor,
        "backend": backend,
        "compiled": compiled,
        "layers": len(config.model_spec.model.layers),
        "tokens": config.training.local_batch_size * config.training.seq_len,
    }
