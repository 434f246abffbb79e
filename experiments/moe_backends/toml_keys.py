"""Short TOML keys of the MoE backends experiment (``[moe]`` table)."""

from torchtitan_ext.overrides import ConfigError, register_short_key

from .experts import BackendGroupedExperts, ComputeBackend


@register_short_key("moe.compute_backend", ComputeBackend, "expert compute backend of every MoE layer")
def set_compute_backend(config, backend: str) -> None:
    experts = list(config.model_spec.model.traverse(BackendGroupedExperts.Config))
    if not experts:
        raise ConfigError("moe.compute_backend: this flavor's model has no backend-switchable experts")
    for _, experts_config, _, _ in experts:
        experts_config.compute_backend = backend
