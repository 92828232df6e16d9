"""One layout vocabulary and one validation for train, bench and plan (simplefsdp.parallel_dims)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simplefsdp.models.llama3 import get_config
from simplefsdp.parallel_dims import (
    AC_MODES,
    ENGINES,
    PIPELINE_SCHEDULES,
    ParallelDims,
    tp_split_sizes,
)


def test_the_module_imports_no_torch():
    code = "import sys, simplefsdp.parallel_dims; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_layer_uses_the_one_vocabulary():
    from simplefsdp.bench import configs as bench_configs
    from simplefsdp.engines import AC_MODES as ENGINE_AC_MODES
    from simplefsdp.engines import ENGINES as ENGINE_NAMES
    from simplefsdp.engines import PIPELINE_SCHEDULES as ENGINE_SCHEDULES
    from simplefsdp.plan import layout as plan_layout
    from simplefsdp.train.config import schema

    assert ENGINE_NAMES is ENGINES and schema.ENGINES is ENGINES
    assert ENGINE_SCHEDULES is PIPELINE_SCHEDULES and schema.PP_SCHEDULES is PIPELINE_SCHEDULES
    assert ENGINE_AC_MODES is AC_MODES and schema.AC_MODES is AC_MODES
    assert plan_layout.AC_MODES is AC_MODES
    assert bench_configs.ENGINES == (*ENGINES, "comm")
    assert set(plan_layout.ENGINES) <= set(ENGINES)


@pytest.mark.parametrize(
    "dims, kwargs, message",
    [
        (ParallelDims(4, tp=3), {}, "tp 3 does not divide world size 4; valid tensor-parallel "
                                    "sizes for 4 ranks: 1, 2, 4"),
        (ParallelDims(4, pp=0), {}, "pp must be >= 1, got 0"),
        (ParallelDims(4, ep=2), {}, "ep 2: expert parallelism needs a model with experts"),
        (ParallelDims(8, dp_replicate=3), {}, "dp_replicate 3 does not divide the 8 data-parallel"),
        (ParallelDims(8, dp_replicate=2, dp_shard=2), {}, "dp_replicate 2 x dp_shard 2 != 8"),
        (ParallelDims(4, pp=2, microbatches=1), {}, "microbatches 1 is below pp 2"),
        (ParallelDims(4, pp=2, pp_schedule="zb"), {}, "unknown pipeline schedule 'zb'"),
        (ParallelDims(8, tp=8), {"seq_len": 64},
         "tp 8 does not divide the n_kv_heads 4 of model 'debug'; valid tensor-parallel sizes "
         "for this model: [1, 2, 4]"),
        (ParallelDims(2, tp=2), {"seq_len": 63, "sequence_parallel": True},
         "seq_len 63 is not divisible by tp 2"),
        (ParallelDims(2), {"seq_len": 4096}, "seq_len 4096 exceeds max_seq_len 512 of model 'debug'"),
        (ParallelDims(4, pp=4, pp_schedule="interleaved_1f1b"), {},
         "pp 4 x 2 stages per rank = 8 stages but model 'debug' has 4 layers"),
        (ParallelDims(4, pp=2, microbatches=4), {"batch": 6},
         "batch 6 is not divisible by microbatches 4; valid microbatches: 2, 3, 6"),
    ],
)  # fmt: skip
def test_one_line_per_bad_layout(dims, kwargs, message):
    args = get_config("debug")  # 4 layers, 8 heads, 4 KV heads, max_seq_len 512
    with pytest.raises(ValueError) as info:
        dims.validate(args, model_name="debug", **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_names_are_the_callers_flags():
    with pytest.raises(ValueError, match="--tp 3 does not divide --nproc 4"):
        ParallelDims(4, tp=3).validate(names={"tp": "--tp", "world_size": "--nproc"})


def test_the_same_bad_tp_gets_the_same_words_from_train_bench_and_plan():
    """tp 3 on 6 ranks: the debug model's 8 heads do not split, whichever command asks."""
    from simplefsdp.bench.cli import _build_parser, build_spec
    from simplefsdp.plan.layout import Layout, validate
    from simplefsdp.train.cli import preflight
    from simplefsdp.train.config import load_config

    words = "3 does not divide the n_heads 8, n_kv_heads 4 of model 'debug'; valid tensor-parallel"
    job = load_config(None, ["--parallel.tp", "3", "--data.seq_len", "96"])
    with pytest.raises(ValueError) as train:
        preflight(job, world_size=6, local_world_size=6)
    with pytest.raises(ValueError) as bench:
        build_spec(_build_parser().parse_args(["--nproc", "6", "--tp", "3", "--seq-len", "96"]))
    with pytest.raises(ValueError) as plan:
        validate(get_config("debug"), Layout(gpus=6, batch=2, seq=96, tp=3))
    assert str(train.value) == f"parallel.tp {words} sizes for this model: [1, 2, 4]"
    assert str(bench.value) == f"--tp {words} sizes for this model: [1, 2, 4]"
    plan_words = words.replace("model 'debug'", "the model")
    assert str(plan.value) == f"--tp {plan_words} sizes for this model: [1, 2, 4]"


def test_tp_split_sizes_with_loss_parallel():
    args = get_config("debug")
    assert set(tp_split_sizes(args)) == {"n_heads", "n_kv_heads", "feed-forward hidden dim"}
    assert tp_split_sizes(args, loss_parallel=True)["vocab_size"] == args.vocab_size


def test_bench_raises_max_seq_len_to_the_workloads_sequence():
    """The bench's workers build the model with max_seq_len >= --seq-len: no error for it."""
    from simplefsdp.bench.cli import _build_parser, build_spec

    spec = build_spec(_build_parser().parse_args(["--nproc", "2", "--seq-len", "1024"]))
    assert spec.workload.seq_len == 1024
