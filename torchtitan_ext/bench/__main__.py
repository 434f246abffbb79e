"""Benchmarks: which compute_backend to use for a model on this hardware.

    python -m torchtitan_ext.bench expert --flavor qwen3-30b-a3b           # expert block per backend
    python -m torchtitan_ext.bench layer --shapes mixtral-8x7b              # MoE layer vs stock, eager and compiled
    torchrun --nproc_per_node=4 -m torchtitan_ext.bench ep --json ep.json   # EP dispatch/combine (GPUs)
    python -m torchtitan_ext.bench train-step --flavor tiny-moe-for-loop    # training step per backend (GPU: +compiled)
    python -m torchtitan_ext.bench auto --flavor tiny-moe-for-loop          # fill the "auto" backend cache
    python -m torchtitan_ext.bench plot --from result.json --out result.png
    python -m torchtitan_ext.bench trace rank0_trace.json.gz                # where a profiled step's time went
    python -m torchtitan_ext.bench memory 000000_step_6.pickle              # where the reserved memory came from

Progress goes to stderr, the table to stdout; ``--json`` and ``--plot`` write the results.
Without CUDA everything runs on CPU in fp32, timed with torch.utils.benchmark and reported
in ms (small shapes only: full-size ones are refused; the Triton backends only with
TRITON_INTERPRET=1); with CUDA timings are medians over CUDA events after warm-up, with TFLOP/s.
"""

import argparse
import dataclasses
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torchtitan.models.common.moe import MoE

from torchtitan_ext.bench import expert_block, memory_snapshot, moe_layer, plot, trace
from torchtitan_ext.bench.common import (
    COMPILE_BACKENDS,
    COMPILE_MODES,
    SHAPES,
    SKEW_NAMES,
    SKEWS,
    TINY_FLAVORS_HINT,
    TINY_SHAPE,
    Needs,
    compile_modes,
    print_kernel_profiles,
    print_table,
    progress,
    refuse_full_size_on_cpu,
    unavailable_reasons,
    write_json,
)
from torchtitan_ext.compat.quiet_cpu import quiet_cpu_warnings
from torchtitan_ext.compat.torch_versions import apply_torch_version_fixes
from torchtitan_ext.config import ConfigError
from torchtitan_ext.experiments.moe_backends import auto_backend
from torchtitan_ext.experiments.moe_backends.dispatcher import PERMUTE_BACKENDS
from torchtitan_ext.experiments.moe_backends.expert_timing import BenchShape
from torchtitan_ext.experiments.moe_backends.experts import AUTO_BACKEND, BACKENDS, runnable_backends
from torchtitan_ext.parallel_layout import expert_share_errors
from torchtitan_ext.place_in_launch import world_size
from torchtitan_ext.validation import named

PROG = "python -m torchtitan_ext.bench"


def _trainer_stack():
    """The modules that build torchtitan Trainer configs (torch >= 2.13), imported on first use so
    that the expert, layer and EP benchmarks also run on older torch."""
    from torchtitan_ext.bench import train_step
    from torchtitan_ext.run_training import resolve_config

    return train_step, resolve_config


SKEW_CHOICES = {**{name: (skew,) for name, skew in SKEW_NAMES.items()}, "both": SKEWS}
EP_TABLE = [
    ("world", "world"),
    ("tokens_per_rank", "T/rank"),
    ("dim", "D"),
    ("routing", "routing"),
    ("transport", "transport"),
    ("receive_rows", "received rows"),
    ("launch", "launch"),
    ("permute_backend", "permute"),
    ("dispatch_combine_ms", "d+c ms"),
    ("raw_a2a_ms", "raw a2a ms"),
    ("raw_a2a_unique_ms", "raw a2a unique ms"),
    ("dispatch_combine_GBps", "d+c GB/s"),
    ("raw_a2a_GBps", "raw GB/s"),
    ("fraction_of_raw", "fraction"),
    ("fraction_of_raw_unique", "fraction unique"),
    ("dispatch_combine_host_ahead_ms", "d+c ms host ahead"),
    ("raw_a2a_host_ahead_ms", "raw ms host ahead"),
    ("fraction_of_raw_host_ahead", "fraction host ahead"),
]
AUTO_TABLE = [("backend", "backend"), ("ms_per_step", "fwd+bwd ms per step"), ("chosen", "chosen")]


