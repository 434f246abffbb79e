"""CPU/gloo adaptations: what lets torchtitan 0.3.0's Trainer run without CUDA.

torchtitan assumes CUDA. Each fix below is applied from outside torchtitan, names
the torchtitan code it addresses, and is covered by ``tests/test_compat.py``,
which fails loudly if a torchtitan upgrade moves or changes what a fix relies on.
On a machine with CUDA nothing here is applied (torch-version fixes that every
device needs live in ``compat.torch_versions``).

Two kinds of fixes:
- ``adapt_config_for_cpu(config)``: settings of the ``Trainer.Config``.
- ``patch_torchtitan_for_cpu()``: replacements of torchtitan functions/globals.
"""

import logging
import os
import platform
import resource
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TypeGuard

import torch
import torch.nn.functional as F
import torchtitan.distributed.fsdp as titan_fsdp
import torchtitan.tools.utils as titan_utils
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.config.configs import CommConfig
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.protocols.module import Module
from torchtitan.tools.logging import logger

from torchtitan_ext.compat import cpu_training


class CPUDeviceModule:
    """``torch.cpu`` plus the memory queries torchtitan's metrics ask a device module for.

    Peak memory is the process's peak resident set size (it cannot be reset).
    """

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "active_bytes.all.peak": peak_rss,
            "reserved_bytes.all.peak": peak_rss,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


CPU_DEVICE_MODULE = CPUDeviceModule()


