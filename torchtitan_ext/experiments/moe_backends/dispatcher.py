"""Token dispatcher: groups the routed rows by expert for the experts and undoes it, locally or
under expert parallelism, over the EP transport the config names.

``RoutingDispatcher`` subclasses torchtitan's ``AllToAllTokenDispatcher`` (the class the MoE layer
builds) and delegates to one transport object of ``transports``: ``LocalTransport`` without an EP
mesh, and once ``wire_meshes`` installs one, the transport ``ep_transport`` names
(``AllToAllTransport`` or ``SymmMemTransport``). Rows move through the row ops of the permute
backend and are grouped as ``grouping`` describes.

Options (``Config``):
- ``permute_backend``: ``"torch"`` (gathers and an fp32 weighted sum), ``"triton"``
  (``torchtitan_ext.kernels.moe_permute``: one row-copy kernel each way, gather-only
  gradients) or ``"auto"`` (the default: ``"triton"`` for CUDA tokens, ``"torch"`` otherwise);
  used for every row copy and sum of every transport.
- ``ep_transport``: how rows move between EP ranks. ``"all_to_all"``: NCCL (or gloo) all-to-alls of
  one row per (token, destination rank) (any process group backend). ``"symm_mem"``: one pull kernel in
  dispatch and one push kernel in combine through memory every rank maps (``ep_symm_mem``:
  CUDA symmetric memory, or shared memory for CPU ranks on one host under ``TRITON_INTERPRET=1``).
  ``"auto"`` (the default): ``"symm_mem"`` where it runs on CUDA GPUs (``chosen_ep_transport``),
  else ``"all_to_all"``; the start-up checks replace it by the choice.
- ``align_size``: pad each local expert's rows with zero rows to a multiple of it (block-aligned
  kernels; ``grouping`` gives the padded buffer's static size). Padding rows are zeros, are never
  read back into the output, and get no gradient.
- ``experts_apply_scores`` (off by default; ``ep_receive_rows = "auto"`` turns it on where it turns
  CUDA graphs on): under expert parallelism the experts multiply their rows
  by the router scores (``row_scores``) and combine sums them unweighted (``sum_rows``), so no expert
  output is kept for the scores' gradient: less memory, for backends with a row-weighted path over
  the transports that give each row its score (``row_scores_unsupported_reason``).
- ``ep_receive_rows``: ``"exact"`` (the received rows counted on the host), ``"static"`` (the most a
  rank can receive, nothing read on the host) or ``"auto"`` (the default): the start-up check
  ``resolve_auto_ep_receive_rows`` replaces it by ``"static"`` where CUDA graphs are on or a compiled
  step over ``symm_mem`` replays as one (``cuda_graph_step.auto_receive_rows``), else by ``"exact"``.
  A dispatcher built without the start-up checks counts ``"auto"`` as ``"exact"``.

After each dispatch, ``last_num_padding_rows`` (a 0-d int64 tensor on the tokens' device) holds
the zero rows the experts computed on top of the real routed rows (``align_size`` padding).

No host sync on the local path; each EP transport has one (split sizes / received row count),
except with ``ep_receive_rows = "static"``.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import spmd_types as spmd
import torch
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from torchtitan_ext.experiments.moe_backends.grouping import RowOps
from torchtitan_ext.experiments.moe_backends.transports import (
    AllToAllTransport,
    LocalTransport,
    PaddedSymmMemTransport,
    StaticAllToAllTransport,
    SymmMemTransport,
    TokenTransport,
)
from torchtitan_ext.kernels.availability import interpreter_enabled, triton_available_reason
from torchtitan_ext.place_in_launch import local_world_size

from .validated_config import ValidatedConfig, choice_errors

PermuteBackend = Literal["auto", "torch", "triton"]
PERMUTE_BACKENDS: tuple[PermuteBackend, ...] = get_args(PermuteBackend)
EPTransport = Literal["all_to_all", "symm_mem"]
EP_TRANSPORTS: tuple[EPTransport, ...] = get_args(EPTransport)
EPTransportChoice = Literal["auto", "all_to_all", "symm_mem"]
EP_TRANSPORT_CHOICES: tuple[EPTransportChoice, ...] = get_args(EPTransportChoice)
EPReceiveRows = Literal["auto", "exact", "static"]
EP_RECEIVE_ROWS: tuple[str, ...] = get_args(EPReceiveRows)


class RoutingDispatcher(AllToAllTokenDispatcher):
    """Token dispatch over the transport its config and EP mesh choose; permute backend choice, aligned groups."""

    @dataclass(kw_only=True, slots=True)
    class Config(ValidatedConfig, AllToAllTokenDispatcher.Config):
        permute_backend: PermuteBackend = "auto"
        """``"auto"``, ``"torch"`` or ``"triton"``: how rows are permuted and combined."""
        align_size: int = 1
        """Pad each expert's rows to a multiple of this (1: no padding)."""
        ep_transport: EPTransportChoice = "auto"
        """``"all_to_all"``, ``"symm_mem"`` or ``"auto"`` (``chosen_ep_transport``): how rows move between EP ranks."""
        experts_apply_scores: bool = False
        """Under expert parallelism, the experts weight their rows by the router scores and combine sums
        them unweighted (no expert output kept for the scores' gradient)."""
        ep_receive_rows: EPReceiveRows = "auto"
        """``"exact"``: the rows an EP rank receives are counted on the host (one sync per dispatch);
        ``"static"`` (``align_size`` 1): the most a rank can receive, every step, with no host sync, so
        that the host runs ahead and a CUDA graph can capture the step (more activation memory;
        ``all_to_all`` then sends every rank ``T`` rows, whether or not each token has a slot there);
        ``"auto"``: one of them, chosen at start-up (see the module docstring)."""

        @property
        def host_sync_free(self) -> bool:
            """Whether dispatch and combine under expert parallelism read nothing on the host (a CUDA
            graph can capture them): static received rows."""
            return self.ep_receive_rows == "static"

        def validation_errors(self, key: Callable[[str], str] = str) -> list[str]:
            """Every invalid option, one message each; ``key(field)`` is how a message names a field."""
            errors = [
                *choice_errors(key, "permute_backend", self.permute_backend, PERMUTE_BACKENDS),
                *choice_errors(key, "ep_transport", self.ep_transport, EP_TRANSPORT_CHOICES),
                *choice_errors(key, "ep_receive_rows", self.ep_receive_rows, EP_RECEIVE_ROWS),
            ]
            if self.ep_receive_rows == "static" and self.align_size != 1:
                errors.append(
                    f"{key('ep_receive_rows')} = 'static' needs align_size = 1 (got {self.align_size}): "
                    "padded groups are sized from the received rows"
                )
            if isinstance(self.align_size, bool) or not isinstance(self.align_size, int) or self.align_size < 1:
                errors.append(f"{key('align_size')} = {self.align_size!r}: must be an integer >= 1 (1 = off)")
            return errors

    def __init__(self, config: Config):
        super().__init__(config)
        self.align_size = config.align_size
        self.ep_transport = config.ep_transport
        self.ep_receive_rows = config.ep_receive_rows
        self.experts_apply_scores = config.experts_apply_scores
        self.row_ops = RowOps(config.permute_backend)
        self.transport: TokenTransport = self.transport_for(None)
        self.last_num_padding_rows: torch.Tensor | None = None

    def transport_for(self, ep_mesh: DeviceMesh | None) -> TokenTransport:
        """The transport of this config: local without ``ep_mesh``, else the one ``ep_transport`` names
        (``"auto"``: the one ``chosen_ep_transport`` picks for the mesh's size)."""
        if ep_mesh is None:
            return LocalTransport(self.row_ops, self.align_size, self.num_experts, self.top_k)
        if chosen_ep_transport(self.ep_transport, ep_mesh.size()) == "all_to_all":
            transport_type = StaticAllToAllTransport if self.ep_receive_rows == "static" else AllToAllTransport
        else:
            if self.align_size != 1:
                return PaddedSymmMemTransport(self.row_ops, self.align_size, self.num_experts, self.top_k, ep_mesh)
            return SymmMemTransport(
                self.row_ops, self.align_size, self.num_experts, self.top_k, ep_mesh, self.ep_receive_rows == "static"
            )
        return transport_type(self.row_ops, self.align_size, self.num_experts, self.top_k, ep_mesh)

    def wire_meshes(self, *, ep_mesh: DeviceMesh | None) -> None:
        """Install the EP mesh (torchtitan's) and the transport that goes with it."""
        super().wire_meshes(ep_mesh=ep_mesh)
        self.transport = self.transport_for(ep_mesh)

    @property
    def single_device(self) -> bool:
        """True without expert parallelism: every expert is local and no rows leave the device."""
        return self.ep_mesh is None

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """The transport's ``dispatch``: ``(rows_RD, rows_per_local_expert_e, metadata)`` for ``(T, D)``
        tokens and ``(T, K)`` scores and expert ids, rows grouped by local expert
        (``TokenTransport.dispatch``); sets ``last_num_padding_rows``.

        ``num_local_tokens_per_expert_E`` counts the kept (not dropped) slots per expert; the
        grouping is built from it, so it must be exact.
        """
        if not self.single_device and get_spmd_backend() == "spmd_types" and spmd.is_type_checking():
            raise NotImplementedError("RoutingDispatcher does not support SPMD type checking")
        rows_RD, rows_per_local_expert_e, metadata = self.transport.dispatch(
            x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
        )
        self.last_num_padding_rows = metadata.num_padding_rows
        return rows_RD, rows_per_local_expert_e, metadata

    def combine(self, routed_output_RD: torch.Tensor, metadata: object, x_TD: torch.Tensor) -> torch.Tensor:
        """Weight each slot's expert output by its score and sum over top_k -> ``(T, D)`` in ``x_TD``'s dtype."""
        return self.transport.combine(routed_output_RD, metadata).to(x_TD.dtype)

    def row_scores_error(self) -> str | None:
        """Why the transport in use cannot give each row its score (None: it can)."""
        if self.transport.supports_row_scores:
            return None
        ep_size = self.ep_mesh.size() if self.ep_mesh is not None else 1
        reason = row_scores_unsupported_reason(chosen_ep_transport(self.ep_transport, ep_size), self.align_size)
        return reason or f"{type(self.transport).__name__} does not give its rows' scores"

    def row_scores(self, metadata: object, num_rows: int) -> torch.Tensor:
        """``(num_rows,)`` fp32, differentiable: each dispatched row's router score (``TokenTransport.row_scores``)."""
        return self.transport.row_scores(metadata, num_rows)

    def sum_rows(self, weighted_output_RD: torch.Tensor, metadata: object, x_TD: torch.Tensor) -> torch.Tensor:
        """The combine of rows the experts weighted by ``row_scores`` -> ``(T, D)`` in ``x_TD``'s dtype."""
        return self.transport.sum_rows(weighted_output_RD, metadata).to(x_TD.dtype)