def add_rounds_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help=f"time every {what} N times, taking turns, and report the medians "
        "(per-round times in the JSON); evens out a GPU's slow stretches",
    )


def check_rounds(parser: argparse.ArgumentParser, rounds: int) -> None:
    if rounds < 1:
        parser.error(f"--rounds must be >= 1, got {rounds}")


def add_compile_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        help=f"time each {what} eager, compiled (torch.compile with fullgraph=True, as torchtitan compiles "
        "its blocks) or both (default: both on CUDA, eager on CPU, where Inductor compiles for minutes)",
    )
    parser.add_argument(
        "--compile-backend",
        choices=COMPILE_BACKENDS,
        default="inductor",
        help="torch.compile backend of the compiled variants (default inductor, torchtitan's; "
        "aot_eager runs the traced graphs with eager ops and compiles in seconds on CPU)",
    )


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the results")


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    shapes = parser.add_argument_group("shapes (one source; default: the named shapes on CUDA, --tiny on CPU)")
    shapes.add_argument("--flavor", help="read D, F, E, K and tokens (batch x seq_len) from this flavor")
    shapes.add_argument("--toml", action="append", default=[], metavar="FILE", help="TOML overrides of --flavor")
    shapes.add_argument("--dim", type=int, help="model dim D (with --hidden --experts --top-k)")
    shapes.add_argument("--hidden", type=int, help="expert hidden dim F")
    shapes.add_argument("--experts", type=int, help="number of experts E")
    shapes.add_argument("--top-k", type=int, help="experts per token K")
    shapes.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="named shapes")
    shapes.add_argument("--tiny", action="store_true", help=f"the tiny shape {TINY_SHAPE}")
    shapes.add_argument("--tokens", type=int, help="tokens per step (overrides the shape's)")
    parser.add_argument("--skew", choices=SKEW_CHOICES, default="both", help="routing: balanced, skewed or both")
    parser.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:9]),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    expert = commands.add_parser("expert", help="the expert block (3 GEMMs) per compute backend, fwd and fwd+bwd")
    add_shape_options(expert)
    expert.add_argument(
        "--impls", nargs="+", choices=expert_block.IMPLS, help="implementations (default: every one that runs here)"
    )
    add_rounds_option(expert, "implementation")
    add_output_options(expert)

    layer = commands.add_parser("layer", help="the whole MoE layer per backend vs stock torchtitan")
    add_shape_options(layer)
    layer.add_argument(
        "--layers",
        nargs="+",
        choices=moe_layer.KINDS,
        help=f"layers (default: every one that runs here; {moe_layer.STOCK} always runs first)",
    )
    layer.add_argument("--batch", type=int, default=2, help="batch B of the (B, tokens/B, D) input")
    add_compile_options(layer, "layer")
    layer.add_argument(
        "--compiled-layers",
        nargs="+",
        choices=moe_layer.KINDS,
        help="layers given a compiled variant (default: those of --layers among "
        f"{', '.join(moe_layer.COMPILED_BY_DEFAULT)}; {moe_layer.STOCK} always); without --compile, "
        "naming them times both",
    )
    add_rounds_option(layer, "layer")
    layer.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also list each layer's N slowest GPU kernels (CPU: operators) in one forward+backward",
    )
    add_output_options(layer)

    ep = commands.add_parser("ep", help="EP dispatch+combine vs raw NCCL all-to-all (torchrun, >= 2 GPUs)")
    ep.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192], help="tokens per rank")
    ep.add_argument("--dims", type=int, nargs="+", default=[2048, 7168], help="model dims")
    ep.add_argument("--check", action="store_true", help="run the EP equivalence check first")
    ep.add_argument(
        "--check-backends",
        nargs="+",
        choices=tuple(BACKENDS),
        help="compute backends the equivalence check covers (default: every one)",
    )
    ep.add_argument(
        "--permute-backends",
        nargs="+",
        default=["triton"],
        choices=PERMUTE_BACKENDS,
        help="permute backend(s) of the all_to_all transport",
    )
    add_output_options(ep)

    step = commands.add_parser("train-step", help="one training step (fwd+bwd+AdamW) of a flavor per backend")
    step.add_argument("--flavor", required=True, help="flavor to build (python -m torchtitan_ext.flavors)")
    step.add_argument("--toml", action="append", default=[], metavar="FILE", help="TOML overrides (repeatable)")
    step.add_argument(
        "--backends", nargs="+", choices=tuple(BACKENDS), help="compute backends (default: every one that runs here)"
    )
    step.add_argument("--batch-size", type=int, help="local batch size (default: the flavor's)")
    step.add_argument("--seq-len", type=int, help="sequence length (default: the flavor's)")
    step.add_argument("--num-layers", type=int, help="keep only the first N layers (full-size flavors on one GPU)")
    step.add_argument(
        "--stock-flavor",
        metavar="FLAVOR",
        help="also time this flavor built with torchtitan's own MoE layers (e.g. olmoe-1b-7b-torchtitan-moe) "
        "at the same sizes, without the --toml files: the baseline of the speed-ups",
    )
    add_compile_options(step, "backend's step")
    add_output_options(step)

    auto = commands.add_parser("auto", help='measure and cache the moe.compute_backend = "auto" choice for a flavor')
    auto.add_argument("--flavor", required=True, help="flavor whose MoE shapes are measured")
    auto.add_argument("--toml", action="append", default=[], metavar="FILE", help="TOML overrides (repeatable)")
    auto.add_argument("--batch-size", type=int, help="local batch size of the run (default: the flavor's)")
    auto.add_argument("--seq-len", type=int, help="sequence length of the run (default: the flavor's)")
    auto.add_argument(
        "--expert-parallel-degree",
        type=int,
        metavar="N",
        help="the run's expert parallel degree (default: the flavor's); above 1 the expert block "
        "is measured, at 1 the whole single-device MoE layer",
    )
    auto.add_argument("--remeasure", action="store_true", help="measure again even if the cache has a choice")
    auto.add_argument("--json", metavar="PATH", help="write the choice as JSON")

    plot_command = commands.add_parser("plot", help="PNG bar chart of a result JSON file")
    plot_command.add_argument("--from", dest="source", required=True, metavar="FILE.json", help="result JSON")
    plot_command.add_argument("--out", required=True, metavar="FILE.png", help="PNG to write")
    plot_command.add_argument("--only", nargs="+", metavar="NAME", help="plot only these series (backends)")
    trace_command = commands.add_parser(
        "trace",
        help="where a profiled step's time went (GPU busy, its idle spans and the host then, kernels by kind, "
        "host syncs), from torch.profiler traces",
    )
    trace_command.add_argument(
        "traces",
        nargs="+",
        metavar="TRACE.json[.gz]",
        help="Chrome traces, e.g. torchtitan's profiling/traces/iteration_N/rank0_trace.json.gz",
    )
    trace_command.add_argument(
        "--top", type=int, default=15, metavar="N", help="list the N slowest kernels (default 15)"
    )
    trace_command.add_argument("--json", metavar="PATH", help="write the summaries as JSON")
    memory_command = commands.add_parser(
        "memory",
        help="where a run's reserved GPU memory came from (growth by code site and training step, "
        "fragmentation, what held the memory), from CUDA allocator snapshots",
    )
    memory_command.add_argument(
        "snapshots",
        nargs="+",
        metavar="SNAPSHOT.pickle",
        help="allocator snapshots, e.g. torchtitan's profiling/memory_snapshot/step_<N>/<rank>_step_<N>.pickle "
        "(--profiler.enable_memory_snapshot), or folders holding them (every rank's of a step)",
    )
    memory_command.add_argument(
        "--top", type=int, default=10, metavar="N", help="list the N largest sites and growths (default 10)"
    )
    memory_command.add_argument("--json", metavar="PATH", help="write the summaries as JSON")
    for subparser, handler in (
        (expert, run_expert),
        (layer, run_layer),
        (ep, run_ep),
        (step, run_train_step),
        (auto, run_auto),
        (plot_command, run_plot),
        (trace_command, run_trace),
        (memory_command, run_memory),
    ):
        subparser.set_defaults(handler=handler, subparser=subparser)
    return parser


