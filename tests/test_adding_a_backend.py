"""docs/adding_a_backend.md, followed: a toy backend registered at runtime as one spec passes the
backend equivalence tests of tests/test_experts.py and builds into the experts module."""

import pytest
import test_experts as equivalence
import torch
import torch.nn.functional as F

from torchtitan_ext.experiments.moe_backends.experts import (
    BACKENDS,
    BackendGroupedExperts,
    ComputeBackendSpec,
    host_sync_backends,
    register_backend,
    runnable_backends,
)

TOY = "dense_masked"


def dense_masked_experts(x_RD, w1_EFD, w2_EDF, w3_EFD, num_tokens_per_expert_E):
    """Every expert on every row, each row keeping its own expert's output (no host sync). Rows after
    the experts' (EP's static received rows, unset) are masked to zero before any product, so that
    nothing of theirs reaches another row or a weight gradient."""
    dtype = x_RD.dtype
    num_rows, num_experts = x_RD.shape[0], len(num_tokens_per_expert_E)
    counts_E = num_tokens_per_expert_E.long()
    rows_after_experts = (num_rows - counts_E.sum()).reshape(1)
    expert_R = torch.repeat_interleave(
        torch.arange(num_experts + 1, device=x_RD.device),
        torch.cat([counts_E, rows_after_experts]),
        output_size=num_rows,
    )
    of_an_expert_R1 = (expert_R < num_experts)[:, None]
    x_RD = torch.where(of_an_expert_R1, x_RD, 0)
    h_ERF = F.silu(torch.einsum("rd,efd->erf", x_RD, w1_EFD.to(dtype))) * torch.einsum(
        "rd,efd->erf", x_RD, w3_EFD.to(dtype)
    )
    out_ERD = torch.einsum("erf,edf->erd", h_ERF, w2_EDF.to(dtype))
    out_RD = out_ERD[expert_R.clamp(max=num_experts - 1), torch.arange(num_rows, device=x_RD.device)]
    return torch.where(of_an_expert_R1, out_RD, 0)


@pytest.fixture(autouse=True)
def toy_backend():
    """Step 2 of the doc: one spec in the table (removed again after each test)."""
    register_backend(ComputeBackendSpec(name=TOY, grouped=dense_masked_experts))
    yield
    del BACKENDS[TOY]


def test_the_table_lists_it():
    assert TOY in runnable_backends() and TOY not in host_sync_backends()
    with pytest.raises(ValueError, match="already taken"):
        register_backend(ComputeBackendSpec(name=TOY, grouped=dense_masked_experts))


@pytest.mark.parametrize("case", list(equivalence.COUNT_CASES))
def test_edge_case_token_counts(case):
    equivalence.test_edge_case_token_counts_fp32(TOY, case)


@pytest.mark.parametrize("seed", range(2))
def test_random_shapes_and_counts(seed):
    equivalence.test_random_shapes_and_counts_fp32(TOY, seed)


@pytest.mark.parametrize("counts", [[3, 0, 6, 1], [0, 0, 0]])
def test_rows_after_the_experts(counts):
    equivalence.test_rows_after_the_experts_change_nothing_the_experts_compute(TOY, counts)


def test_odd_dims_and_mixed_precision():
    equivalence.test_odd_dims_fp32(TOY, 7, 5)
    equivalence.test_half_precision(TOY, torch.float16)
    equivalence.test_bf16_inputs_with_fp32_parameters(TOY)


def test_module_builds_with_it():
    experts = BackendGroupedExperts.Config(dim=8, hidden_dim=12, num_experts=3, compute_backend=TOY).build()
    torch.nn.init.normal_(experts.w1_EFD, std=0.1)
    torch.nn.init.normal_(experts.w2_EDF, std=0.1)
    torch.nn.init.normal_(experts.w3_EFD, std=0.1)
    out_RD = experts(torch.randn(6, 8), torch.tensor([2, 0, 4]))
    assert out_RD.shape == (6, 8) and TOY in repr(experts)
