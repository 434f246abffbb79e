"""List registered flavors, show one flavor's config, or list TOML keys.

    python -m torchtitan_ext.flavors
    python -m torchtitan_ext.flavors --show tiny-moe-grouped-mm --toml my.toml
    python -m torchtitan_ext.flavors --show tiny-moe-grouped-mm --full
    python -m torchtitan_ext.flavors --keys

The listing is cached in ``$TORCHTITAN_EXT_CACHE/flavors.json`` (default
``~/.cache/torchtitan_ext/``), keyed by the project's source files and the installed torch
and torchtitan (``command_facts.cached_by_sources``); a cache hit imports neither torch nor
torchtitan. Everything else builds the flavors' configs (torchtitan's Trainer and model code,
several seconds to import).
"""

import argparse
import json
import os
import re
import sys
from collections import Counter

from torchtitan_ext.command_facts import cached_by_sources, torchtitan_logger_quiet
from torchtitan_ext.stdout_pipe import until_the_reader_stops

LISTING_CACHE_NAME = "flavors.json"
LISTING_HEADER = ("flavor", "total", "active", "compute_backend", "description")


# ---------------------------------------------------------------------------
# Built from the configs (imports torch and torchtitan)


def _backend(experts_config) -> str:
    """The experts' compute backend; torchtitan's own experts compute like the default backend."""
    from torchtitan_ext.experiments.moe_backends.experts import DEFAULT_BACKEND, BackendGroupedExperts

    if isinstance(experts_config, BackendGroupedExperts.Config):
        return experts_config.compute_backend
    return f"{DEFAULT_BACKEND} (torchtitan)"


def compute_backends(model_config) -> str:
    """The distinct compute backends of a model's routed experts, comma-separated."""
    from torchtitan.models.common.moe import MoE

    backends = {_backend(moe.routed_experts.inner_experts) for _, moe, _, _ in model_config.traverse(MoE.Config)}
    return ",".join(sorted(backends)) or "-"


def listing_rows() -> list[list[str]]:
    """One row per registered flavor, cells as in ``LISTING_HEADER``."""
    from torchtitan_ext.model_size import human_count, parameter_counts
    from torchtitan_ext.registry import all_flavors

    rows = []
    for flavor in all_flavors():
        with torchtitan_logger_quiet():
            model_config = flavor.build_model_config()
        total, active = parameter_counts(model_config)
        rows.append(
            [flavor.name, human_count(total), human_count(active), compute_backends(model_config), flavor.description]
        )
    return rows


def cached_listing_rows() -> list[list[str]]:
    """``listing_rows()``, cached by the project's sources (``command_facts.cached_by_sources``)."""
    return cached_by_sources(LISTING_CACHE_NAME, listing_rows, "the flavor list")


def list_flavors() -> None:
    rows = cached_listing_rows()
    widths = [max(len(r[i]) for r in [LISTING_HEADER, *rows]) for i in range(4)]
    for row in [LISTING_HEADER, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])


def moe_layer_summary(model_config) -> str:
    """``N x (E experts, top-K, expert hidden F, compute_backend B, router S)`` per distinct MoE layer."""
    from torchtitan.models.common.moe import MoE

    kinds = Counter()
    for _, moe, _, _ in model_config.traverse(MoE.Config):
        experts = moe.routed_experts.inner_experts
        shared = ", shared experts" if getattr(moe, "shared_experts", None) is not None else ""
        kinds[
            f"{experts.num_experts} experts, top-{moe.router.top_k}, expert hidden {experts.hidden_dim}, "
            f"compute_backend {_backend(experts)}, router {moe.router.score_func}{shared}"
        ] += 1
    return "; ".join(f"{count} x ({kind})" for kind, count in kinds.items()) or "none"


