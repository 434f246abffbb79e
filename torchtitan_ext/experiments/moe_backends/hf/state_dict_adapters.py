"""State-dict adapters between Hugging Face checkpoints and this experiment's models.

torchtitan's ``CheckpointManager`` builds the model spec's ``state_dict_adapter`` with the
model config and ``hf_assets_path``. To load (``checkpoint.initial_load_in_hf``) it calls
``to_hf`` on the model's own state dict (sharded DTensors under FSDP / EP) to learn which
Hugging Face tensors, and which slices of them, this rank reads; DCP's
``HuggingFaceStorageReader`` reads exactly those; ``from_hf`` maps them back and the model
loads them. To save (``checkpoint.last_save_in_hf``) it writes ``to_hf`` of the model's state
dict with DCP's ``HuggingFaceStorageWriter``, sharded like ``hf_assets_path``'s
``model.safetensors.index.json`` when there is one.

The adapters are torchtitan's own (Qwen3, DeepSeek-V3), extended:

- ``Qwen3StyleAdapter``: Qwen3-MoE and OLMoE name their tensors alike (OLMoE's ``q_norm`` /
  ``k_norm`` are just wider).
- ``MixtralAdapter``: Mixtral's ``block_sparse_moe`` names (``w1`` / ``w3`` / ``w2`` of each
  expert, ``gate``) over Qwen3's ``mlp`` names.
- ``DeepSeekV3Adapter``: accepts the rotate-half RoPE a ``rope_interleave = false`` config
  builds, besides the interleaved (complex) one torchtitan's adapter checks for.

``with_hf_config`` makes an adapter class that also carries the Hugging Face ``config.json``
its model was built from (``hf_config``), which the start-up checks and the saved
``config.json`` use.
"""

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter


class HFConfigAdapter(BaseStateDictAdapter):
    """Base of the adapters here: torchtitan's adapter interface, and the Hugging Face config
    (``config.json`` contents) the adapter's model was built from."""

    hf_config: ClassVar[Mapping[str, Any]] = MappingProxyType({})


class Qwen3StyleAdapter(HFConfigAdapter, Qwen3StateDictAdapter):
    """torchtitan's Qwen3 adapter (Qwen3-MoE and OLMoE checkpoints)."""


_MIXTRAL_EXPERT_NAMES = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
"""(Qwen3 name, Mixtral name) of each expert projection."""
_TO_MIXTRAL = [
    *(
        (rf"\.mlp\.experts\.(\d+)\.{qwen3}\.", rf".block_sparse_moe.experts.\1.{mixtral}.")
        for qwen3, mixtral in _MIXTRAL_EXPERT_NAMES
    ),
    (r"\.mlp\.gate\.", ".block_sparse_moe.gate."),
]
_FROM_MIXTRAL = [
    *(
        (rf"\.block_sparse_moe\.experts\.(\d+)\.{mixtral}\.", rf".mlp.experts.\1.{qwen3}.")
        for qwen3, mixtral in _MIXTRAL_EXPERT_NAMES
    ),
    (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
]


def _renamed(state_dict: dict[str, Any], renames: list[tuple[str, str]]) -> dict[str, Any]:
    """``state_dict`` with every key rewritten by each ``(pattern, replacement)`` in turn."""

    def rename(key: str) -> str:
        for pattern, replacement in renames:
            key = re.sub(pattern, replacement, key)
        return key

    return {rename(key): value for key, value in state_dict.items()}


class MixtralAdapter(Qwen3StyleAdapter):
    """Mixtral checkpoints: Qwen3's adapter under Mixtral's MoE tensor names."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _renamed(super().to_hf(state_dict), _TO_MIXTRAL)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return super().from_hf(_renamed(hf_state_dict, _FROM_MIXTRAL))


class DeepSeekV3Adapter(HFConfigAdapter, DeepSeekV3StateDictAdapter):
    """torchtitan's DeepSeek-V3 adapter; the RoPE layout follows the config's ``rope_interleave``."""

    def _validate_hf_rope_config(self, expected_rope_cls: type) -> None:
        interleaved = self.hf_config.get("rope_interleave", True) is not False
        super()._validate_hf_rope_config(ComplexRoPE.Config if interleaved else CosSinRoPE.Config)


def with_hf_config(adapter: type[HFConfigAdapter], hf_config: Mapping[str, Any]) -> type[HFConfigAdapter]:
    """``adapter`` carrying ``hf_config`` (a read-only copy) as its ``hf_config``."""
    return type(
        adapter.__name__,
        (adapter,),
        {"hf_config": MappingProxyType(dict(hf_config)), "__module__": adapter.__module__},
    )


def expected_hf_tensors(model_config, adapter: type) -> dict[str, tuple[int, ...]]:
    """``{Hugging Face tensor name: shape}`` of a checkpoint of ``model_config``, in model order.

    The model is built on the meta device (no memory) and its state dict converted with
    ``adapter``'s ``to_hf``, the names torchtitan's ``CheckpointManager`` will ask the
    checkpoint for.
    """
    with torch.device("meta"):
        model = model_config.build()
    hf_state_dict = adapter(model_config, None).to_hf(model.state_dict())
    return {name: tuple(tensor.shape) for name, tensor in hf_state_dict.items()}
