"""Every fix this project applies to torch or torchtitan from outside, in one place.

- ``torch_versions``: what torchtitan 0.3.0 needs on the running torch; every device.
- ``cpu``: CPU/gloo adaptations of torchtitan's Trainer; only without CUDA (``cpu_training()``).
- ``quiet_cpu``: log filters for CPU runs.

``tests/test_compat.py`` checks each fix is still needed and still works.
"""

import torch


def cpu_training() -> bool:
    """True when training must run on CPU (no CUDA device visible)."""
    return not torch.cuda.is_available()
