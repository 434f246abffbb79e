"""Router options, aux / z losses and capacity: hand-checked cases and gradients vs autograd."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bf16_rounds_like
from torchtitan.models.common.config_utils import (
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import TokenChoiceTopKRouter

from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.apply import apply_overrides
from torchtitan_ext.experiments.moe_backends.layer import stock_moe_config, use_backend_experts, use_routing
from torchtitan_ext.experiments.moe_backends.moe import load_balancing_loss, router_z_loss
from torchtitan_ext.experiments.moe_backends.router import (
    BalancedTopKRouter,
    RouterGate,
    bf16_gate_logits,
    bf16_parts,
    capacity_keep_mask,
)
from torchtitan_ext.experiments.moe_backends.startup_checks import check_moe_config
from torchtitan_ext.kernels.moe_permute import slot_counts
from torchtitan_ext.registry import get_flavor

DIM = 8


def router_pair(**options):
    """torchtitan's router and ours, same config and weights."""
    config = make_router_config(dim=DIM, num_experts=8, gate_param_init={}, **options)
    titan = TokenChoiceTopKRouter(config)
    ours = BalancedTopKRouter(
        BalancedTopKRouter.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
    )
    torch.nn.init.normal_(titan.gate.weight, generator=torch.Generator().manual_seed(0))
    ours.gate.weight.data.copy_(titan.gate.weight)
    return titan, ours


@pytest.mark.parametrize(
    "options",
    [
        dict(top_k=2, score_func="softmax", route_norm=True),
        dict(top_k=3, score_func="sigmoid", route_norm=False, route_scale=2.5),
        dict(top_k=4, score_func="sigmoid", route_norm=True, num_expert_groups=4, num_limited_groups=2),
        dict(top_k=1, score_func="softmax"),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_default_recipe_equals_torchtitan_router(options, with_bias):
    titan, ours = router_pair(**options)
    x_BLD = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(1))
    bias_E = torch.linspace(-0.3, 0.3, 8) if with_bias else None
    for expected, actual in zip(titan(x_BLD, bias_E), ours(x_BLD, bias_E)):
        assert torch.equal(expected, actual)


def test_bf16_parts_add_up_to_the_fp32_values():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=generator) * torch.exp2(torch.randint(-60, 60, (4096,), generator=generator))
    parts = bf16_parts(values)
    assert all(part.dtype == torch.bfloat16 and part.shape == (4096,) for part in parts)
    total = parts[0].double() + parts[1].double() + parts[2].double()
    assert ((total - values.double()).abs() <= 2**-24 * values.double().abs()).all()
    assert ((parts[0].double() - values.double()).abs() > 2**-24 * values.double().abs()).any()


