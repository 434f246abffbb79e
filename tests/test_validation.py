"""Start-up validation: every bad value, path and ignored key ends in one message and exit 2."""

import textwrap

import pytest
import torch
from helpers import model_config

from torchtitan_ext.train import main

TINY = "tiny-moe-grouped-mm"


def write_toml(tmp_path, text, name="bad.toml", encoding="utf-8"):
    path = tmp_path / name
    path.write_bytes(textwrap.dedent(text).encode(encoding))
    return str(path)


def run_train(capsys, *args) -> tuple[int, str]:
    """``main`` on ``args``; (exit code, what the user reads on stderr)."""
    code = main(["--flavor", TINY, *args])
    return code, capsys.readouterr().err


def assert_refused(capsys, args, *fragments):
    code, err = run_train(capsys, *args)
    assert code == 2, err
    assert err.count("error:") == 1, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize(
    "toml,fragments",
    [
        # Class 1: keys a flavor fixed at build time, one per kind.
        ("[model]\ndim = 32\n", ["bad.toml:2: model.dim cannot be overridden", "pick a flavor"]),
        ("[model]\nvocab_size = 100\n", ["model.vocab_size cannot be overridden"]),
        (
            "[model.layers.0.moe]\nnum_experts = 4\n",
            ["model.layers.0.moe.num_experts cannot be overridden", "router, dispatcher and experts"],
        ),
        (
            "[model.layers.0.moe.router]\nnum_experts = 4\n",
            ["model.layers.0.moe.router.num_experts cannot be overridden"],
        ),
        # Class 2: silent nonsense.
        ("[training]\nsteps = 0\n", ["bad.toml:2: training.steps = 0: must be >= 1"]),
        ("[training]\nsteps = -5\n", ["training.steps = -5: must be >= 1"]),
        ("[training]\nlr = nan\n", ["training.lr = nan: must be a finite number > 0"]),
        ("[training]\nlr = inf\n", ["training.lr = inf: must be a finite number > 0"]),
        # Class 3: values that used to end in tracebacks.
        ("[moe]\ncapacity_factor = inf\n", ["capacity_factor = inf: must be a finite number"]),
        ("[moe]\nroute_scale = nan\n", ["route_scale = nan: must be a finite number"]),
        ("[moe]\nalign_size = 100000000000\n", ["bad.toml:2: moe.align_size = 100000000000: must be in [1, 2048]"]),
        (
            "[moe]\nroute_scale = 0\ntop_k = 9\n",
            ["bad.toml:2: moe.route_scale = 0.0: must be > 0", "bad.toml:3: moe.top_k = 9: must be in [1, 8]"],
        ),
        (
            "[moe]\nalign_size = 4096\n[training]\nbatch_size = 1\nseq_len = 64\n",
            ["moe.align_size = 4096: must be in [1, 128]"],
        ),
        ("[training]\nbatch_size = 0\n", ["training.batch_size = 0: must be >= 1"]),
        ("[metrics]\nlog_freq = 0\n", ["bad.toml:2: metrics.log_freq = 0: must be >= 1 (every N steps)"]),
        ("[training]\ngc_freq = -1\n", ["training.gc_freq = -1: must be >= 1"]),
        ("[checkpoint]\ninterval = 0\n", ["checkpoint.interval = 0: must be >= 1"]),
        ("[profiler]\nmemory_snapshot_freq = 0\n", ["profiler.memory_snapshot_freq = 0: must be >= 1"]),
        ("[training]\nseq_len = -8\n", ["training.seq_len = -8: must be >= 1"]),
        ("[training]\nseq_len = 100\n", ["training.seq_len = 100", "use a multiple of 8"]),
        ("[training]\nseq_len = 4096\n", ["exceeds the model's RoPE length (max_seq_len = 512)"]),
        ("[training]\nglobal_batch_size = 12\n", ["training.global_batch_size = 12", "multiple of local_batch_size"]),
        (
            '[compile]\nenable = true\nbackend = "indcutor"\n',
            ["bad.toml:3: compile.backend = 'indcutor': not a torch.compile backend; did you mean inductor"],
        ),
        (
            '[compile]\nenable = true\ncomponents = ["modell"]\n',
            ["bad.toml:3: compile.components = ['modell']: 'modell' is not a component", "did you mean model?"],
        ),
        ('[data]\ndataset = "c5"\n', ["data.dataset = 'c5': unknown dataset", "tiny_stories"]),
        (
            "[data]\nworkers = 2\n",
            [
                "bad.toml:2: data.workers = 2: torchtitan's text and chat datasets give every worker process "
                "the whole stream, so each batch would be trained on 2 times; use 1"
            ],
        ),
        ("[dataloader]\nnum_workers = -1\n", ["bad.toml:2: dataloader.num_workers = -1: must be >= 0"]),
        ('[data]\ntokenizer = "/no/such/tokenizer"\n', ["'/no/such/tokenizer': no such folder"]),
    ],
)
def test_bad_toml_value_is_named_with_file_and_exit_2(tmp_path, capsys, toml, fragments):
    assert_refused(capsys, ["--toml", write_toml(tmp_path, toml)], *fragments)


