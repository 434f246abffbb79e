"""List registered flavors, show one flavor's resolved config, or list TOML keys.

    python -m torchtitan_ext.flavors
    python -m torchtitan_ext.flavors --show tiny-moe-grouped-mm --toml my.toml
    python -m torchtitan_ext.flavors --keys
"""

import argparse
import json
import logging
import sys

import torch
from torchtitan.models.common.moe import MoE
from torchtitan.tools.logging import logger

from torchtitan_ext.overrides import ConfigError, short_keys
from torchtitan_ext.registry import all_flavors
from torchtitan_ext.train import resolve_config


def parameter_counts(model_config) -> tuple[int, int]:
    """(total, active per token) parameters of a model config, built on the meta device.

    Active counts each MoE layer's routed experts as top_k of num_experts.
    """
    with torch.device("meta"):
        model = model_config.build()
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for _, moe, _, _ in model_config.traverse(MoE.Config):
        experts = moe.routed_experts.inner_experts
        per_expert = 3 * experts.dim * experts.hidden_dim
        inactive += per_expert * (experts.num_experts - moe.router.top_k)
    return total, total - inactive


def compute_backends(model_config) -> str:
    """The distinct compute backends of a model's routed experts, comma-separated."""
    backends = {
        getattr(experts, "compute_backend", "grouped_mm (torchtitan)")
        for _, moe, _, _ in model_config.traverse(MoE.Config)
        for experts in [moe.routed_experts.inner_experts]
    }
    return ",".join(sorted(backends)) or "-"


def quiet_torchtitan_logger() -> None:
    """Building configs logs torchtitan warnings meant for training runs; keep listings clean."""
    logger.setLevel(logging.ERROR)


def _human(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


def list_flavors() -> None:
    quiet_torchtitan_logger()
    rows = []
    for flavor in all_flavors():
        model_config = flavor.build().model_spec.model
        total, active = parameter_counts(model_config)
        rows.append((flavor.name, _human(total), _human(active), compute_backends(model_config),
                     flavor.description))
    header = ("flavor", "total", "active", "compute_backend", "description")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])


def show_flavor(name: str, tomls: list[str]) -> None:
    quiet_torchtitan_logger()
    config = resolve_config(name, tomls)
    resolved = config.to_dict()
    resolved.pop("model_spec", None)
    resolved = {"flavor": name, "toml_files": tomls, "model": config.model_spec.model.to_dict(),
                **resolved}
    print(json.dumps(resolved, indent=2, default=repr))


def list_short_keys() -> None:
    all_flavors()  # experiments register their keys on import
    width = max(len(k.key) for k in short_keys())
    for key in short_keys():
        print(f"{key.key.ljust(width)}  {key.help}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.flavors",
        description="List registered flavors (with parameter counts and compute backend), "
        "or print one flavor's resolved config after TOML overrides.",
    )
    parser.add_argument("--show", metavar="NAME", help="print the resolved config of flavor NAME")
    parser.add_argument("--keys", action="store_true",
                        help="list the short TOML keys (any config field path also works)")
    parser.add_argument("--toml", action="append", default=[], metavar="FILE",
                        help="TOML overrides applied before --show (repeatable, later wins)")
    args = parser.parse_args(argv)
    try:
        if args.keys:
            list_short_keys()
        elif args.show:
            show_flavor(args.show, args.toml)
        elif args.toml:
            parser.error("--toml only applies together with --show NAME")
        else:
            list_flavors()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
