"""MoE routing metrics, in parts that import one way (key reference: docs/metrics.md).

- ``statistics``: pure functions from routed counts to metrics (numpy; no torch.distributed, no torchtitan).
- ``observer``: hooks on every MoE layer that accumulate device-side counters, and their reduction across ranks.
- ``processor``: ``MoEMetricsProcessor``, torchtitan's ``MetricsProcessor`` that logs them (console, loggers, summary).
- ``wandb_setup``: wandb environment (offline without credentials), run folder and sync command.
- ``metadata``: what identifies a run, added to the logged config.
- ``toml_keys``: the ``[moe_metrics]`` and ``[wandb]`` TOML keys.
"""