def row_scores_unsupported_reason(ep_transport: EPTransport, align_size: int) -> str | None:
    """Why the transport cannot give each row its score for ``experts_apply_scores`` (None: it can)."""
    if ep_transport == "symm_mem" and align_size != 1:
        return (
            f"the symm_mem transport pads its expert groups (align_size = {align_size}) after the exchange "
            "and weights the rows in its combine; set align_size = 1 or use ep_transport = 'all_to_all'"
        )
    return None


def symm_mem_errors(expert_parallel_degree: int, key: str = "moe.ep_transport") -> list[str]:
    """Why ``ep_transport = "symm_mem"`` cannot run here (empty list: it can), the option named as ``key``
    (where its value came from, in the start-up checks). torchtitan's EP groups are blocks of
    ``expert_parallel_degree`` consecutive ranks, so each host must run whole groups."""
    if expert_parallel_degree <= 1:
        return []
    errors = []
    if triton_available_reason() is not None:
        errors.append(
            f"{key} = 'symm_mem': its exchange runs Triton kernels on memory the ranks of a host share, which "
            "needs CUDA GPUs (not available here), or CPU processes with TRITON_INTERPRET=1 (Triton's "
            "interpreter: slow, for checking the transport); on CPU use moe.ep_transport = 'all_to_all'"
        )
    local_world = local_world_size()
    if local_world % expert_parallel_degree:
        errors.append(
            f"{key} = 'symm_mem' needs every rank of an EP group on one host, but the processes "
            f"per host ({local_world}) are not a multiple of expert_parallel_degree ({expert_parallel_degree}); "
            "use moe.ep_transport = 'all_to_all' across hosts"
        )
    return errors


def symm_mem_unfit_reason(expert_parallel_degree: int) -> str | None:
    """Why ``"auto"`` does not choose ``"symm_mem"`` here; None where it does: CUDA GPUs (not Triton's
    interpreter) with every EP group on one host, where it moves the rows faster than NCCL's all-to-alls."""
    if expert_parallel_degree <= 1:
        return "no expert parallelism"
    if not torch.cuda.is_available():
        return "no CUDA GPU; on CPU symm_mem runs only through Triton's interpreter (TRITON_INTERPRET=1), slowly"
    if interpreter_enabled():
        return "Triton's interpreter is on"
    return "; ".join(symm_mem_errors(expert_parallel_degree)) or None


def chosen_ep_transport(ep_transport: EPTransportChoice, expert_parallel_degree: int) -> EPTransport:
    """The transport ``ep_transport`` stands for: itself, or for ``"auto"`` ``"symm_mem"`` where
    ``symm_mem_unfit_reason`` finds no reason against it, else ``"all_to_all"``."""
    if ep_transport != "auto":
        return ep_transport
    return "all_to_all" if symm_mem_unfit_reason(expert_parallel_degree) else "symm_mem"
