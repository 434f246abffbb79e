"""MoE backends experiment: routed experts whose compute backend is a config field.

``flavors`` registers the flavors and ``toml_keys`` the ``[moe]`` TOML keys; the layer
modules (experts, router, dispatcher, moe) import without torchtitan's Trainer.
"""
