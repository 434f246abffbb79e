"""Every fix this project applies to torch or torchtitan from outside, in one place.

- ``torch_versions``: what torchtitan 0.3.0 needs on the running torch; every device.
- ``cpu``: CPU/gloo adaptations of torchtitan's Trainer; only without CUDA.

``tests/test_compat.py`` checks each fix is still needed and still works.
"""
