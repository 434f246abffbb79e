"""torchtitan_ext: MoE experiments on torchtitan's Trainer.

Sub-packages, imports flowing one way (docs/concepts.md#layout):

- ``torchtitan_ext.kernels``: Triton kernels, each with a plain-torch reference.
- ``torchtitan_ext.experiments``: one package per experiment (``moe_backends`` is the first).
- the framework modules beside them: flavor registry, the run's config (``config``: TOML files,
  short keys, overrides, start-up checks), train entry, metrics, compatibility fixes;
  ``place_in_launch`` (rank and world size) below every layer; ``bench`` and the CLIs on top.
"""