class DocumentCausalSDPA(ScaledDotProductAttention):
    """SDPA with a dense causal, same-document mask: the CPU stand-in for FlexAttention.

    FlexAttention has no CPU backward. ``attention_masks`` is a boolean
    ``(B, 1, L, L)`` tensor (True = attend) built by ``document_causal_mask``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        out_BNLH = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            attn_mask=attention_masks,
            is_causal=attention_masks is None,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out_BNLH.transpose(1, 2)


def document_causal_mask(positions_BL: torch.Tensor) -> torch.Tensor:
    """``(B, 1, L, L)`` mask: query i sees key j iff j <= i and both are in one document.

    A document starts wherever ``positions`` is 0 (torchtitan's packing convention).
    """
    doc_BL = torch.cumsum((positions_BL == 0).int(), dim=1)
    seq_len = positions_BL.shape[1]
    causal_LL = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions_BL.device).tril()
    same_doc_BLL = doc_BL.unsqueeze(2) == doc_BL.unsqueeze(1)
    return (same_doc_BLL & causal_LL).unsqueeze(1)


def adapt_config_for_cpu(config) -> None:
    """Adjust a ``Trainer.Config`` (in place) for CPU training.

    - ``models/common/attention.py`` FlexAttention: no CPU backward, so every
      ``FlexAttention.Config`` becomes ``DocumentCausalSDPA.Config`` (same masking).
    - ``trainer.py`` ``Trainer.Config._validate_cuda_graphs``: CUDA graphs are
      meaningless on CPU, so ``training.disable_cuda_graphs``.
    - ``config/configs.py`` ``CommConfig.train_timeout_seconds`` (gloo timeout after the
      first step): torchtitan's 100 s let a frozen rank hold a CPU job for 132 s; left at
      torchtitan's default it becomes 30 s on CPU, any other value is kept.
    - ``distributed/utils.py`` ``init_distributed``: a ``CommConfig.trace_buf_size`` above 0 sets up
      NCCL's flight recorder and creates its empty ``comm_traces`` folder in the dump folder; gloo
      has no flight recorder, so torchtitan's default becomes 0 on CPU (any other value is kept).
    """
    if config.model_spec is not None:
        for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
            replacement = DocumentCausalSDPA.Config()
            if isinstance(parent, list):
                parent[attr] = replacement
            else:
                setattr(parent, attr, replacement)
    config.training.disable_cuda_graphs = True
    defaults = CommConfig()
    if config.comm.train_timeout_seconds == defaults.train_timeout_seconds:
        config.comm.train_timeout_seconds = 30
    if config.comm.trace_buf_size == defaults.trace_buf_size:
        config.comm.trace_buf_size = 0


def _cpu_attention_masks(self, positions):
    """``Decoder.get_attention_masks`` for ``DocumentCausalSDPA``; torchtitan's otherwise."""
    attn_config = self.config.first_attention
    if attn_config is not None and isinstance(attn_config.inner_attention, DocumentCausalSDPA.Config):
        return document_causal_mask(positions)
    return _original_get_attention_masks(self, positions)


_original_get_attention_masks = Decoder.get_attention_masks
_original_disable_division = titan_fsdp.disable_fsdp_gradient_division


def _disable_division_with_sum_reductions(model: torch.nn.Module) -> None:
    """torchtitan's gradient-division switch, plus SUM-only reductions gloo accepts."""
    _original_disable_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


_original_init_param = Module._init_param


def _split_over_cpu_mesh(param: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``param`` is a DTensor on a CPU mesh of several ranks whose local tensor is a piece of
    the full one (a placement other than ``Replicate``: FSDP's ``Shard``, EP's ``_StridedShard``)."""
    return (
        isinstance(param, DTensor)
        and param.device_mesh.device_type == "cpu"
        and param.device_mesh.size() > 1
        and not all(placement.is_replicate() for placement in param.placements)
    )


def _init_param_unsharded(self: Module, name: str, param: torch.nn.Parameter) -> None:
    """``Module._init_param`` that gives a parameter split over a CPU mesh the values a single
    process gives it: the init function fills a full-size plain tensor (the same random draws, in
    the same order, on every rank and in a single-process run) and this rank keeps its piece.

    ``skip_param_init`` (a tied weight, initialised through the module that owns it) leaves the
    parameter as it is; parameters on one process or a CUDA mesh take torchtitan's path.
    """
    init = (self._param_init or {}).get(name)
    if init is None or init is skip_param_init or not _split_over_cpu_mesh(param):
        _original_init_param(self, name, param)  # raises for a missing init, as torchtitan does
        return
    full = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
    _original_init_param(self, name, full)
    piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    with torch.no_grad():
        param.to_local().copy_(piece)


def exit_skipping_finalization(exit_code: int) -> None:
    """End this process with ``exit_code`` once logs and standard streams are flushed, skipping
    interpreter finalization.

    After ``destroy_process_group``, gloo's C++ worker threads can still own work objects; if
    they are freed during interpreter finalization the process aborts ("terminate called
    without an active exception", SIGABRT; seen in about 1 of 10 two-process runs with torch
    2.13), although everything it had to do is done.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def exit_after_cpu_training(exit_code: int) -> None:
    """End a training process with ``exit_code``: on CPU (gloo) through
    ``exit_skipping_finalization``, with CUDA through a normal ``sys.exit``."""
    if not cpu_training():
        sys.exit(exit_code)
    exit_skipping_finalization(exit_code)


def patch_torchtitan_for_cpu() -> None:
    """Patch torchtitan (once) so its Trainer runs on CPU with gloo.

    - ``tools/utils.py`` ``device_type``/``device_module``: computed at import as
      ``_get_available_device_type() or "cuda"``, so CPU-only machines get "cuda".
      Set to "cpu" and ``CPU_DEVICE_MODULE`` (``torch.cpu`` plus the memory queries
      of ``components/metrics.py`` ``DeviceMemoryMonitor``) there and in every
      torchtitan module that copied them.
    - ``distributed/fsdp.py`` ``disable_fsdp_gradient_division``: leaves FSDP using
      ``ReduceOp.PREMUL_SUM``/``AVG``, which gloo rejects; also force SUM reductions
      (the divide factor is 1, so results are unchanged).
    - ``models/common/decoder.py`` ``Decoder.get_attention_masks``: only knows Flex
      and varlen masks; build the dense mask ``DocumentCausalSDPA`` expects.
    - ``protocols/module.py`` ``Module._init_param`` (called by ``Module.init_states`` for every
      parameter, after the Trainer's ``fully_shard`` and ``to_empty``): the init function runs on
      the parameter's DTensor, whose random ops use torch's distributed RNG tracker on CUDA-like
      meshes only (``distributed/tensor/_random.py`` ``is_rng_supported_mesh``). On a CPU mesh
      every rank fills its shard with the same draws, so the weights repeat every shard (pairs of
      experts with equal router scores). ``_init_param_unsharded`` inits the full tensor and keeps
      this rank's piece: the weights a single-process run gives, whatever the FSDP/EP sharding.
    """
    if Decoder.get_attention_masks is _cpu_attention_masks:
        return  # patched already
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            # pyrefly: ignore[missing-attribute]  # a global of a torchtitan module found at run time
            module.device_type = "cpu"
            if hasattr(module, "device_module"):
                # pyrefly: ignore[missing-attribute]  # a global of a torchtitan module found at run time
                module.device_module = CPU_DEVICE_MODULE
    # pyrefly: ignore[bad-assignment]  # torchtitan types it ModuleType; the CPU stand-in has what it reads
    titan_utils.device_type, titan_utils.device_module = "cpu", CPU_DEVICE_MODULE
    titan_fsdp.disable_fsdp_gradient_division = _disable_division_with_sum_reductions
    Decoder.get_attention_masks = _cpu_attention_masks
    Module._init_param = _init_param_unsharded
    logger.info("No CUDA device: torchtitan patched for CPU training with gloo")
