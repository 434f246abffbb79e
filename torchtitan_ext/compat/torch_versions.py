"""Fixes torchtitan 0.3.0 needs on the torch it runs on, applied on every device.

torchtitan 0.3.0 was written against a torch newer than 2.13 in three places, torch 2.13
mis-orders one compiled graph's saved values, and torchtitan's expert-bias update miscounts
compiled blocks. Each fix is applied only where the running torch or torchtitan has the gap
or the defect, on CPU and GPU alike, names the torch or torchtitan code it answers, and is
covered by ``tests/test_compat.py`` (which fails loudly when a torch or torchtitan upgrade
makes a fix unneeded or wrong).

- ``distributed/utils.py`` ``set_pg_timeouts`` calls ``torch.distributed.set_timeout``
  (torch >= 2.14) after the first step; on torch 2.13 every run died there. The fix sets
  each group's timeout through c10d's per-group setter, after the same barrier.
- ``trainer.py`` ``Trainer.pp_forward_backward_step`` hands ``PipelineSchedule.step`` the
  microbatches it fetched (``arg_mbs=``, ``kwarg_mbs=``, ``target_mbs=``); torch 2.13's ``step``
  takes the whole batch and splits it, so every pipeline-parallel run died in its first step. The
  fix joins the microbatches along the batch dimension (the schedule splits them back into the
  same ones) and sums the loss over the pipeline's ranks, so rank 0 logs it too; torchtitan's
  ``ensure_pp_loss_visible`` warning, which asks for the last stage's rank in ``LOG_RANK``, is then
  moot and silenced.
- ``models/common/token_dispatcher.py`` reads ``torch.compiler._is_non_strict_tracing``
  (torch >= 2.13); the benchmarks also run on older torch builds (2.11 on the GPU image).
- ``torch/_functorch/partitioners.py`` ``functionalize_rng_ops``: a compiled block that
  recomputes a random op under activation checkpointing (CPU attention is one: every SDPA
  kernel is tagged ``nondeterministic_seeded``) saves that op's RNG state as a forward output,
  inserted right before the saved symints, i.e. after the saved opaque objects (the
  DeviceMesh of an expert-parallel DTensor weight). AOTAutograd's runtime reads tensors,
  then opaque objects, then symints (``ViewAndMutationMeta`` slices), so the step died with
  "expected all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh". CUDA
  takes the graph-safe RNG path, which adds inputs, not outputs, so CPU met it (a GPU only
  with Inductor's ``fallback_random`` or functorch's ``graphsafe_rng_functionalization``
  off). The fix puts the RNG states before the opaque objects, in the forward's outputs and
  the backward's inputs alike.
- ``components/optimizer/optimizer.py`` ``register_moe_load_balancing_hook``: the expert-bias
  update halves ``tokens_per_expert_E`` of every block wrapped for activation checkpointing,
  whose eager recomputation counts each token a second time. ``distributed/compile.py``
  ``apply_compile`` sets ``skip_fwd_side_effects_in_bwd_under_checkpoint``, so a compiled
  block's recomputation counts nothing: the update saw half the counts (rounded down) and
  moved the biases differently from eager. The fix doubles a compiled checkpointed block's
  counts in a global optimizer step pre-hook, which runs before torchtitan's own.
"""

import functools
import inspect
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.tensor  # registers DeviceMesh and ProcessGroup as opaque types
import torchtitan.distributed.utils as titan_dist_utils
from torch import fx
from torch._functorch import partitioners
from torch._functorch._aot_autograd import graph_compile
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import CheckpointPolicy
from torchtitan.components.optimizer import OptimizersContainer, register_moe_load_balancing_hook

original_set_pg_timeouts = titan_dist_utils.set_pg_timeouts
original_functionalize_rng_ops = partitioners.functionalize_rng_ops


def set_pg_timeouts_per_group(timeout: timedelta, parallel_dims) -> None:
    """torchtitan's ``set_pg_timeouts`` through ``_set_pg_timeout`` (torch without ``set_timeout``).

    Barrier first (on the current GPU under NCCL), so no rank issues a collective under the
    new timeout while a slower one still runs under the old.
    """
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    else:
        dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def needs_set_timeout_fix() -> bool:
    return not hasattr(dist, "set_timeout")


def needs_non_strict_tracing_fix() -> bool:
    return not hasattr(torch.compiler, "_is_non_strict_tracing")


def _placeholders(module: fx.GraphModule) -> list[fx.Node]:
    return list(module.graph.find_nodes(op="placeholder"))