def test_paths_without_data_or_tokenizer_and_a_file_as_dump_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "a_file").write_text("x")
    toml = write_toml(
        tmp_path,
        f"""\
        dump_folder = "{tmp_path / "a_file" / "out"}"
        [data]
        path = "{tmp_path / "empty"}"
        tokenizer = "{tmp_path / "no_tokenizer"}"
        """,
    )
    assert_refused(
        capsys,
        ["--toml", toml],
        "bad.toml:3: data.path",
        "the folder holds no data files",
        "bad.toml:4: data.tokenizer",
        "the folder has none of tokenizer.json",
        "bad.toml:1: dump_folder",
        "is a file; dump_folder must be a folder",
    )


def test_every_problem_of_a_run_is_reported_together(tmp_path, capsys):
    toml = write_toml(
        tmp_path,
        """\
        [training]
        steps = 0
        seq_len = 100
        [moe]
        route_scale = nan
        """,
    )
    assert_refused(
        capsys,
        ["--toml", toml, "--training.batch_size", "0"],
        "training.steps = 0",
        "training.seq_len = 100",
        "route_scale = nan",
        "command line: training.batch_size = 0",
    )


def test_refused_types_and_choices_come_with_every_other_value_problem(tmp_path, capsys):
    """A value of the wrong type or no valid choice, in a file, in a short key or in an option torchtitan's
    parser takes, does not hide the range and cross-field problems of the other values: one message."""
    toml = write_toml(
        tmp_path,
        """\
        [training]
        lr = -1
        steps = "x"
        [moe]
        top_k = 9
        compute_backend = "nope"
        [metrics]
        log_freq = 0
        """,
    )
    code, err = run_train(
        capsys, "--toml", toml, "--training.batch_size", "x", "--training.seq_len", "0", "--training.max_norm", "y"
    )
    assert code == 2, err
    assert err.count("error:") == 1, err
    for fragment in (
        "bad.toml:3: training.steps = 'x': expected int, got str",
        "bad.toml:6: moe.compute_backend = 'nope' is not one of the valid choices",
        "command line: training.batch_size = 'x': expected int, got str",
        "command line: training.max_norm = 'y': expected float|int, got str",
        "bad.toml:2: training.lr = -1.0: must be a finite number > 0",
        "command line: training.seq_len = 0: must be >= 1",
        "bad.toml:8: metrics.log_freq = 0: must be >= 1",
        "bad.toml:5: moe.top_k = 9: must be in [1, 8]",
    ):
        assert fragment in err, err
    code, err = run_train(capsys, "--training.steps", "x", "--moe.top_k", "9")  # both on the command line
    assert code == 2 and "training.steps = 'x': expected int" in err and "moe.top_k = 9: must be in [1, 8]" in err


def test_toml_that_is_not_utf8(tmp_path, capsys):
    toml = write_toml(tmp_path, "[training]\n# caf\u00e9\nsteps = 3\n", encoding="latin-1")
    assert_refused(capsys, ["--toml", toml], "bad.toml:2: not a UTF-8 text file", "TOML files must be UTF-8")