def test_bf16_gate_logits_match_the_fp32_gate_and_its_gradients():
    """torchtitan's gate under fp32 autocast: fp32 copies of x and the weight, an fp32 GEMM."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 96, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(16, 96, generator=generator) * 0.1).bfloat16().requires_grad_()
    x_fp32, weight_fp32 = (t.detach().float().requires_grad_() for t in (x, weight))
    grad_logits = torch.randn(3, 64, 16, generator=generator) * torch.logspace(-6, 0, 16)

    logits = bf16_gate_logits(x, weight)
    expected = x_fp32 @ weight_fp32.T
    assert logits.dtype == torch.float32 and logits.shape == (3, 64, 16)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    logits.backward(grad_logits)
    expected.backward(grad_logits)
    assert_bf16_rounds_like(x.grad, x_fp32.grad)
    assert_bf16_rounds_like(weight.grad, weight_fp32.grad)


def test_routed_layers_get_the_router_gate_with_torchtitans_parameters():
    shape = dict(dim=16, hidden_dim=8, num_experts=4, top_k=2)
    ours = use_routing(use_backend_experts(stock_moe_config(**shape), "grouped_mm")).build()
    stock = stock_moe_config(**shape).build()
    assert type(ours.router.gate) is RouterGate
    assert ours.state_dict().keys() == stock.state_dict().keys()


def hand_router(logits_E: list[float], **options) -> BalancedTopKRouter:
    """A router whose gate maps the one-hot token e_0 to ``logits_E``."""
    num_experts = len(logits_E)
    router = BalancedTopKRouter(
        BalancedTopKRouter.Config(
            num_experts=num_experts,
            gate=make_router_config(dim=1, num_experts=num_experts, gate_param_init={}).gate,
            **options,
        )
    )
    router.gate.weight.data = torch.tensor(logits_E).view(num_experts, 1)
    return router


ONE_TOKEN = torch.ones(1, 1, 1)


def test_softmax_sigmoid_top_k_route_norm_route_scale_by_hand():
    logits = [2.0, 0.0, 1.0, -1.0]
    routed = hand_router(logits, top_k=2, score_func="softmax").route(ONE_TOKEN)
    probs = F.softmax(torch.tensor(logits), dim=0)
    assert sorted(routed.topk_expert_ids_BLK.flatten().tolist()) == [0, 2]
    torch.testing.assert_close(routed.scores_BLE.flatten(), probs)
    torch.testing.assert_close(routed.logits_BLE.flatten(), torch.tensor(logits))

    routed = hand_router(logits, top_k=2, score_func="sigmoid").route(ONE_TOKEN)
    torch.testing.assert_close(routed.scores_BLE.flatten(), torch.sigmoid(torch.tensor(logits)))
    scores = sorted(routed.topk_scores_BLK.flatten().tolist())
    assert scores == pytest.approx(sorted(torch.sigmoid(torch.tensor([2.0, 1.0])).tolist()))

    normed = hand_router(logits, top_k=2, score_func="sigmoid", route_norm=True, route_scale=3.0)
    assert float(normed.route(ONE_TOKEN).topk_scores_BLK.sum()) == pytest.approx(3.0)


def test_group_limited_routing_by_hand():
    # Expert 3 alone scores best, but group (0, 1) has the larger top-2 sum: 1.0 + 0.9 > 1.2 + 0.
    logits = [1.0, 0.9, 0.0, 1.2]
    plain = hand_router(logits, top_k=1, score_func="sigmoid").route(ONE_TOKEN)
    assert plain.topk_expert_ids_BLK.item() == 3
    limited = hand_router(logits, top_k=1, score_func="sigmoid", num_expert_groups=2, num_limited_groups=1)
    assert limited.route(ONE_TOKEN).topk_expert_ids_BLK.item() == 0


def test_expert_bias_changes_choice_not_weight():
    router = hand_router([1.0, 0.0], top_k=1, score_func="sigmoid")
    routed = router.route(ONE_TOKEN, torch.tensor([0.0, 1.0]))
    assert routed.topk_expert_ids_BLK.item() == 1
    assert routed.topk_scores_BLK.item() == pytest.approx(torch.sigmoid(torch.tensor(0.0)).item())


def test_capacity_keeps_first_tokens_and_counts_drops():
    ids = torch.tensor([0, 1, 0, 0, 1, 2])
    keep = capacity_keep_mask(ids, slot_counts(ids, num_experts=3), capacity=2)
    assert keep.tolist() == [True, True, True, False, True, True]

    router = hand_router([1.0, 0.0, -1.0, -2.0], top_k=1, score_func="softmax", capacity_factor=1.0)
    routed = router.route(torch.ones(1, 8, 1))  # 8 tokens all prefer expert 0; capacity 2
    assert router.capacity(8) == 2
    assert routed.topk_expert_ids_BLK.flatten().tolist() == [0, 0] + [4] * 6
    assert (routed.topk_scores_BLK.flatten()[2:] == 0).all()
    assert routed.routed_expert_ids_BLK.flatten().tolist() == [0] * 8
    assert routed.num_dropped_slots.item() == 6


def test_load_balancing_loss_by_hand():
    # Balanced: 4 tokens, top-1, 2 experts, uniform probabilities -> 1.
    probs = torch.full((1, 4, 2), 0.5)
    routing_map = torch.tensor([[[1, 0], [0, 1], [1, 0], [0, 1]]], dtype=torch.bool)
    for loss_type in ("seq", "batch", "global"):
        assert load_balancing_loss(probs, routing_map, 1, loss_type).item() == pytest.approx(1.0)
    # Collapsed: every token to expert 0 with probability 1 -> E.
    probs = torch.tensor([1.0, 0.0]).expand(1, 4, 2)
    collapsed = torch.tensor([1, 0], dtype=torch.bool).expand(1, 4, 2)
    assert load_balancing_loss(probs, collapsed, 1, "batch").item() == pytest.approx(2.0)
    # Sequence 0 all to expert 0, sequence 1 all to expert 1: balanced over the batch,
    # collapsed within each sequence.
    probs = torch.stack([torch.tensor([1.0, 0.0]).expand(4, 2), torch.tensor([0.0, 1.0]).expand(4, 2)])
    routing_map = probs.bool()
    assert load_balancing_loss(probs, routing_map, 1, "batch").item() == pytest.approx(1.0)
    assert load_balancing_loss(probs, routing_map, 1, "seq").item() == pytest.approx(2.0)


def test_z_loss_by_hand():
    assert router_z_loss(torch.zeros(2, 3, 4)).item() == pytest.approx(math.log(4) ** 2)


def build_layer(**moe_options):
    config = make_moe_config(
        num_experts=4,
        router=make_router_config(
            dim=DIM, num_experts=4, gate_param_init={}, top_k=2, score_func=moe_options.pop("score_func", "softmax")
        ),
        routed_experts=make_routed_experts_config(
            dim=DIM, hidden_dim=12, num_experts=4, top_k=2, param_init={}, comm_backend="standard"
        ),
        load_balance_coeff=None,
    )
    config = use_routing(use_backend_experts(config, "for_loop"))
    for name, value in moe_options.items():
        setattr(config.router if name == "capacity_factor" else config, name, value)
    layer = config.build()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(layer.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator))
    return layer


def reference_router_losses(gate_weight_ED, x_BLD, score_func, aux_loss_type, top_k=2):
    """The aux and z losses computed from scratch, differentiable by autograd."""
    logits_BLE = x_BLD @ gate_weight_ED.T
    scores = logits_BLE.softmax(-1) if score_func == "softmax" else logits_BLE.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    chosen = F.one_hot(scores.topk(top_k, dim=-1).indices, scores.shape[-1]).sum(-2).float()
    num_experts = scores.shape[-1]
    if aux_loss_type == "seq":
        f_BE = chosen.mean(1) * num_experts / top_k
        aux = (f_BE * probs.mean(1)).sum(-1).mean()
    else:
        aux = (chosen.mean((0, 1)) * num_experts / top_k * probs.mean((0, 1))).sum()
    z = torch.logsumexp(logits_BLE, -1).square().mean()
    return aux, z


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("aux_loss_type", ["seq", "batch", "global"])
def test_aux_and_z_loss_gradients_match_autograd(score_func, aux_loss_type):
    aux_coeff, z_coeff = 0.3, 0.05
    x_BLD = torch.randn(3, 5, DIM, generator=torch.Generator().manual_seed(2))
    grad_BLD = torch.randn(x_BLD.shape, generator=torch.Generator().manual_seed(3))

    layer = build_layer(
        score_func=score_func, aux_loss_coeff=aux_coeff, z_loss_coeff=z_coeff, aux_loss_type=aux_loss_type
    )
    x = x_BLD.clone().requires_grad_()
    out = layer(x)
    out.backward(grad_BLD)

    reference = build_layer(score_func=score_func)
    x_ref = x_BLD.clone().requires_grad_()
    out_ref = reference(x_ref)
    aux, z = reference_router_losses(reference.router.gate.weight, x_ref, score_func, aux_loss_type)
    ((out_ref * grad_BLD).sum() + aux_coeff * aux + z_coeff * z).backward()

    torch.testing.assert_close(out, out_ref)  # forward untouched
    statistics = layer.last_router_statistics
    torch.testing.assert_close(statistics.aux_loss, aux.detach())
    torch.testing.assert_close(statistics.z_loss, z.detach())
    # The two sides sum the same fp32 gradient terms in different orders: a few ulps apart.
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, param), (_, ref_param) in zip(layer.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_losses_off_leave_gradients_and_statistics_as_torchtitan():
    layer = build_layer()
    layer(torch.randn(2, 3, DIM)).sum().backward()
    statistics = layer.last_router_statistics
    assert statistics.aux_loss is None and statistics.z_loss is None
    assert statistics.num_dropped_slots.item() == 0
    assert statistics.num_padding_rows.item() == 0
    assert statistics.tokens_per_expert_E.sum().item() == 2 * 3 * 2


def test_dropped_tokens_pass_through_as_zeros():
    x_BLD = torch.randn(1, 16, DIM, generator=torch.Generator().manual_seed(4))
    unlimited = build_layer()
    limited = build_layer(capacity_factor=0.5)  # 4 slots per expert of 32 routed slots
    out_all, out_limited = unlimited(x_BLD), limited(x_BLD)
    statistics = limited.last_router_statistics
    dropped = statistics.num_dropped_slots.item()
    assert dropped == (statistics.tokens_per_expert_E - 4).clamp(min=0).sum().item() > 0
    routed = limited.router.route(x_BLD)
    kept_scores = routed.topk_scores_BLK.squeeze(0)
    # Tokens with both slots dropped get exactly zero; the others only their kept slots.
    both_dropped = (kept_scores == 0).all(-1)
    assert both_dropped.any()
    assert (out_limited[0, both_dropped] == 0).all()
    assert not torch.allclose(out_all, out_limited)


def tiny_config():
    return get_flavor("tiny-moe-for-loop").build()


def test_toml_keys_set_every_layer():
    config = apply_overrides(
        tiny_config(),
        {
            "moe.score_func": "sigmoid",
            "moe.top_k": 3,
            "moe.route_norm": False,
            "moe.route_scale": 2.0,
            "moe.num_expert_groups": 4,
            "moe.num_limited_groups": 2,
            "moe.load_balance_coeff": 0,
            "moe.aux_loss_coeff": 0.01,
            "moe.aux_loss_type": "seq",
            "moe.z_loss_coeff": 1e-3,
            "moe.capacity_factor": 1.25,
            "moe.permute_backend": "torch",
            "moe.align_size": 8,
        },
    )
    for layer in config.model_spec.model.layers:
        moe = layer.moe
        assert (moe.router.score_func, moe.router.top_k, moe.routed_experts.token_dispatcher.top_k) == ("sigmoid", 3, 3)
        assert (moe.router.route_norm, moe.router.route_scale) == (False, 2.0)
        assert (moe.router.num_expert_groups, moe.router.num_limited_groups) == (4, 2)
        assert moe.load_balance_coeff is None and moe.router.capacity_factor == 1.25
        assert (moe.aux_loss_coeff, moe.aux_loss_type, moe.z_loss_coeff) == (0.01, "seq", 1e-3)
        assert moe.routed_experts.token_dispatcher.align_size == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"moe.aux_loss_type": "sequence"}, "valid choices: 'seq', 'batch', 'global'"),
        ({"moe.aux_loss_coeff": -1.0}, "moe.aux_loss_coeff = -1.0: must be a finite number >= 0"),
        ({"moe.z_loss_coeff": "high"}, "expected float"),
        ({"moe.top_k": 9}, "moe.top_k = 9: must be in [1, 8]"),
        ({"moe.capacity_factor": -0.5}, "moe.capacity_factor = -0.5: must be > 0"),
        ({"moe.route_scale": 0.0}, "moe.route_scale = 0.0: must be > 0"),
        ({"moe.load_balance_coeff": -1.0}, "moe.load_balance_coeff = -1.0: must be > 0"),
        (
            {"moe.num_expert_groups": 3, "moe.num_limited_groups": 1},
            "moe.num_expert_groups = 3: must divide the number of experts (8)",
        ),
        ({"moe.num_expert_groups": 4}, "moe.num_expert_groups = 4: needs num_limited_groups too"),
        ({"moe.align_size": 0}, "moe.align_size = 0: must be an integer >= 1"),
        ({"moe.score_func": "relu"}, "'softmax', 'sigmoid'"),
        ({"moe.permute_backend": "cuda"}, "'torch', 'triton'"),
    ],
)
def test_bad_toml_values_name_the_key(overrides, message):
    """Types are refused when the keys are applied; ranges by the start-up check of the final config."""
    with pytest.raises(ConfigError, match=None) as error:
        check_moe_config(apply_overrides(tiny_config(), overrides))
    assert message in str(error.value)


def test_short_keys_convert_and_the_configs_check_once_reporting_every_problem():
    config = apply_overrides(
        tiny_config(),
        {
            "moe.route_scale": -1.0,
            "moe.capacity_factor": 0,
            "moe.aux_loss_coeff": -2.0,
            "moe.align_size": 0,
        },
    )
    assert config.model_spec.model.layers[0].moe.router.capacity_factor is None  # 0 = off
    with pytest.raises(ConfigError) as error:
        check_moe_config(config)
    assert str(error.value).splitlines() == [  # named by key and where the value came from
        "TOML: moe.aux_loss_coeff = -2.0: must be a finite number >= 0 (0 = off)",
        "TOML: moe.route_scale = -1.0: must be > 0",
        "TOML: moe.align_size = 0: must be an integer >= 1 (1 = off)",
    ]


def test_a_config_built_in_python_reports_every_bad_option():
    with pytest.raises(ValueError) as error:
        BalancedTopKRouter.Config(
            num_experts=8,
            gate=make_router_config(dim=1, num_experts=8, gate_param_init={}).gate,
            top_k=9,
            route_scale=0.0,
            capacity_factor=-1.0,
        )
    assert str(error.value) == (
        "top_k = 9: must be in [1, 8] (the number of experts); route_scale = 0.0: must be > 0; "
        "capacity_factor = -1.0: must be > 0, or off (None; 0 in TOML)"
    )
