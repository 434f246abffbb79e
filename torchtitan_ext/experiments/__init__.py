"""Experiments: one sub-package per experiment; each registers its flavors on import."""