@pytest.fixture
def cpu_with_16_gib(monkeypatch):
    """A CPU machine (no CUDA, also where the tests run on a GPU host) with 16 GiB of memory."""
    import torchtitan_ext.model_size

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torchtitan_ext.model_size, "machine_memory_bytes", lambda: 16 * 2**30)


def test_a_model_too_large_for_this_machine_is_refused_with_the_memory_it_needs(capsys, cpu_with_16_gib):
    code = main(["--flavor", "qwen3-30b-a3b", "--training.steps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "the model (qwen3-30b-a3b, 30.53B parameters) needs at least 455.0 GiB on this host to train on CPU" in err
    assert "4 copies of every parameter in float32" in err and "this machine has 16.0 GiB of memory" in err


MEMORY_ERROR = "the model (olmoe-1b-7b, 6.92B parameters) needs at least 103.1 GiB on this host to train on CPU"
TRITON_DEFAULT_ERROR = (
    "moe.compute_backend = 'triton' (the flavor's default): the Triton MoE kernels need a CUDA GPU, and CUDA is "
    "not available"
)


@pytest.mark.parametrize(
    "memory_gib, args, errors",
    [
        (16, [], [MEMORY_ERROR, TRITON_DEFAULT_ERROR]),
        (16, ["--moe.compute_backend", "grouped_mm"], [MEMORY_ERROR]),
        (1024, [], [TRITON_DEFAULT_ERROR]),
        (1024, ["--moe.compute_backend", "triton"], ["command line: moe.compute_backend = 'triton': the Triton"]),
    ],
)
def test_a_full_size_flavor_on_cpu_is_told_what_stops_it(
    capsys, monkeypatch, cpu_with_16_gib, memory_gib, args, errors
):
    """A full-size flavor computes in triton by default: on a CPU machine without the Triton interpreter
    the user reads, in one message, each problem and its way out."""
    import torchtitan_ext.model_size

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torchtitan_ext.model_size, "machine_memory_bytes", lambda: memory_gib * 2**30)
    code = main(["--flavor", "olmoe-1b-7b", "--training.steps", "1", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    lines = err.removeprefix("error: ").splitlines()
    assert len(lines) == len(errors) and all(map(str.startswith, lines, errors)), err
    if "triton" in err:
        assert lines[-1].endswith("; --moe.compute_backend grouped_mm runs here"), err


def test_the_memory_rule_is_the_estimate_not_the_flavor_name(monkeypatch, cpu_with_16_gib):
    import torchtitan_ext.model_size
    from torchtitan_ext.registry import get_flavor
    from torchtitan_ext.validation import memory_errors

    tiny = get_flavor(TINY).build()
    assert memory_errors(tiny) == []
    monkeypatch.setattr(torchtitan_ext.model_size, "machine_memory_bytes", lambda: 2**20)
    (error,) = memory_errors(tiny)
    assert "402.82K parameters" in error and "needs at least 0.0 GiB" in error
    monkeypatch.setenv("WORLD_SIZE", "64")  # 64 hosts of one rank share the state
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    olmoe = get_flavor("olmoe-1b-7b").build()
    monkeypatch.setattr(torchtitan_ext.model_size, "machine_memory_bytes", lambda: 16 * 2**30)
    assert memory_errors(olmoe) == []


def test_expert_parallel_degree_above_world_suggests_the_launcher(capsys):
    assert_refused(
        capsys,
        ["--parallelism.expert_parallel_degree", "2"],
        "needs at least 2 processes",
        "python -m torchtitan_ext.train --nproc_per_node=2 --flavor tiny-moe-grouped-mm",
    )


def test_the_parallel_layout_of_the_ranks():
    from torchtitan.config import ParallelismConfig

    from torchtitan_ext.parallel_layout import data_parallel_shard_degree, degree_errors, layout_errors

    layout = ParallelismConfig(tensor_parallel_degree=2)  # dp_shard -1: the ranks tp leaves
    assert data_parallel_shard_degree(layout, 8) == 4 and layout_errors(layout, 8) == []
    assert (
        layout_errors(layout, 3)
        == degree_errors(layout, 3)
        == [
            "parallelism: world size 3 is not divisible by dp_replicate*cp*tp*pp = 2 "
            "(parallelism.tensor_parallel_degree = 2)"
        ]
    )
    layout = ParallelismConfig(data_parallel_shard_degree=2, expert_parallel_degree=4)
    (too_few,) = layout_errors(layout, 2)
    assert too_few.startswith("parallelism.expert_parallel_degree = 4: needs at least 4 processes but this run has 2")
    assert "launch one process per rank: python -m torchtitan_ext.train --nproc_per_node=4" in too_few
    assert "launch" not in layout_errors(layout, 2, suggest_launch=False)[0]
    assert layout_errors(layout, 4) == [
        "parallelism: dp_replicate(1) * dp_shard(2) * cp(1) * tp(1) * pp(1) != world size 4 "
        "(parallelism.data_parallel_shard_degree = 2)",
        "parallelism.expert_parallel_degree = 4: must divide dp_shard*cp*tp = 2 "
        "(EP borrows ranks from data-shard, context and tensor parallelism)",
    ]
    layout.pipeline_parallel_degree = 0
    layout.data_parallel_shard_degree = -2
    assert degree_errors(layout, 4) == [
        "parallelism.pipeline_parallel_degree = 0: must be >= 1",
        "parallelism.data_parallel_shard_degree = -2: must be >= 1 (or -1: the ranks the other degrees leave)",
    ]


def test_parallelism_refusals_name_where_each_degree_was_set(tmp_path, capsys):
    """A degree set in a TOML file is named with its file and line, one set by a short key on the command
    line by that key; a degree the experts refuse gets no launch command that would fail again."""
    toml = write_toml(tmp_path, "[parallelism]\nexpert_parallel_degree = 3\n")
    code, err = run_train(capsys, "--toml", toml)
    assert code == 2, err
    assert "bad.toml:2: parallelism.expert_parallel_degree = 3: needs at least 3 processes" in err
    assert "bad.toml:2: parallelism.expert_parallel_degree = 3: does not divide the number of experts (8)" in err
    assert "--nproc_per_node" not in err
    assert_refused(capsys, ["--parallelism.ep", "0"], "command line: parallelism.ep = 0: must be >= 1")
    assert_refused(
        capsys,
        ["--parallelism.tp", "3"],
        "world size 1 is not divisible by dp_replicate*cp*tp*pp = 3 (command line: parallelism.tp = 3)",
    )


def test_context_parallelism_on_cpu_is_refused_with_the_reason(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_refused(
        capsys,
        ["--parallelism.cp", "2"],
        "command line: parallelism.cp = 2: context parallelism shards CUDA's attention kernels, and this run "
        "trains on CPU",
    )


def test_tensor_parallelism_is_refused_for_whole_projection_qk_norm():
    """OLMoE normalises the whole query/key projection, which a rank holding some of the heads cannot."""
    from torchtitan_ext.config.value_sources import forget_value_sources
    from torchtitan_ext.experiments.moe_backends.startup_checks import parallelism_errors
    from torchtitan_ext.registry import get_flavor

    forget_value_sources()  # a config built here, not resolved from a command line
    config = get_flavor("tiny-olmoe").build()
    moes = [layer.moe for layer in model_config(config).layers]
    assert parallelism_errors(config, moes, world_size=2) == []
    config.parallelism.tensor_parallel_degree = 2
    assert parallelism_errors(config, moes, world_size=2) == [
        "parallelism.tensor_parallel_degree = 2: this model normalises the whole query/key projection (OLMoE), "
        "which a rank holding some of the heads cannot; use data or expert parallelism"
    ]


def test_memory_snapshots_on_cpu_are_refused_with_where_to_take_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    toml = write_toml(tmp_path, "[profiler]\nenable_memory_snapshot = true\nmemory_snapshot_freq = 2\n")
    assert_refused(
        capsys,
        ["--toml", toml],
        "bad.toml:2: profiler.enable_memory_snapshot: memory snapshots record the CUDA allocator",
        "python -m torchtitan_ext.bench memory SNAPSHOT.pickle",
    )
