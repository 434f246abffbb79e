"""Where the Triton kernels can run, and the CUDA device properties their launches read.

Kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` (Triton's
interpreter: slow, for tests on tiny shapes).
"""

from __future__ import annotations

import functools
import os

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available_reason() -> str | None:
    """None when the Triton MoE kernels can run here, else a sentence saying why not."""
    if interpreter_enabled():
        return None
    if not torch.cuda.is_available():
        return (
            "the Triton MoE kernels need a CUDA GPU, and CUDA is not available "
            "(set TRITON_INTERPRET=1 to run them on CPU through Triton's interpreter)"
        )
    return None


def check_runnable(*tensors: torch.Tensor) -> None:
    """Raise RuntimeError when the kernels cannot run on these tensors. Tensors on one CUDA device pass
    with no further check: every kernel launch calls this, and reading the environment each time cost
    host time."""
    devices = {t.device for t in tensors}
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        return
    reason = triton_available_reason()
    if reason is not None:
        raise RuntimeError(reason)
    if len(devices) != 1:
        raise RuntimeError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError(
            "the Triton MoE kernels got CPU tensors; move them to a CUDA device "
            "or set TRITON_INTERPRET=1 to use Triton's interpreter"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the Triton MoE kernels run on CUDA tensors, got device {device}")


@functools.cache
def cuda_properties(device_index: int):
    """The properties of a CUDA device, looked up once per process: kernel launches read them on
    every call, and the lookup costs host time next to launches of a few microseconds."""
    return torch.cuda.get_device_properties(device_index)


def device_properties(device: torch.device):
    """The properties of a CUDA device (the current one when it has no index)."""
    return cuda_properties(device.index if device.index is not None else torch.cuda.current_device())


def compute_capability_major(device: torch.device) -> int:
    """The major compute capability of a CUDA device (9 for Hopper), looked up once per device."""
    return device_properties(device).major


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM (four under the interpreter)."""
    if device.type != "cuda":
        return 4
    return device_properties(device).multi_processor_count
