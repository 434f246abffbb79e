"""The docs describe what exists: every short TOML key is documented, README commands parse."""

import re
import shlex
import shutil
from pathlib import Path

import pytest

from torchtitan_ext import validation
from torchtitan_ext.bench.__main__ import build_parser as bench_parser
from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.short_keys import short_keys
from torchtitan_ext.experiments.moe_backends import startup_checks
from torchtitan_ext.launch import split_launcher_args
from torchtitan_ext.registry import all_flavors
from torchtitan_ext.run_training import FlavorConfigManager

ROOT = Path(__file__).resolve().parents[1]
DOCS_TEXT = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])


def documented_commands(module: str) -> list[tuple[int, list[str], str | None]]:
    """(processes, arguments, the error shown) of every ``-m <module>`` invocation in the docs.

    A command whose next line starts with ``error:`` is an example of a rejected input: the error
    shown is that line without ``error: `` and the lines after it up to the code block's end.
    """
    commands = []
    lines = DOCS_TEXT.splitlines()
    for number, line in enumerate(lines):
        match = re.search(rf"-m {re.escape(module)}(?![\w.])(\s[^`]*)?", line)
        if match and not line.startswith("error:"):
            nproc = re.search(r"--nproc_per_node[= ](\d+)", line)
            args = split_launcher_args(shlex.split((match.group(1) or "").split("#")[0]))[1]
            shown_error = None
            if number + 1 < len(lines) and lines[number + 1].startswith("error:"):
                end = next(i for i in range(number + 1, len(lines)) if lines[i].startswith("```"))
                shown_error = "\n".join(lines[number + 1 : end]).removeprefix("error: ")
            commands.append((int(nproc.group(1)) if nproc else 1, args, shown_error))
    return commands


def test_every_short_key_is_documented():
    all_flavors()
    missing = [k.key for k in short_keys() if f"`{k.key}`" not in DOCS_TEXT]
    assert not missing, f"short keys missing from docs/: {missing}"


def test_documented_train_commands_parse(tmp_path, monkeypatch):
    import torchtitan_ext.model_size

    # The GPU commands parse as on a machine with the memory their full-size flavors need (and FP8 GEMMs).
    monkeypatch.setattr(torchtitan_ext.model_size, "machine_memory_bytes", lambda: 2**50)
    monkeypatch.setattr(startup_checks, "fp8_unavailable_reason", lambda precision: None)
    monkeypatch.setattr(validation, "memory_snapshot_errors", lambda config: [])  # CUDA's allocator
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    for name in ("my.toml", "base.toml", "sweep.toml", "my_data.toml"):
        (tmp_path / name).write_text("[training]\nsteps = 3\n")
    commands = documented_commands("torchtitan_ext.train")
    assert commands
    for nproc, args, shown_error in commands:
        if not args or "--help" in args or "..." in args:  # help, or a command shown in outline
            continue
        monkeypatch.setenv("WORLD_SIZE", str(nproc))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(nproc))
        if shown_error is not None:
            with pytest.raises(ConfigError) as error:
                FlavorConfigManager().parse_args(args)
            assert str(error.value) == shown_error, args
        else:
            FlavorConfigManager().parse_args(args)


def test_documented_flavor_names_exist():
    known = {f.name for f in all_flavors()}
    modules = ("torchtitan_ext.train", "torchtitan_ext.flavors", "torchtitan_ext.bench")
    for _, args, _ in [command for module in modules for command in documented_commands(module)]:
        for flag in ("--flavor", "--show"):
            if flag in args:
                assert args[args.index(flag) + 1] in known


def test_documented_bench_commands_parse():
    commands = documented_commands("torchtitan_ext.bench")
    assert len(commands) >= 10
    for _, args, _ in commands:
        if args:  # the bare module name in prose
            bench_parser().parse_args(args)  # argparse exits on an unknown flag or choice
