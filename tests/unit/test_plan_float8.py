"""``simplefsdp plan --float8``: float8 matmuls, float8 all-gathers, errors.

Traces are of the debug Llama on a fake process group (a second or two).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import plan_profiles
from simplefsdp.compiler.cost_model import CostModel
from simplefsdp.models.llama3 import Transformer, get_config
from simplefsdp.models.registry import get_spec
from simplefsdp.plan import cli as plan_cli
from simplefsdp.plan.hardware import PROFILES
from simplefsdp.plan.predict import Float8Matmuls, Layout, compute_time, predict
from simplefsdp.plan.reference import TORCHTITAN_H100_202412
from simplefsdp.plan.trace import float8_linear_weights

LLAMA = get_spec("llama3")

GiB = 2**30

FIXED = dataclasses.replace(plan_profiles.FIXED, peak_fp8_flops=2e12, fp8_matmul_efficiency=0.5)


def test_gpu_profiles_carry_the_datasheet_float8_peak() -> None:
    for name in ("h100", "h100-96gb-500w", "h200"):
        profile = PROFILES[name]
        assert profile.peak_fp8_flops == pytest.approx(1979e12), name
        assert 0 < profile.fp8_matmul_efficiency <= 1, name
    assert PROFILES["a100"].peak_fp8_flops == 0  # no float8 tensor cores


def test_converted_linears_are_torchtitans_filter() -> None:
    with torch.device("meta"):
        model = Transformer(get_config("debug"))
        model.extra = nn.Linear(24, 40)  # a dim not divisible by 16: skipped
    names = float8_linear_weights(model)
    assert names and all(n.startswith("layers.") for n in names)
    assert "output.weight" not in names and "extra.weight" not in names
    assert {n.rsplit(".", 2)[-2] for n in names} == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}


@pytest.mark.parametrize("flavor", ["llama3_debug", "moe_debug", "deepseek_v3_debug"])
def test_the_plans_float8_filter_is_the_trainers(flavor) -> None:
    # The weights the plan converts are those convert_linears_to_float8
    # converts with the family's filter (the router's gate is a linear that
    # stays bf16), on the same model.
    pytest.importorskip("torchao")
    import simplefsdp
    from simplefsdp.models.registry import resolve_flavor

    spec, config = resolve_flavor(flavor)
    with torch.device("meta"):
        model = spec.build(config)
    skip = ("output", *spec.float8_skip_fqns)
    planned = set(float8_linear_weights(model, skip))
    simplefsdp.convert_linears_to_float8(model, filter_fqns=",".join(skip))
    converted = {
        f"{name}.weight" for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"
    }
    assert planned and planned == converted


def _mm_graph(m: int, k: int, n: int):
    def f(x, w):
        return torch.mm(x, w)

    return make_fx(f, tracing_mode="fake")(
        torch.empty(m, k, dtype=torch.bfloat16), torch.empty(k, n, dtype=torch.bfloat16)
    )


def test_float8_matmul_rate_and_casts_by_hand() -> None:
    # x (tokens=256, 64) @ w (64, 128): 2 * 256 * 64 * 128 FLOPs at 1e12 FLOP/s
    # plus the cast of x only (the operand with the token dimension): 256 * 64
    # elements, 5 bytes each eager (amax pass, cast pass), 3 fused, at 1e11 B/s.
    gm = _mm_graph(256, 64, 128)
    cm = CostModel(flops_per_s=1e11, bytes_per_s=1e11, kernel_overhead_s=0.0)
    fp8 = Float8Matmuls(flops_per_s=1e12, tokens=256, skip_dim=1000)
    flops = 2 * 256 * 64 * 128
    for fused, per_element in ((False, 5), (True, 3)):
        seconds = compute_time(gm, cm, fused=fused, float8=fp8)["seconds"]
        assert seconds == pytest.approx(flops / 1e12 + per_element * 256 * 64 / 1e11)
    # The output layer (an operand of the vocabulary's size) stays at the bf16 rate.
    output = Float8Matmuls(flops_per_s=1e12, tokens=256, skip_dim=128)
    assert compute_time(gm, cm, fused=True, float8=output)["seconds"] == pytest.approx(
        compute_time(gm, cm, fused=True)["seconds"]
    )


def test_float8_gathers_half_the_bytes_and_multiplies_faster() -> None:
    args = get_config("debug")
    layout = Layout(gpus=2, batch=2, seq=64, bucketing="per_block")
    bf16 = predict(LLAMA, args, layout, FIXED)
    fp8 = predict(LLAMA, args, dataclasses.replace(layout, float8=True), FIXED)
    assert fp8.time["flops"] == pytest.approx(bf16.time["flops"])
    assert fp8.time["compute"] < bf16.time["compute"]
    # Gathers shrink (converted weights at 1 byte), reduce-scatters do not:
    # the total lies between bf16's and bf16's less half its gathers.
    assert fp8.time["dp_comm_total"] < bf16.time["dp_comm_total"]
    assert fp8.memory["gathered"] < bf16.memory["gathered"]
    assert fp8.memory["parameters"] == bf16.memory["parameters"]
    assert fp8.time["optimizer"] > bf16.time["optimizer"]  # the amax all-reduce
    assert any("float8" in note for note in fp8.notes)
    assert "float8" in fp8.layout.describe()


def test_float8_errors_are_one_line(capsys) -> None:
    small = ["--model", "debug", "--gpus", "2", "--batch", "2", "--seq", "64", "--float8"]
    cases = [
        (["--hardware", "a100"], "hardware 'a100' has no float8 peak"),
        (["--dtype", "fp32"], "--float8 trains with bf16 mixed precision"),
    ]
    for argv, message in cases:
        assert plan_cli.main(small + argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_reference_float8_rows_are_predicted_with_float8() -> None:
    rows = [r for r in TORCHTITAN_H100_202412 if "Float8" in r.note]
    assert len(rows) == 14 and all(r.float8 for r in rows)  # Tables 1-6
    assert not any(r.float8 for r in TORCHTITAN_H100_202412 if "Float8" not in r.note)


@pytest.mark.heavy  # minutes-long on 2 CPU cores; run with -m heavy
def test_loss_parallel_keeps_the_logits_sharded() -> None:
    # With the vocabulary split over TP 2 each rank's loss works on half the
    # logits: the activations and temporaries shrink by at least a quarter
    # of one fp32 copy of the full logits (the partitioner keeps some of
    # them in bf16 either way).
    args = get_config("debug", vocab_size=4096)
    layout = Layout(gpus=4, tp=2, batch=2, seq=64, bucketing="per_block")
    replicated = predict(LLAMA, args, layout, FIXED)
    sharded = predict(LLAMA, args, dataclasses.replace(layout, loss_parallel=True), FIXED)
    logits = 2 * 64 * 4096 * 4  # one fp32 copy of the full logits
    lost = (replicated.memory["activations"] + replicated.memory["temporary"]) - (
        sharded.memory["activations"] + sharded.memory["temporary"]
    )
    assert lost >= logits / 4
    assert "loss-parallel" in sharded.layout.describe()