def flavor_shapes(flavor: str, tomls: list[str], tokens: int | None) -> list[BenchShape]:
    """The distinct MoE shapes of a flavor, at ``tokens`` (default: local batch x seq_len)."""
    _, resolve_config = _trainer_stack()
    config = resolve_config(flavor, tomls)
    tokens = tokens or config.training.local_batch_size * config.training.seq_len
    layer_shapes = auto_backend.moe_layer_shapes(config.model_spec.model, tokens)
    if not layer_shapes:
        raise ConfigError(f"flavor {flavor!r} has no MoE layers")
    return [
        dataclasses.replace(shape, name=flavor if len(layer_shapes) == 1 else f"{flavor}-{shape.name}")
        for shape in layer_shapes
    ]


def selected_shapes(parser, args, device: torch.device) -> list[BenchShape]:
    explicit = [args.dim, args.hidden, args.experts, args.top_k]
    sources = [bool(args.flavor), any(v is not None for v in explicit), bool(args.shapes), args.tiny]
    if sum(sources) > 1:
        parser.error("choose one shape source: --flavor, --dim/--hidden/--experts/--top-k, --shapes or --tiny")
    if args.toml and not args.flavor:
        parser.error("--toml applies to --flavor only")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.flavor:
        return flavor_shapes(args.flavor, args.toml, args.tokens)
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            parser.error("explicit shapes need all of --dim --hidden --experts --top-k")
        if min(explicit) < 1 or args.top_k > args.experts:
            parser.error("--dim --hidden --experts --top-k must be >= 1 and --top-k <= --experts")
        dim, hidden, experts, top_k = explicit
        tokens = args.tokens or 8192
        return [BenchShape(f"D{dim}-F{hidden}-E{experts}-K{top_k}-T{tokens}", tokens, dim, hidden, experts, top_k)]
    if args.shapes:
        names = args.shapes
    elif args.tiny or device.type == "cpu":
        if not args.tiny:
            progress("no CUDA: measuring the tiny shape (choose others with --flavor/--dim/--shapes)")
        names = []
    else:
        names = list(SHAPES)
    shapes = [SHAPES[name] for name in names] or [TINY_SHAPE]
    if args.tokens:
        shapes = [dataclasses.replace(shape, tokens=args.tokens) for shape in shapes]
    return shapes