def activation_checkpoint_mode(config) -> str:
    """The ``activation_checkpoint.mode`` the config's checkpointing section amounts to: "none",
    "selective", "full", or the section's class where it is another one."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    section = config.activation_checkpoint
    if section is None:
        return "none"
    if isinstance(section, SelectiveAC.Config):
        return "selective"
    if isinstance(section, FullAC.Config):
        return "full"
    return type(section).__qualname__


def cuda_graphs_summary(config) -> str:
    """``on``, ``off``, or where the MoE dispatchers' ``ep_receive_rows`` is ``"auto"``, off with the rule
    that may turn them on at start-up."""
    if not config.training.disable_cuda_graphs:
        return "on"
    from torchtitan_ext.experiments.moe_backends.cuda_graph_step import experts_graph_blockers
    from torchtitan_ext.experiments.moe_backends.layer import routing_dispatchers

    if blockers := experts_graph_blockers(config):
        return f"off ({'; '.join(blockers)})"
    if any(dispatcher.ep_receive_rows == "auto" for dispatcher in routing_dispatchers(config)):
        return "off (on under expert parallelism where moe.ep_receive_rows = 'auto' picks static rows)"
    return "off"


def experts_fsdp_summary(model_spec) -> str:
    """Where FSDP wraps the routed experts (``moe.experts_fsdp``), as ``--show`` says it on the parallelism
    line ("" for a model without routed experts)."""
    from torchtitan.models.common.moe import GroupedExperts

    from torchtitan_ext.experiments.moe_backends.parallelize import all_experts_fsdp_auto, has_known_fsdp_step

    experts = [config for _, config, _, _ in model_spec.model.traverse(GroupedExperts.Config)]
    if not experts:
        return ""
    if not all_experts_fsdp_auto(experts):
        return "; routed experts in FSDP on every layout (torchtitan's way)"
    if not has_known_fsdp_step(model_spec.parallelize_fn):
        return "; routed experts in FSDP on every layout (moe.experts_fsdp auto acts on Qwen3-parallelized models)"
    return "; routed experts outside FSDP where each lives on one rank (moe.experts_fsdp auto)"


def data_loading(dataloader) -> str:
    """Who loads a step's batch (``dataloader.num_workers``), as ``--show`` says it ("" for a data loader
    without worker processes)."""
    workers = getattr(dataloader, "num_workers", None)
    if workers is None:
        return ""
    if workers == 0:
        return "; workers 0 (the training process loads each batch)"
    return f"; workers {workers} (loading batches ahead of the step)"


def concise_view(name: str, tomls: list[str], config) -> list[str]:
    """The settings a user looks at first, one line per area, named like the TOML keys."""
    from torchtitan_ext.model_size import human_count, parameter_counts

    model_config = config.model_spec.model
    total, active = parameter_counts(model_config)
    training, parallelism, metrics, checkpoint = config.training, config.parallelism, config.metrics, config.checkpoint
    lr_scheduler = config.lr_scheduler
    learning_rates = sorted({group.optimizer_kwargs.get("lr") for group in config.optimizer.param_groups})
    lr = ", ".join(str(value) for value in learning_rates)
    moe_metrics = "on" if getattr(metrics, "moe_metrics", False) else "off"
    if moe_metrics == "on":
        moe_metrics += f" (heatmap_every {metrics.heatmap_every})"
    dataset = config.dataloader.dataset + (
        f" from {config.dataloader.dataset_path}" if config.dataloader.dataset_path else ""
    )
    checkpoints = (
        f"every {checkpoint.interval} steps to {os.path.join(config.dump_folder, checkpoint.folder)}"
        if checkpoint.enable
        else "off"
    )
    sections = [
        (
            "model",
            f"{config.model_spec.name}: {len(model_config.layers)} layers, dim {model_config.dim}, "
            f"vocab {model_config.vocab_size}; {human_count(total)} parameters, {human_count(active)} active per token",
        ),
        ("moe", moe_layer_summary(model_config)),
        (
            "training",
            f"steps {training.steps}, batch_size {training.local_batch_size}, seq_len {training.seq_len}, "
            f"lr {lr} (warmup {lr_scheduler.warmup_steps} steps, {lr_scheduler.decay_type} decay), "
            f"params in {training.mixed_precision_param}, compile {'on' if config.compile.enable else 'off'}, "
            f"activation_checkpoint {activation_checkpoint_mode(config)}, cuda_graphs {cuda_graphs_summary(config)}",
        ),
        (
            "parallelism",
            f"dp_shard {parallelism.data_parallel_shard_degree}, "
            f"dp_replicate {parallelism.data_parallel_replicate_degree}, "
            f"tp {parallelism.tensor_parallel_degree}, pp {parallelism.pipeline_parallel_degree}, "
            f"cp {parallelism.context_parallel_degree}, ep {parallelism.expert_parallel_degree}"
            f"{experts_fsdp_summary(config.model_spec)}",
        ),
        ("data", f"{dataset}; tokenizer {config.hf_assets_path}{data_loading(config.dataloader)}"),
        (
            "metrics",
            f"log_freq {metrics.log_freq}; moe_metrics {moe_metrics}; "
            f"wandb {'on' if metrics.enable_wandb else 'off'}; "
            f"tensorboard {'on' if metrics.enable_tensorboard else 'off'}",
        ),
        ("checkpoint", checkpoints),
        ("dump_folder", config.dump_folder),
    ]
    width = max(len(label) for label, _ in sections)
    toml_note = ", ".join(tomls) or "none"
    full = " ".join(["python -m torchtitan_ext.flavors --show", name, *(f"--toml {t}" for t in tomls), "--full"])
    return [
        f"{name}  (TOML files: {toml_note})",
        *(f"  {label.ljust(width)}  {text}" for label, text in sections),
        f"every field: {full}",
    ]


_PARTIAL_REPR = re.compile(r"functools\.partial\(<function (\S+) at 0x[0-9a-f]+>, (.*)\)", re.S)
_FUNCTION_REPR = re.compile(r"<function (\S+) at 0x[0-9a-f]+>")


def readable_callables(value):
    """``value`` (from ``Config.to_dict()``) with function reprs as names:
    ``functools.partial(<function normal_ at 0x..>, std=0.02)`` becomes ``normal_(std=0.02)``."""
    if isinstance(value, dict):
        return {key: readable_callables(item) for key, item in value.items()}
    if isinstance(value, list):
        return [readable_callables(item) for item in value]
    if isinstance(value, str):
        return _FUNCTION_REPR.sub(r"\1", _PARTIAL_REPR.sub(r"\1(\2)", value))
    return value


def show_flavor(name: str, tomls: list[str], *, full: bool) -> None:
    from torchtitan_ext.run_training import resolve_config

    with torchtitan_logger_quiet():
        config = resolve_config(name, tomls)
    if not full:
        print("\n".join(concise_view(name, tomls, config)))
        return
    resolved = config.to_dict()
    resolved.pop("model_spec", None)
    resolved = {"flavor": name, "toml_files": tomls, "model": config.model_spec.model.to_dict(), **resolved}
    print(json.dumps(readable_callables(resolved), indent=2, default=repr))


def list_short_keys() -> None:
    from torchtitan_ext.config.short_keys import short_keys
    from torchtitan_ext.registry import all_flavors

    all_flavors()  # experiments register their keys on import
    width = max(len(k.key) for k in short_keys())
    for key in short_keys():
        print(f"{key.key.ljust(width)}  {key.help}")


def main(argv: list[str] | None = None) -> int:
    return until_the_reader_stops(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.flavors",
        description="List registered flavors (with parameter counts and compute backend), "
        "or print one flavor's settings after TOML overrides.",
    )
    parser.add_argument("--show", metavar="NAME", help="print the main settings of flavor NAME")
    parser.add_argument("--full", action="store_true", help="with --show: every config field, as JSON")
    parser.add_argument(
        "--keys", action="store_true", help="list the short TOML keys (any config field path also works)"
    )
    parser.add_argument(
        "--toml",
        action="append",
        default=[],
        metavar="FILE",
        help="TOML overrides applied before --show (repeatable, later wins)",
    )
    args = parser.parse_args(argv)
    if args.toml and not args.show:
        parser.error("--toml only applies together with --show NAME")
    if args.full and not args.show:
        parser.error("--full only applies together with --show NAME")
    from torchtitan_ext.config import ConfigError

    try:
        if args.keys:
            list_short_keys()
        elif args.show:
            show_flavor(args.show, args.toml, full=args.full)
        else:
            list_flavors()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
