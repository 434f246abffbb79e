"""Routed experts with a switchable compute backend.

Every backend computes the SwiGLU expert block over rows already grouped by
expert (contiguous segments in expert order, the contract of torchtitan's
``GroupedExperts.forward``)::

    out_RD[r] = (silu(x_RD[r] @ w1_EFD[e].T) * (x_RD[r] @ w3_EFD[e].T)) @ w2_EDF[e].T

where ``e`` is the expert owning row ``r``. Computation happens in the dtype of
``x_RD``: parameters of another dtype (fp32 parameters with bf16 activations, as
under FSDP mixed precision) are cast to it, and their gradients flow back in
their own dtype. The output has the dtype of ``x_RD``. Under autocast (single-device
training with fp32 parameters) the modules first cast their tokens to the autocast dtype,
as autocast does for a matmul: ``torch._grouped_mm`` and the Triton kernels are not on
autocast's list and would otherwise compute in fp32.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import torch
import torch.nn.functional as F
from torchtitan.distributed.spmd_types import maybe_set_sparse_mesh
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

from torchtitan_ext.kernels.fused_moe import (
    fused_moe_grouped,
    fused_moe_routed,
    fused_moe_row_weighted,
    reference_grouped,
    triton_available_reason,
)

from .dispatcher import RoutingDispatcher
from .dtensor_parts import local_part
from .fp8_experts import EXPERT_PRECISIONS, FP8_PRECISIONS, ExpertPrecision, fp8_grouped_experts, fp8_routed_experts
from .grouped_matmul import grouped_mm, row_major, weight_rows
from .validated_config import ValidatedConfig, choice_errors

ExpertsFSDP = Literal["auto", "always"]
"""Whether FSDP wraps the routed experts' weights (``parallelize``)."""
EXPERTS_FSDP_CHOICES: tuple[str, ...] = get_args(ExpertsFSDP)

ExpertCompute = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]
"""``(x_RD, w1_EFD, w2_EDF, w3_EFD, num_tokens_per_expert_E) -> out_RD``, rows grouped by expert.

``x_RD`` may hold rows after the experts' (R > the counts' sum: EP's static receive rows, the row
bound of ``align_size`` padding). They change no weight gradient; their output and input-gradient
rows are unspecified (``grouped_mm`` leaves them unwritten, as ``torch._grouped_mm`` does), and no
caller reads them: the combine gathers the experts' rows."""
RowWeightedExpertCompute = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]
"""``(x_RD, w1_EFD, w2_EDF, w3_EFD, num_tokens_per_expert_E, row_scores_R) -> out_RD``: ``ExpertCompute``
with each output row multiplied by its score (``(R,)``, differentiable), the scores' gradient computed
by the experts' backward from what it keeps anyway."""
RoutedExpertCompute = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]
"""``(x_TD, w1_EFD, w2_EDF, w3_EFD, topk_expert_ids_TK, topk_scores_TK) -> out_TD``, summed over K."""


