"""The process's place in a launch is read in one module: rank and world size as torchrun sets them,
rank 0 of a world of 1 outside a launch."""

import ast
from pathlib import Path

import pytest

from torchtitan_ext import place_in_launch

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_launch(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_outside_a_launch_a_process_is_rank_0_of_1(no_launch):
    assert not place_in_launch.in_launch()
    assert (place_in_launch.rank(), place_in_launch.local_rank()) == (0, 0)
    assert (place_in_launch.world_size(), place_in_launch.local_world_size()) == (1, 1)
    assert place_in_launch.is_rank_zero()


def test_under_torchrun_the_variables_it_sets(no_launch):
    no_launch.setenv("RANK", "5")
    no_launch.setenv("LOCAL_RANK", "1")
    no_launch.setenv("WORLD_SIZE", "8")
    no_launch.setenv("LOCAL_WORLD_SIZE", "4")
    assert place_in_launch.in_launch() and not place_in_launch.is_rank_zero()
    assert (place_in_launch.rank(), place_in_launch.local_rank()) == (5, 1)
    assert (place_in_launch.world_size(), place_in_launch.local_world_size()) == (8, 4)


def test_local_values_default_to_the_global_ones(no_launch):
    no_launch.setenv("RANK", "3")
    no_launch.setenv("WORLD_SIZE", "4")
    assert (place_in_launch.local_rank(), place_in_launch.local_world_size()) == (3, 4)


def test_no_other_module_reads_the_launch_variables():
    readers = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in (ROOT / "torchtitan_ext").rglob("*.py")
        if path.name != "place_in_launch.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in LAUNCH_VARIABLES
    )
    assert not readers, f"read the launch variables through torchtitan_ext.place_in_launch: {readers}"