def measurement_dtype(args, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def reject_unrunnable(
    parser,
    flag: str,
    names: list[str] | None,
    backend_of: Mapping[str, str],
    needs: Needs | None = None,
) -> None:
    """Exit 2 naming ``flag``'s values that cannot run here, with the reason of the first
    (``common.unavailable_reasons``: the compute backend ``backend_of[name]`` cannot run, or what
    ``needs[name]`` needs is missing)."""
    reasons = unavailable_reasons(names or (), backend_of, needs)
    if reasons:
        parser.error(f"{flag} {' '.join(reasons)}: {next(iter(reasons.values()))}")


def finish(results: dict, rows: list[dict], table, args) -> None:
    print_table(rows, table)
    write_json(args.json, results)
    if args.plot:
        plot.plot(results, args.plot)
        progress(f"plot written to {args.plot}")


def run_expert(parser, args, device, command) -> None:
    reject_unrunnable(parser, "--impls", args.impls, expert_block.BACKEND_OF_IMPL)
    check_rounds(parser, args.rounds)
    shapes = selected_shapes(parser, args, device)
    results = expert_block.run(
        shapes,
        args.impls or expert_block.default_impls(),
        device,
        measurement_dtype(args, device),
        command,
        out=args.json,
        skews=SKEW_CHOICES[args.skew],
        rounds=args.rounds,
    )
    finish(results, results["rows"], expert_block.TABLE, args)


def run_layer(parser, args, device, command) -> None:
    reject_unrunnable(parser, "--layers", args.layers, moe_layer.BACKEND_OF_KIND, moe_layer.NEEDS_OF_KIND)
    shapes = selected_shapes(parser, args, device)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if bad := [s.name for s in shapes if s.tokens % args.batch]:
        parser.error(f"--batch {args.batch} must divide the tokens of every shape ({', '.join(bad)})")
    if args.profile < 0:
        parser.error(f"--profile must be >= 0 (0: off), got {args.profile}")
    check_rounds(parser, args.rounds)
    reject_unrunnable(
        parser, "--compiled-layers", args.compiled_layers, moe_layer.BACKEND_OF_KIND, moe_layer.NEEDS_OF_KIND
    )
    if args.compiled_layers and args.compile == "eager":
        parser.error("--compiled-layers names compiled variants, which --compile eager leaves out")
    kinds = args.layers or moe_layer.default_kinds()
    measured = moe_layer.variants(
        kinds,
        args.compiled_layers or moe_layer.default_compiled_kinds(kinds),
        compile_modes(args.compile or ("both" if args.compiled_layers else None), device),
    )
    results = moe_layer.run(
        shapes,
        measured,
        device,
        measurement_dtype(args, device),
        args.batch,
        command,
        out=args.json,
        skews=SKEW_CHOICES[args.skew],
        profile_top=args.profile,
        rounds=args.rounds,
        compile_backend=args.compile_backend,
    )
    finish(results, results["rows"], moe_layer.TABLE, args)
    print_kernel_profiles(results["rows"], ("shape", "skew", "layer"), device)


def run_ep(parser, args, device, command) -> None:
    for flag, values in (("--tokens", args.tokens), ("--dims", args.dims)):
        if min(values) < 1:
            parser.error(f"{flag} must be >= 1, got {' '.join(map(str, values))}")
    world = world_size()
    if device.type != "cuda" or world < 2:
        parser.error(
            "ep measures NCCL all-to-all between GPUs: run it under torchrun with >= 2 CUDA GPUs, "
            f"e.g. torchrun --nproc_per_node=4 -m torchtitan_ext.bench ep --json ep.json "
            f"(found {'CUDA' if device.type == 'cuda' else 'no CUDA'}, WORLD_SIZE={world})"
        )
    import torch.distributed as dist

    from torchtitan_ext.bench import ep_dispatch

    report = ep_dispatch.run(args.tokens, args.dims, args.check, args.permute_backends, command, args.check_backends)
    if dist.get_rank() == 0:
        rows = [
            {
                **row,
                **{f"{name}_ms": row["ms"][name] for name in ("dispatch_combine", "raw_a2a", "raw_a2a_unique")},
                **{f"{name}_host_ahead_ms": row["ms_host_ahead"][name] for name in ("dispatch_combine", "raw_a2a")},
            }
            for row in report["bench"]
        ]
        finish(report, rows, EP_TABLE, args)
    dist.destroy_process_group()


def run_train_step(parser, args, device, command) -> None:
    reject_unrunnable(parser, "--backends", args.backends, {name: name for name in BACKENDS})
    for flag in ("batch_size", "seq_len", "num_layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    train_step, _ = _trainer_stack()
    backends = train_step.backends_to_run(args.flavor, args.toml, args.backends, runnable_backends())
    results = train_step.run(
        args.flavor,
        args.toml,
        backends,
        device,
        command,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        num_layers=args.num_layers,
        out=args.json,
        stock_flavor=args.stock_flavor,
        compile_modes=compile_modes(args.compile, device),
        compile_backend=args.compile_backend,
    )
    finish(results, results["rows"], train_step.TABLE, args)


def run_auto(parser, args, device, command) -> None:
    train_step, _ = _trainer_stack()
    if args.expert_parallel_degree is not None and args.expert_parallel_degree < 1:
        parser.error(f"--expert-parallel-degree must be >= 1, got {args.expert_parallel_degree}")
    config = train_step.step_config(
        args.flavor, args.toml, AUTO_BACKEND, batch_size=args.batch_size, seq_len=args.seq_len, num_layers=None
    )
    if args.expert_parallel_degree is not None:
        config.parallelism.expert_parallel_degree = args.expert_parallel_degree
    num_experts = (moe.num_experts for _, moe, _, _ in config.model_spec.model.traverse(MoE.Config))
    from_option = args.expert_parallel_degree is not None
    degree_key = (lambda _: "--expert-parallel-degree") if from_option else named
    if errors := expert_share_errors(config.parallelism.expert_parallel_degree, num_experts, degree_key):
        if not from_option:
            raise ConfigError("\n".join(errors))
        parser.error("; ".join(errors))
    refuse_full_size_on_cpu(
        "auto", {f"flavor {args.flavor}": config.model_spec.model.dim}, device, hint=TINY_FLAVORS_HINT
    )
    choice = auto_backend.resolve_for_config(config, remeasure=args.remeasure)
    rows = [
        {"backend": name, "ms_per_step": ms, "chosen": "*" if name == choice.backend else ""}
        for name, ms in choice.ms_per_step.items()
    ]
    print_table(rows, AUTO_TABLE)
    print(
        f"auto -> {choice.backend} ({'cached' if choice.cached else 'measured'}: {choice.measured} forward+backward "
        f"over the flavor's MoE layers; {auto_backend.cache_file()})"
    )
    write_json(
        args.json,
        {
            "flavor": args.flavor,
            "backend": choice.backend,
            "ms_per_step": choice.ms_per_step,
            "measured": choice.measured,
            "cached": choice.cached,
            "cache_key": choice.cache_key,
            "command": command,
        },
    )


def run_plot(parser, args, device, command) -> None:
    try:
        plot.plot_file(args.source, args.out, args.only)
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"plot --from {args.source}: {e}")
    progress(f"plot written to {args.out}")


def run_trace(parser, args, device, command) -> None:
    if args.top < 1:
        parser.error(f"--top must be >= 1, got {args.top}")
    summaries = []
    for path in args.traces:
        try:
            summaries.append(trace.summarize(path, args.top))
        except (OSError, ValueError, KeyError, EOFError) as e:
            parser.error(f"trace {path}: cannot read a torch.profiler trace: {e}")
    for summary in summaries:
        trace.print_summary(summary)
    write_json(args.json, {"command": command, "traces": summaries})


def run_memory(parser, args, device, command) -> None:
    if args.top < 1:
        parser.error(f"--top must be >= 1, got {args.top}")
    summaries = []
    for path in memory_snapshot.snapshot_files(args.snapshots, parser.error):
        try:
            summaries.append(memory_snapshot.summarize(path, args.top))
        except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as e:
            parser.error(f"memory {path}: cannot read a CUDA memory snapshot: {e}")
    for summary in summaries:
        memory_snapshot.print_summary(summary)
    write_json(args.json, {"command": command, "snapshots": summaries})


OUTPUT_OPTIONS = {"json": "--json", "plot": "--plot", "out": "--out"}
"""The arguments that name a file the subcommand writes, by attribute."""


def check_output_folders(parser: argparse.ArgumentParser, args) -> None:
    """Exit 2 before anything is measured when a file to write lies in a folder that does not exist."""
    for attribute, flag in OUTPUT_OPTIONS.items():
        path = getattr(args, attribute, None)
        if path and not Path(path).expanduser().absolute().parent.is_dir():
            parser.error(f"{flag} {path}: the folder {Path(path).parent} does not exist; create it first")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; 0 on success, 2 on bad input (argparse exits with 2 itself)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    check_output_folders(args.subparser, args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quiet_cpu_warnings()
    apply_torch_version_fixes()
    command = " ".join([PROG, *argv])
    try:
        args.handler(args.subparser, args, device, command)
    except (ConfigError, auto_backend.AutoBackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