def _pad_to_multiple(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad ``t`` along ``dim`` up to a positive multiple of ``multiple`` (differentiable)."""
    size = t.shape[dim]
    padding = max(multiple, -(-size // multiple) * multiple) - size
    if padding == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, padding]
    return F.pad(t, pad)


def grouped_mm_experts(
    x_RD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
    row_scores_R: torch.Tensor | None = None,
) -> torch.Tensor:
    """Three ``torch._grouped_mm`` calls over expert offsets (``grouped_matmul.grouped_mm``, which
    compiles in every dtype); no host sync. With ``row_scores_R`` (``RowWeightedExpertCompute``) the
    down projection's input rows are weighted by their scores (``weight_rows``).

    ``_grouped_mm`` needs row-major operands with 16-byte aligned row strides, so D and
    F are zero-padded when they are not aligned (zeros change no result), the output is
    cut back, and strided inputs are made row-major.
    """
    dtype = x_RD.dtype
    dim = x_RD.shape[1]
    align = max(1, 16 // x_RD.element_size())
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

    def grouped(a_RK: torch.Tensor, w_ENK: torch.Tensor) -> torch.Tensor:
        w_ENK = _pad_to_multiple(_pad_to_multiple(w_ENK.to(dtype), 1, align), 2, align)
        return grouped_mm(a_RK, w_ENK.transpose(-2, -1), offsets_E)

    x_RD = row_major(_pad_to_multiple(x_RD, 1, align))
    h_RF = F.silu(grouped(x_RD, w1_EFD)) * grouped(x_RD, w3_EFD)
    return grouped(weight_rows(h_RF, row_scores_R), w2_EDF)[:, :dim]


def batched_mm_padded_experts(
    x_RD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
) -> torch.Tensor:
    """Pad every expert's rows to the largest expert, three ``bmm``s, gather back.

    One host sync (the largest count sizes the padded buffer, the sum splits off the rows after
    the experts'). Padding rows are zeros, contribute nothing to the weight gradients and are never
    gathered back; rows after the experts' (EP's static receive rows) get zero outputs.
    """
    dtype = x_RD.dtype
    num_experts = num_tokens_per_expert_E.shape[0]
    num_rows = x_RD.shape[0]
    counts_E = num_tokens_per_expert_E.to(torch.int64)
    # At least 2 rows per expert (zero rows change nothing): under compile the count is an unbacked
    # size, and the batched matmul's layout must not depend on whether it is 1.
    max_rows_per_expert, grouped_rows = (
        torch.stack([counts_E.max().clamp(min=2), counts_E.sum()]).cpu().tolist() if num_experts else (2, 0)
    )
    torch._check(max_rows_per_expert >= 2)
    torch._check(max_rows_per_expert <= max(num_rows, 2))
    torch._check(grouped_rows >= 0)
    torch._check(grouped_rows <= num_rows)
    grouped_GD, after_experts_RD = torch.split(x_RD, [grouped_rows, num_rows - grouped_rows])
    starts_E = torch.cumsum(counts_E, dim=0) - counts_E
    expert_G = torch.repeat_interleave(
        torch.arange(num_experts, device=x_RD.device), counts_E, output_size=grouped_rows
    )
    slot_G = torch.arange(grouped_rows, device=x_RD.device) - starts_E[expert_G]

    padded_EMD = x_RD.new_zeros(num_experts, max_rows_per_expert, x_RD.shape[1])
    padded_EMD = padded_EMD.index_put((expert_G, slot_G), grouped_GD)
    h_EMF = F.silu(torch.bmm(padded_EMD, w1_EFD.to(dtype).transpose(1, 2))) * torch.bmm(
        padded_EMD, w3_EFD.to(dtype).transpose(1, 2)
    )
    out_EMD = torch.bmm(h_EMF, w2_EDF.to(dtype).transpose(1, 2))
    return torch.cat([out_EMD[expert_G, slot_G], torch.zeros_like(after_experts_RD)])


@dataclass(frozen=True, kw_only=True)
class ComputeBackendSpec:
    """One compute backend: how it computes the expert block and what it needs.

    ``grouped`` takes rows grouped by expert (``ExpertCompute``). ``routed``, when set, takes
    tokens and the router's top-k ids and scores (``RoutedExpertCompute``) and returns the
    weighted sum over K; the MoE layer calls it instead of the dispatcher on a single device.
    ``row_weighted``, when set, is ``grouped`` weighting each row by its score
    (``RowWeightedExpertCompute``); under expert parallelism the MoE layer then has the transport
    sum the rows unweighted, and no expert output is kept for the scores' gradient.
    ``unavailable_reason()`` says why the backend cannot run on this machine (None: it can).
    ``fp8_grouped``, when set, is ``grouped`` with FP8 rowwise GEMMs (``fp8_experts``), taking
    ``emulated=`` as a keyword and the row scores as an optional sixth argument (as ``row_weighted``);
    ``fp8_routed``, when set, is ``routed`` with FP8 rowwise GEMMs on the GPU (not the emulation).
    ``syncs_with_host``: reads the expert counts on the host in every forward. ``pads_rows``: pads every
    expert's rows to the largest expert's count.
    ``recomputes_preactivations``: ``grouped`` and ``row_weighted`` take ``recompute_preactivations=True``
    (keep no gate/up pre-activations for backward, which computes them again).
    """

    name: str
    grouped: ExpertCompute
    routed: RoutedExpertCompute | None = None
    row_weighted: RowWeightedExpertCompute | None = None
    fp8_grouped: Callable[..., torch.Tensor] | None = None
    fp8_routed: RoutedExpertCompute | None = None
    unavailable_reason: Callable[[], str | None] = lambda: None
    syncs_with_host: bool = False
    pads_rows: bool = False
    recomputes_preactivations: bool = False


BACKENDS: dict[str, ComputeBackendSpec] = {}
"""The backend table: every compute backend by name, in the order they are listed and tried."""

AUTO_BACKEND = "auto"
"""The ``compute_backend`` a config may hold until start-up, where it is replaced by the fastest
backend of the table that runs here (``auto_backend``); no module is built from it."""


def backend_names() -> tuple[str, ...]:
    """Every backend of the table, in table order."""
    return tuple(BACKENDS)


def compute_backend_choices() -> tuple[str, ...]:
    """Every value ``moe.compute_backend`` accepts: the backends of the table, then ``AUTO_BACKEND``."""
    return (*BACKENDS, AUTO_BACKEND)


def resolved_at_startup(name: str) -> bool:
    """True for ``AUTO_BACKEND``: the start-up checks replace it by a backend of the table."""
    return name == AUTO_BACKEND


def backend_name_error(name: str) -> str | None:
    """Why a module cannot be built with ``compute_backend = name`` (None: ``name`` is a backend of the table)."""
    if resolved_at_startup(name):
        return (
            "'auto' is resolved to a backend at start-up "
            "(experiments.moe_backends.auto_backend.resolve_auto_compute_backend); resolve it before building"
        )
    if name not in BACKENDS:
        return "unknown backend; valid backends: " + ", ".join(BACKENDS)
    return None


def get_backend(name: str) -> ComputeBackendSpec:
    """The spec of backend ``name``; ValueError listing the valid names otherwise."""
    if (error := backend_name_error(name)) is not None:
        raise ValueError(f"compute_backend = {name!r}: {error}")
    return BACKENDS[name]


def backend_unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run on this machine (None: it can; "auto" picks only backends that can)."""
    return None if resolved_at_startup(name) else get_backend(name).unavailable_reason()


def register_backend(spec: ComputeBackendSpec) -> ComputeBackendSpec:
    """Add ``spec`` to the backend table; its name must be new."""
    if spec.name in compute_backend_choices():
        raise ValueError(f"compute backend {spec.name!r} is already taken")
    BACKENDS[spec.name] = spec
    return spec


DEFAULT_BACKEND = register_backend(
    ComputeBackendSpec(
        name="grouped_mm",
        grouped=grouped_mm_experts,
        row_weighted=grouped_mm_experts,
        fp8_grouped=fp8_grouped_experts,
        fp8_routed=functools.partial(fp8_routed_experts, gemm="torch"),
    )
).name
register_backend(ComputeBackendSpec(name="for_loop", grouped=reference_grouped, syncs_with_host=True))
register_backend(
    ComputeBackendSpec(
        name="batched_mm_padded", grouped=batched_mm_padded_experts, syncs_with_host=True, pads_rows=True
    )
)
register_backend(
    ComputeBackendSpec(
        name="triton",
        grouped=fused_moe_grouped,
        routed=fused_moe_routed,
        row_weighted=fused_moe_row_weighted,
        fp8_grouped=functools.partial(fp8_grouped_experts, gemm="triton"),
        fp8_routed=functools.partial(fp8_routed_experts, gemm="triton"),
        unavailable_reason=triton_available_reason,
        recomputes_preactivations=True,
    )
)


if TYPE_CHECKING:
    # The table's names exist only once its modules have run; a static checker sees a str.
    ComputeBackend = str
    ComputeBackendChoice = str
else:
    ComputeBackend = Literal[backend_names()]
    """A backend name of the table (the type of ``compute_backend``)."""
    ComputeBackendChoice = Literal[compute_backend_choices()]
    """What the ``moe.compute_backend`` TOML key accepts: a backend, or "auto" (resolved at start-up)."""


def runnable_backends() -> list[str]:
    """The backends that can run on this machine, in table order."""
    return [name for name, spec in BACKENDS.items() if spec.unavailable_reason() is None]


def fp8_backends() -> list[str]:
    """The backends with FP8 rowwise expert GEMMs, in table order."""
    return [name for name, spec in BACKENDS.items() if spec.fp8_grouped is not None]


def precision_error(backend: str, precision: str) -> str | None:
    """Why ``backend`` cannot compute its GEMMs in ``precision`` (None: it can)."""
    if precision not in FP8_PRECISIONS:
        return None
    if backend in BACKENDS and BACKENDS[backend].fp8_grouped is None:
        return f"compute_backend {backend!r} has no FP8 expert GEMMs; FP8 rowwise experts compute with " + " or ".join(
            fp8_backends()
        )
    return None


def expert_compute(spec: ComputeBackendSpec, precision: str) -> ExpertCompute:
    """The grouped expert computation of backend ``spec`` in ``precision``."""
    if precision not in FP8_PRECISIONS:
        return spec.grouped
    if (fp8 := _fp8_compute(spec, precision)) is None:
        raise ValueError(precision_error(spec.name, precision))
    return fp8


def _fp8_compute(spec: ComputeBackendSpec, precision: str) -> Callable[..., torch.Tensor] | None:
    """``spec.fp8_grouped`` for the FP8 ``precision`` (emulated or not), None where the backend has none."""
    if spec.fp8_grouped is None:
        return None
    return functools.partial(spec.fp8_grouped, emulated=precision == "fp8_rowwise_emulated")


def row_weighted_compute(spec: ComputeBackendSpec, precision: str) -> RowWeightedExpertCompute | None:
    """The expert computation of backend ``spec`` in ``precision`` that weights each row by its score
    (None: the backend does not): ``row_weighted`` in native precision; in FP8, ``fp8_grouped``, which
    takes the scores as its sixth argument."""
    if precision in FP8_PRECISIONS:
        return _fp8_compute(spec, precision)
    return spec.row_weighted


def _capability_reason(
    backend: str,
    precision: str,
    capable: Callable[[ComputeBackendSpec, str], bool],
    cannot: str,
    *,
    able_in: str,
    they_do: str,
) -> str | None:
    """Why ``backend`` in ``precision`` lacks a capability that only ``capable(spec, precision)`` backends
    have (None: it has it); ``cannot`` says what it does not, ``they_do`` what the backends capable in
    precision ``able_in`` (listed) do."""
    spec = BACKENDS.get(backend)
    if spec is not None and capable(spec, precision):
        return None
    able = [name for name, spec in BACKENDS.items() if capable(spec, able_in)]
    return f"compute_backend {backend!r} with expert_precision {precision!r} {cannot}; {' or '.join(able)} {they_do}"


def row_weighting_unsupported_reason(backend: str, precision: str) -> str | None:
    """Why ``backend`` in ``precision`` cannot weight its rows by the router scores (None: it can)."""
    return _capability_reason(
        backend,
        precision,
        lambda spec, precision: row_weighted_compute(spec, precision) is not None,
        "does not weight its rows by the router scores",
        able_in=precision,
        they_do="in that precision does",
    )


def recompute_unsupported_reason(backend: str, precision: str) -> str | None:
    """Why ``backend`` in ``precision`` cannot recompute its gate/up pre-activations in backward (None: it can)."""
    return _capability_reason(
        backend,
        precision,
        lambda spec, precision: spec.recomputes_preactivations and precision not in FP8_PRECISIONS,
        "keeps its pre-activations for backward",
        able_in="native",
        they_do="in native precision can recompute them",
    )


def host_sync_backends() -> frozenset[str]:
    """Backends that read the expert counts on the host (a device sync) in every forward."""
    return frozenset(name for name, spec in BACKENDS.items() if spec.syncs_with_host)


def _in_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on for its device, else ``x`` unchanged."""
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x


class BackendGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` with the expert computation chosen by name."""

    @dataclass(kw_only=True, slots=True)
    class Config(ValidatedConfig, GroupedExperts.Config):
        compute_backend: ComputeBackend = DEFAULT_BACKEND
        """How the expert block is computed: a name of the backend table ``BACKENDS``."""
        expert_precision: ExpertPrecision = "native"
        """The expert GEMMs' precision: "native" (the activations' dtype) or FP8 rowwise (``fp8_experts``)."""
        recompute_preactivations: bool = False
        """Keep no gate/up pre-activations (R x 2F) from forward to backward, which computes them again
        (one more gate/up GEMM): less memory for more compute (backends with ``recomputes_preactivations``)."""
        fsdp: ExpertsFSDP = "auto"
        """Whether FSDP wraps these weights: "auto" (not where each expert lives on one rank, where FSDP
        would only copy them; see ``parallelize``) or "always" (torchtitan's way)."""

        def validation_errors(self, key: Callable[[str], str] = str) -> list[str]:
            """Every invalid option, one message each; ``key(field)`` is how a message names a field."""
            errors = choice_errors(key, "expert_precision", self.expert_precision, EXPERT_PRECISIONS)
            errors += choice_errors(key, "fsdp", self.fsdp, EXPERTS_FSDP_CHOICES)
            if (error := backend_name_error(self.compute_backend)) is not None:
                errors.append(f"{key('compute_backend')} = {self.compute_backend!r}: {error}")
            elif (error := precision_error(self.compute_backend, self.expert_precision)) is not None:
                errors.append(f"{key('expert_precision')} = {self.expert_precision!r}: {error}")
            elif self.recompute_preactivations and (
                error := recompute_unsupported_reason(self.compute_backend, self.expert_precision)
            ):
                errors.append(f"{key('recompute_preactivations')} = true: {error}")
            return errors

    def __init__(self, config: Config):
        super().__init__(config)
        self.compute_backend = config.compute_backend
        self.expert_precision = config.expert_precision
        self.recompute_preactivations = config.recompute_preactivations
        self.fsdp = config.fsdp
        self.backend = get_backend(config.compute_backend)
        if (error := precision_error(config.compute_backend, config.expert_precision)) is not None:
            raise ValueError(f"expert_precision = {config.expert_precision!r}: {error}")
        if config.recompute_preactivations and (
            error := recompute_unsupported_reason(config.compute_backend, config.expert_precision)
        ):
            raise ValueError(f"recompute_preactivations: {error}")

    @property
    def routed(self) -> RoutedExpertCompute | None:
        """The backend's routed path in this precision (``routed`` in native precision, ``fp8_routed`` in
        ``fp8_rowwise``) where it keeps its pre-activations, else None (the dispatcher's grouped rows then
        reach ``forward``; the FP8 emulation always takes them)."""
        if self.recompute_preactivations:
            return None
        if self.expert_precision == "native":
            return self.backend.routed
        return self.backend.fp8_routed if self.expert_precision == "fp8_rowwise" else None

    @property
    def row_weighted(self) -> RowWeightedExpertCompute | None:
        """The backend's row-weighted path in this precision (``row_weighted_compute``), else None."""
        return row_weighted_compute(self.backend, self.expert_precision)

    def forward(
        self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, row_scores_R: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x_RD`` grouped by expert, ``num_tokens_per_expert_E`` its segment sizes -> ``(R, D)``; with
        ``row_scores_R`` (``(R,)``) each output row times its score (backends with ``row_weighted``)."""
        weights = (local_part(self.w1_EFD), local_part(self.w2_EDF), local_part(self.w3_EFD))
        recompute = {"recompute_preactivations": True} if self.recompute_preactivations else {}
        if row_scores_R is None:
            compute = expert_compute(self.backend, self.expert_precision)
            return compute(_in_autocast_dtype(x_RD), *weights, num_tokens_per_expert_E, **recompute)
        row_weighted = self.row_weighted
        if row_weighted is None:
            raise ValueError(
                f"compute_backend {self.compute_backend!r} with expert_precision {self.expert_precision!r} "
                "does not weight its rows; combine with the dispatcher's scores instead"
            )
        return row_weighted(_in_autocast_dtype(x_RD), *weights, num_tokens_per_expert_E, row_scores_R, **recompute)

    def extra_repr(self) -> str:
        precision = "" if self.expert_precision == "native" else f", expert_precision={self.expert_precision}"
        recompute = ", recompute_preactivations=True" if self.recompute_preactivations else ""
        return f"compute_backend={self.compute_backend}{precision}{recompute}"


class FusedRoutedExperts(RoutedExperts):
    """torchtitan's ``RoutedExperts`` with a single-device shortcut for backends with a routed path,
    and experts that weight their own rows under expert parallelism.

    When the backend's spec has a ``routed`` path and the dispatcher is single-device, the
    dispatcher is skipped: the fused kernels read token rows through the routing indices (no
    permuted copy) and weight and sum each token's expert outputs in their epilogue (no
    separate combine); the FP8 experts' routed path (``fp8_experts.Fp8RoutedExperts``) permutes the
    tokens itself, writing their e4m3 rows beside them, and weights each row before the down
    projection. Slots the
    router dropped (expert id ``num_experts``) contribute nothing and get no gradient, as in
    the dispatcher. Under expert parallelism, a backend with a ``row_weighted`` path over a
    transport that gives each row its score (``experts_apply_scores``) weights the rows in its
    epilogue and the transport sums them unweighted: the score gradient comes from the experts'
    backward instead of from their outputs kept until then. Every other case is torchtitan's
    dispatch -> experts -> combine.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def _routed_path(self) -> RoutedExpertCompute | None:
        """The backend's routed path when it applies here (single device), else None."""
        dispatcher, experts = self.token_dispatcher, self.inner_experts
        if not (isinstance(dispatcher, RoutingDispatcher) and dispatcher.single_device):
            return None
        if not isinstance(experts, BackendGroupedExperts):
            return None
        return experts.routed

    def _experts_weight_rows(self) -> bool:
        """Whether the experts weight their rows here: ``experts_apply_scores`` under expert parallelism.
        ValueError with the reason where the transport or the backend cannot."""
        dispatcher, experts = self.token_dispatcher, self.inner_experts
        if not (isinstance(dispatcher, RoutingDispatcher) and dispatcher.experts_apply_scores):
            return False
        if dispatcher.single_device:
            return False
        if (reason := dispatcher.row_scores_error()) is not None:
            raise ValueError(f"experts_apply_scores: {reason}")
        if (reason := experts_row_weighting_error(experts)) is not None:
            raise ValueError(f"experts_apply_scores: {reason}")
        return True

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        """``(B, L, D)`` tokens, ``(B, L, K)`` scores and expert ids -> ``(B, L, D)`` (under autocast: the
        tokens, and what dispatch sends, in the autocast dtype)."""
        x_BLD = _in_autocast_dtype(x_BLD)
        if self._experts_weight_rows():
            return self._forward_with_weighted_rows(
                x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E
            )
        routed = self._routed_path()
        if routed is None:
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        batch, seq_len, dim = x_BLD.shape
        top_k = topk_expert_ids_BLK.shape[-1]
        experts = self.inner_experts
        out_TD = routed(
            x_BLD.reshape(batch * seq_len, dim),
            local_part(experts.w1_EFD),
            local_part(experts.w2_EDF),
            local_part(experts.w3_EFD),
            topk_expert_ids_BLK.reshape(batch * seq_len, top_k),
            topk_scores_BLK.reshape(batch * seq_len, top_k),
        )
        return out_TD.view(batch, seq_len, dim)

    def _forward_with_weighted_rows(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        """torchtitan's dispatch -> experts -> combine, the scores applied by the experts to their rows
        and the rows summed unweighted."""
        batch, seq_len, dim = x_BLD.shape
        top_k = topk_scores_BLK.shape[-1]
        x_TD = x_BLD.view(batch * seq_len, dim)
        dispatcher = self.token_dispatcher
        assert isinstance(dispatcher, RoutingDispatcher)
        rows_RD, rows_per_local_expert_e, metadata = dispatcher.dispatch(
            x_TD,
            topk_scores_BLK.view(-1, top_k),
            topk_expert_ids_BLK.view(-1, top_k),
            num_local_tokens_per_expert_E,
        )
        row_scores_R = dispatcher.row_scores(metadata, rows_RD.shape[0])
        with maybe_set_sparse_mesh():
            weighted_RD = self.inner_experts(rows_RD, rows_per_local_expert_e, row_scores_R=row_scores_R)
        return dispatcher.sum_rows(weighted_RD, metadata, x_TD).view(batch, -1, dim)


def experts_row_weighting_error(experts: torch.nn.Module | GroupedExperts.Config) -> str | None:
    """Why the grouped experts ``experts`` (a module or its config) cannot weight their rows by the
    router scores (None: they can): torchtitan's own, or ``row_weighting_unsupported_reason``."""
    if not isinstance(experts, (BackendGroupedExperts, BackendGroupedExperts.Config)):
        return f"torchtitan's {type(experts).__qualname__} does not weight its rows"
    return row_weighting_unsupported_reason(experts.compute_backend, experts.expert_precision)
