"""What identifies a training run: recorded at start-up, added to the wandb config as ``run_metadata``."""

from typing import Any

from torchtitan_ext.config.toml_files import load_toml
from torchtitan_ext.registry import describe_run

_run_metadata: dict[str, Any] = {}


def record_run_metadata(*, flavor: str, toml_files: list[str], cli_args: list[str], config) -> None:
    """Remember what identifies this run; added to the wandb config as ``run_metadata``.

    ``config`` is the resolved ``Trainer.Config``; the TOML files are stored as paths
    and as their ``{dotted_key: value}`` overrides. The experiments describe the config
    (``registry.describe_run``: e.g. ``compute_backend``).
    """
    _run_metadata.clear()
    _run_metadata.update(
        flavor=flavor,
        **describe_run(config),
        expert_parallel_degree=config.parallelism.expert_parallel_degree,
        toml_files=list(toml_files),
        toml_overrides={path: load_toml(path) for path in toml_files},
        cli_args=list(cli_args),
    )


def run_metadata() -> dict[str, Any]:
    return dict(_run_metadata)
