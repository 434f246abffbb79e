"""Short TOML keys of the MoE metrics (``[moe_metrics]`` and ``[wandb]`` tables).

They set fields of ``MoEMetricsProcessor.Config`` and fail with a ``ConfigError``
for a flavor whose ``metrics`` is another processor's config. A heatmap period set where no heatmap
is drawn is warned of at start-up.
"""

from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.checks import register_config_check
from torchtitan_ext.config.short_keys import register_short_key
from torchtitan_ext.config.value_sources import value_source
from torchtitan_ext.place_in_launch import is_rank_zero
from torchtitan_ext.validation import named


def _set_metrics_field(key: str, field_name: str):
    def apply(config, value) -> None:
        if not hasattr(config.metrics, field_name):
            raise ConfigError(
                f"{key}: this flavor's metrics ({type(config.metrics).__qualname__}) is not MoEMetricsProcessor.Config"
            )
        setattr(config.metrics, field_name, value)

    return apply


def _heatmap_every(config, value: int) -> None:
    if value < 0:
        raise ConfigError(f"moe_metrics.heatmap_every must be >= 0 (0: never), got {value}")
    _set_metrics_field("moe_metrics.heatmap_every", "heatmap_every")(config, value)


for _key, _field, _annotation, _help in (
    ("moe_metrics.enable", "moe_metrics", bool, "log MoE routing metrics (= metrics.moe_metrics)"),
    ("wandb.project", "wandb_project", str, "wandb project (= metrics.wandb_project)"),
    ("wandb.entity", "wandb_entity", str, "wandb entity/team (= metrics.wandb_entity)"),
    ("wandb.run_name", "wandb_run_name", str, "wandb run name (= metrics.wandb_run_name)"),
):
    register_short_key(_key, _annotation, _help, fields=(f"metrics.{_field}",))(_set_metrics_field(_key, _field))

register_short_key(
    "moe_metrics.heatmap_every",
    int,
    "layers x experts heatmap at the first log step and at the first log step at or after each "
    "multiple of N, 0: never (= metrics.heatmap_every)",
    fields=("metrics.heatmap_every",),
)(_heatmap_every)


@register_config_check
def warn_of_a_heatmap_that_is_never_drawn(config) -> None:
    """Rank 0 warns when a TOML file or the command line set ``moe_metrics.heatmap_every`` (> 0) for a run
    that draws no heatmap: the MoE metrics are off, or neither Weights & Biases nor TensorBoard, which
    take the image, is on. The flavors' defaults are not warned of."""
    metrics = config.metrics
    if not hasattr(metrics, "heatmap_every") or not metrics.heatmap_every or not is_rank_zero():
        return
    if value_source("moe_metrics.heatmap_every", "metrics.heatmap_every") is None:
        return
    setting = f"{named('moe_metrics.heatmap_every', 'metrics.heatmap_every')} = {metrics.heatmap_every} has no effect"
    if not metrics.moe_metrics:
        switch = named("moe_metrics.enable", "metrics.moe_metrics")
        logger.warning(f"{setting}: the MoE metrics are off ({switch} = false)")
    elif not (metrics.enable_wandb or metrics.enable_tensorboard):
        logger.warning(
            f"{setting}: the heatmap is an image for Weights & Biases or TensorBoard, and neither is on "
            "(wandb.enable, tensorboard.enable)"
        )
