"""Helpers shared by the tests: weight-gradient and bf16 rounding checks, a free TCP port, a
backend made unavailable."""

import dataclasses
import socket

import torch

from torchtitan_ext.bench.common import relative_error
from torchtitan_ext.experiments.moe_backends.experts import BACKENDS


def assert_weight_gradient_matches(
    out_EMN: torch.Tensor, a_RM: torch.Tensor, b_RN: torch.Tensor, counts: list[int], tolerance: float
) -> None:
    """Each expert's out[e] against a[rows of e].T @ b[rows of e] in fp64 (consecutive row
    segments of ``counts``); an expert without rows must be exactly zero."""
    start = 0
    for expert, count in enumerate(counts):
        expected = a_RM[start : start + count].double().T @ b_RN[start : start + count].double()
        if count:
            assert relative_error(out_EMN[expert].double(), expected) < tolerance, f"expert {expert}"
        else:
            assert out_EMN[expert].abs().max() == 0, f"expert {expert} has no rows"
        start += count


def assert_bf16_rounds_like(actual: torch.Tensor, expected_fp32: torch.Tensor) -> None:
    """``actual`` (bf16) is ``expected_fp32`` rounded to bf16, up to sums taken in another order:
    at least 99% of the elements equal the rounded value and none is more than one bf16 step
    off (sums that cancel to near zero may be off by the rounding of tensor-core fp32 sums:
    2^-16 of the largest value)."""
    assert actual.dtype == torch.bfloat16
    rounded = expected_fp32.to(torch.bfloat16)
    assert (actual == rounded).float().mean() >= 0.99
    scale = float(expected_fp32.abs().max())
    torch.testing.assert_close(actual.float(), expected_fp32, rtol=2**-7, atol=2**-16 * scale)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_backend_unavailable(monkeypatch, name: str, reason: str | None) -> None:
    """For this test, backend ``name``'s spec reports ``reason`` (None: it runs here)."""
    spec = dataclasses.replace(BACKENDS[name], unavailable_reason=lambda: reason)
    monkeypatch.setitem(BACKENDS, name, spec)
