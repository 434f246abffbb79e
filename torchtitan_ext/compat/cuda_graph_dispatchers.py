"""torchtitan's CUDA-graph check, taught about token dispatchers that say they never wait for the host.

``torchtitan/trainer.py`` ``Trainer.Config._validate_cuda_graphs`` (torchtitan 0.3.0) refuses CUDA
graphs under expert parallelism unless every token dispatcher config is one of its own sync-free
ones (MinimalAsyncEP, HybridEP with a capacity factor): it checks their classes, and it runs when
the config is built, before this project's start-up checks. A dispatcher config of another class
can say whether it waits for the host with an attribute ``host_sync_free`` (True: its dispatch and
combine read nothing on the host, so a captured step replays them); its project's start-up check
refuses CUDA graphs with the reason when it is False. When every dispatcher of the model has the
attribute, torchtitan's check runs as for a model without expert parallelism (its other rules,
such as pipeline parallelism, still apply); otherwise it runs unchanged. Applied on every device
before the config is built; ``tests/test_compat.py`` checks that torchtitan still refuses a
dispatcher without the attribute and that one with it passes.
"""

import copy
import dataclasses

from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
from torchtitan.trainer import Trainer

original_validate_cuda_graphs = Trainer.Config._validate_cuda_graphs


def says_whether_host_sync_free(dispatcher_config) -> bool:
    return hasattr(dispatcher_config, "host_sync_free")


def validate_cuda_graphs_with_declared_dispatchers(config: Trainer.Config) -> None:
    """torchtitan's check, with expert parallelism's dispatcher rule left to dispatchers that say."""
    if config.training.disable_cuda_graphs or config.model_spec is None:
        return original_validate_cuda_graphs(config)
    dispatchers = [d for _, d, _, _ in config.model_spec.model.traverse(LocalTokenDispatcher.Config)]
    if not dispatchers or not all(says_whether_host_sync_free(d) for d in dispatchers):
        return original_validate_cuda_graphs(config)
    checked = copy.copy(config)
    checked.parallelism = dataclasses.replace(config.parallelism, expert_parallel_degree=1)
    return original_validate_cuda_graphs(checked)


def apply_cuda_graph_dispatcher_fix() -> None:
    """Install the check (idempotent)."""
    # pyrefly: ignore[bad-assignment]  # a method replaced on torchtitan's class: its argument is named config here
    Trainer.Config._validate_cuda_graphs = validate_cuda_graphs_with_declared_dispatchers
