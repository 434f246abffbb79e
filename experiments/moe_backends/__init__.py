"""MoE backends experiment: routed experts whose compute backend is a config field.

Importing this package registers its flavors.
"""

from . import flavors  # noqa: F401  (registers flavors)
