"""MoE backends experiment: routed experts whose compute backend is a config field.

Importing this package registers its flavors and its ``[moe]`` TOML keys.
"""

from . import flavors, toml_keys  # noqa: F401  (registration on import)