def _outputs(module: fx.GraphModule) -> tuple:
    outputs = module.graph.output_node().args[0]
    assert isinstance(outputs, (tuple, list)), "a partitioned graph returns a tuple"
    return tuple(outputs)


def functionalize_rng_ops_before_opaque_objects(
    joint_module: fx.GraphModule, fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_sym_nodes: int
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's ``functionalize_rng_ops``, the RNG states saved ahead of the saved opaque objects.

    The opaque objects saved right before the symints count as trailing, so torch inserts the
    RNG state outputs before them; its new backward inputs (placed before the first tangent)
    move ahead of the first opaque input, matching the order the runtime passes them in.
    """
    bw_inputs = set(_placeholders(bw_module))
    saved_before_symints = _outputs(fw_module)[: len(_outputs(fw_module)) - num_sym_nodes]
    bw_input_names = {node.name for node in bw_inputs}
    num_opaque = 0
    for node in reversed(saved_before_symints):
        if not (graph_compile.is_opaque_node(node) and node.name in bw_input_names):
            break
        num_opaque += 1
    if num_opaque == 0:
        return original_functionalize_rng_ops(joint_module, fw_module, bw_module, num_sym_nodes)
    fw_module, bw_module = original_functionalize_rng_ops(
        joint_module, fw_module, bw_module, num_sym_nodes + num_opaque
    )
    placeholders = _placeholders(bw_module)
    first_opaque = next(node for node in placeholders if graph_compile.is_opaque_node(node))
    first_tangent = next(index for index, node in enumerate(placeholders) if "tangent" in node.name)
    for node in placeholders[:first_tangent]:
        if node not in bw_inputs:
            first_opaque.prepend(node)
    bw_module.recompile()
    return fw_module, bw_module


@functools.cache
def needs_rng_state_order_fix() -> bool:
    """Whether torch's own ``functionalize_rng_ops`` saves an RNG state after a saved opaque object.

    Runs it on a forward/backward pair of one recomputed ``rand_like`` whose forward saves a
    tensor, then a ProcessGroup (an opaque object, as a DeviceMesh is); milliseconds. A torch whose
    compiled graphs save no opaque objects (no ``is_opaque_node``: 2.11, the benchmarks' GPU image)
    needs nothing.
    """
    if not hasattr(graph_compile, "is_opaque_node"):
        return False
    with FakeTensorMode():
        x = torch.empty(2)
        opaque = dist.ProcessGroup(dist.HashStore(), 0, 1)

        def graph_module(inputs: tuple[str, ...], saved: tuple[str, ...] = ()) -> fx.GraphModule:
            graph = fx.Graph()
            nodes = {}
            for name in inputs:
                nodes[name] = graph.placeholder(name)
                nodes[name].meta["val"] = opaque if name == "opaque" else x
            rand = graph.call_function(torch.ops.aten.rand_like.default, (nodes["x"],))
            rand.meta.update(val=x, recompute=CheckpointPolicy.PREFER_RECOMPUTE)
            graph.output((rand, *(nodes[name] for name in saved)))
            return fx.GraphModule(torch.nn.Module(), graph)

        forward, _ = original_functionalize_rng_ops(
            graph_module(("x", "opaque", "tangents_1")),
            graph_module(("x", "opaque"), saved=("x", "opaque")),
            graph_module(("x", "opaque", "tangents_1")),
            0,
        )
    return _outputs(forward)[-1].name != "opaque"


def double_counts_of_compiled_checkpointed_blocks(optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: ``tokens_per_expert_E`` x 2 in each compiled block that
    torchtitan's expert-bias update halves (wrapped for recomputation, load balancing on)."""
    if not (
        isinstance(optimizer, OptimizersContainer)
        and torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    ):
        return
    for model_part in optimizer.model_parts:
        for block in model_part.get_submodule("layers").children():
            moe = block.get_submodule("moe") if getattr(block, "moe_enabled", False) else None
            if (
                moe is not None
                and moe.load_balance_coeff is not None
                and getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT
                and block._compiled_call_impl is not None
            ):
                moe.get_buffer("tokens_per_expert_E").mul_(2)


def needs_expert_bias_count_fix() -> bool:
    return "tokens_per_expert_E // 2" in inspect.getsource(register_moe_load_balancing_hook)


@functools.cache
def register_expert_bias_count_hook():
    """Register ``double_counts_of_compiled_checkpointed_blocks`` once; its handle."""
    return register_optimizer_step_pre_hook(double_counts_of_compiled_checkpointed_blocks)


def pp_forward_backward_whole_batch(
    self,
    *,
    input_dict_mbs: list[dict[str, torch.Tensor]],
    label_mbs: list[torch.Tensor],
    global_valid_tokens: torch.Tensor,
) -> torch.Tensor:
    """torchtitan's ``Trainer.pp_forward_backward_step`` for a torch whose ``PipelineSchedule.step`` takes
    the whole batch: the microbatches torchtitan fetched, joined along the batch dimension, which the
    schedule splits back into the same microbatches (each ``pipeline_parallel_microbatch_size`` rows).
    The loss, which only the stage computing it holds, is summed over the pipeline's ranks, so every
    stage returns it (torchtitan returns -1 elsewhere), and rank 0's log shows it."""
    inputs_mbs, targets_mbs, kwargs_mbs = [], [], []
    for input_dict, fetched_labels in zip(input_dict_mbs, label_mbs, strict=True):
        inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, fetched_labels)
        inputs_mbs.append(inputs)
        targets_mbs.append(labels)
        kwargs_mbs.append(extra_kwargs)
    args = (torch.cat(inputs_mbs),) if self.pp_has_first_stage else ()
    losses = [] if self.pp_has_last_stage else None
    with self.train_context():
        self.pp_schedule.step(
            *args,
            target=torch.cat(targets_mbs) if self.pp_has_last_stage else None,
            losses=losses,
            return_outputs=False,
            loss_kwargs={"global_valid_tokens": global_valid_tokens},
            **{key: _joined([kwargs[key] for kwargs in kwargs_mbs], key) for key in kwargs_mbs[0]},
        )
    if self.pp_has_last_stage:
        assert losses is not None
        loss = torch.sum(torch.stack(losses)).to(self.device)
    else:
        loss = torch.zeros((), device=self.device)
    dist.all_reduce(loss, group=self.parallel_dims.get_mesh("pp").get_group())
    return loss


def _joined(values: list, key: str):
    """One microbatch input ``key`` over the whole batch: tensors joined along the batch dimension (the
    schedule splits them back), anything else the same in every microbatch and passed once."""
    if all(isinstance(value, torch.Tensor) for value in values):
        return torch.cat(values)
    if all(value is None for value in values):
        return None
    raise NotImplementedError(
        f"pipeline parallelism on this torch: the model input {key!r} differs between microbatches and is not a "
        "tensor, so it cannot be joined into one batch for PipelineSchedule.step"
    )


@functools.cache
def original_pp_forward_backward_step():
    """torchtitan's own ``Trainer.pp_forward_backward_step``. Its module, the Trainer stack, is imported
    here only, so that the benchmarks, which apply ``apply_torch_version_fixes``, never load it."""
    from torchtitan.trainer import Trainer

    return Trainer.pp_forward_backward_step


def needs_pipeline_step_fix() -> bool:
    return "arg_mbs" in inspect.getsource(original_pp_forward_backward_step()) and (
        "arg_mbs" not in inspect.signature(PipelineScheduleSingle.step).parameters
    )


def apply_trainer_fixes() -> list[str]:
    """Apply the fixes of torchtitan's Trainer this torch needs (idempotent; the training entry's, beside
    ``apply_torch_version_fixes``); returns the names of those applied."""
    import torchtitan.trainer as titan_trainer

    if not needs_pipeline_step_fix():
        return []
    titan_trainer.Trainer.pp_forward_backward_step = pp_forward_backward_whole_batch
    # The loss is on every stage now: torchtitan's warning that only the last stage's rank shows it
    # (and its advice to list that rank in LOG_RANK) no longer applies.
    titan_trainer.ensure_pp_loss_visible = lambda **_: None
    return ["pp_forward_backward_step"]


def apply_torch_version_fixes() -> list[str]:
    """Apply the fixes this torch needs (idempotent); returns the names of those applied."""
    applied = []
    if needs_set_timeout_fix():
        titan_dist_utils.set_pg_timeouts = set_pg_timeouts_per_group
        applied.append("set_pg_timeouts")
    if needs_non_strict_tracing_fix():
        torch.compiler._is_non_strict_tracing = lambda: False
        applied.append("_is_non_strict_tracing")
    if needs_rng_state_order_fix():
        partitioners.functionalize_rng_ops = functionalize_rng_ops_before_opaque_objects
        applied.append("functionalize_rng_ops")
    if needs_expert_bias_count_fix():
        register_expert_bias_count_hook()
        applied.append("register_moe_load_balancing_hook")
    return applied
