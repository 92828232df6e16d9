"""One vocabulary and one check of a job for train, bench and plan.

The vocabulary is :mod:`simplefsdp.parallel_dims`; the check is
:func:`simplefsdp.engines.resolve.job_errors` (layout degrees, the model
family against the layout, the engine), every error at once.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from simplefsdp.engines.resolve import job_errors
from simplefsdp.layout import Layout
from simplefsdp.models.llama3 import get_config
from simplefsdp.models.llama3.tensor_parallel import tp_split_sizes
from simplefsdp.models.registry import get_spec
from simplefsdp.parallel_dims import AC_MODES, ENGINES, PIPELINE_SCHEDULES


def test_the_vocabulary_layout_and_engine_declarations_import_no_torch():
    code = (
        "import sys, simplefsdp.parallel_dims, simplefsdp.layout, simplefsdp.engines.kinds, "
        "simplefsdp.engines.resolve, simplefsdp.layout.pipeline; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_layer_uses_the_one_vocabulary():
    from simplefsdp.bench import configs as bench_configs
    from simplefsdp.engines import AC_MODES as ENGINE_AC_MODES
    from simplefsdp.engines import ENGINES as ENGINE_NAMES
    from simplefsdp.engines import PIPELINE_SCHEDULES as ENGINE_SCHEDULES
    from simplefsdp.engines.kinds import engine_names
    from simplefsdp.plan import layout as plan_layout
    from simplefsdp.train.config import schema

    assert ENGINE_NAMES == ENGINES == engine_names() and schema.ENGINES is ENGINES
    assert ENGINE_SCHEDULES is PIPELINE_SCHEDULES and schema.PP_SCHEDULES is PIPELINE_SCHEDULES
    assert ENGINE_AC_MODES is AC_MODES and schema.AC_MODES is AC_MODES
    assert plan_layout.AC_MODES is AC_MODES
    assert bench_configs.ENGINES == (*ENGINES, "comm")
    assert set(plan_layout.ENGINES) == {"simplefsdp", "fsdp2"}


DEBUG = get_config("debug")  # 4 layers, 8 heads, 4 KV heads, max_seq_len 512
LLAMA = get_spec("llama3")


@pytest.mark.parametrize(
    "layout, world, kwargs, message",
    [
        (Layout(tp=3), 4, {}, "tp 3 does not divide world size 4; valid tensor-parallel "
                              "sizes for 4 ranks: 1, 2, 4"),
        (Layout(pp=0), 4, {}, "pp must be >= 1, got 0"),
        (Layout(ep=2), 4, {}, "ep 2: model 'debug' (family 'llama3') does not compose with "
                              "expert parallelism"),
        (Layout(dp_replicate=3), 8, {}, "dp_replicate 3 does not divide world size 8"),
        (Layout(dp_replicate=2, dp_shard=2), 8, {}, "dp_replicate 2 x dp_shard 2 = 4 ranks"),
        (Layout(pp=2), 4, {"microbatches": 1}, "microbatches 1 is below pp 2"),
        (Layout(pp=2), 4, {"pp_schedule": "zb"}, "unknown pipeline schedule 'zb'"),
        (Layout(tp=8), 8, {"seq_len": 64},
         "tp 8 does not divide the n_kv_heads 4 of model 'debug'; valid tensor-parallel sizes "
         "for this model: [1, 2, 4]"),
        (Layout(tp=2), 2, {"seq_len": 63, "sequence_parallel": True},
         "seq_len 63 is not divisible by tp 2"),
        (Layout(), 2, {"seq_len": 4096}, "seq_len 4096 exceeds max_seq_len 512 of model 'debug'"),
        (Layout(pp=4), 4, {"pp_schedule": "interleaved_1f1b"},
         "pp 4 x 2 stages per rank = 8 stages but model 'debug' has 4 layers"),
        (Layout(pp=2), 4, {"microbatches": 4, "batch": 6},
         "batch 6 is not divisible by microbatches 4; valid microbatches: 2, 3, 6"),
        (Layout(tp=2), 2, {"engine": "ddp", "mode": "replicate"},
         "engine: invalid value 'ddp' with tp=2"),
    ],
)  # fmt: skip
def test_one_line_per_bad_layout(layout, world, kwargs, message):
    errors = job_errors(LLAMA, DEBUG, layout, world, model_name="debug", **kwargs)
    assert len(errors) == 1, errors
    assert message in errors[0] and "\n" not in errors[0]


def test_every_error_at_once():
    """tp 3 on 3 ranks of the debug model: heads and the sequence, both in one answer."""
    errors = job_errors(
        LLAMA, DEBUG, Layout(tp=3), 3, seq_len=128, sequence_parallel=True, model_name="debug"
    )
    assert len(errors) == 2
    assert errors[0].startswith("tp 3 does not divide the n_heads 8")
    assert errors[1].startswith("seq_len 128 is not divisible by tp 3")


def test_the_same_bad_tp_gets_the_same_words_from_train_bench_and_plan():
    """tp 3 on 6 ranks: the debug model's 8 heads do not split, whichever command asks."""
    from simplefsdp.bench.cli import _build_parser, build_spec
    from simplefsdp.plan.layout import Layout as PlanLayout
    from simplefsdp.plan.layout import validate
    from simplefsdp.train.cli import preflight
    from simplefsdp.train.config import load_config

    words = (
        " 3 does not divide the n_heads 8, n_kv_heads 4 of model 'debug'; valid tensor-parallel "
        "sizes for this model: [1, 2, 4]"
    )
    job = load_config(None, ["--parallel.tp", "3", "--data.seq_len", "96"])
    with pytest.raises(ValueError) as train:
        preflight(job, world_size=6, local_world_size=6)
    with pytest.raises(ValueError) as bench:
        build_spec(_build_parser().parse_args(["--nproc", "6", "--tp", "3", "--seq-len", "96"]))
    with pytest.raises(ValueError) as plan:
        validate(get_config("debug"), PlanLayout(gpus=6, batch=2, seq=96, tp=3))
    assert str(train.value) == "parallel.tp" + words
    assert str(bench.value) == "--tp" + words
    # the planner checks a configuration, not a named flavor
    assert str(plan.value) == "--tp" + words.replace("model 'debug'", "the model")


def test_tp_split_sizes_with_loss_parallel():
    args = get_config("debug")
    assert set(tp_split_sizes(args)) == {"n_heads", "n_kv_heads", "feed-forward hidden dim"}
    assert tp_split_sizes(args, loss_parallel=True)["vocab_size"] == args.vocab_size


def test_bench_raises_max_seq_len_to_the_workloads_sequence():
    """The bench's workers build the model with max_seq_len >= --seq-len: no error for it."""
    from simplefsdp.bench.cli import _build_parser, build_spec

    spec = build_spec(_build_parser().parse_args(["--nproc", "2", "--seq-len", "1024"]))
    assert spec.workload.seq_len == 1024
