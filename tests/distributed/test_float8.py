"""torchao float8 training under data_parallel: float8 all-gathers of the
converted weights (Note: [Float8 all-gather]), parity with one process and
with the same model gathering in high precision."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp.testing import run_distributed

pytest.importorskip("torchao.float8")

WORLD = 2
LOCAL_BATCH = 4
STEPS = 3


def _build(float8_all_gather: bool) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.Linear(32, 5)
    )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    # torchtitan's filter: dims divisible by 16 (the last layer stays high precision)
    convert_to_float8_training(
        model,
        config=config,
        module_filter_fn=lambda m, _: m.in_features % 16 == 0 and m.out_features % 16 == 0,
    )
    return model


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(WORLD * LOCAL_BATCH, 32, generator=g) for _ in range(STEPS)]


def _train(model, micro_batches: int, rank: int = 0, after=None) -> list[float]:
    """Steps of AdamW; the global batch split into ``micro_batches`` pieces,
    this process running piece ``rank`` (all pieces, accumulated, in one
    process); ``after()`` runs after each optimizer step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _batches():
        pieces = batch.chunk(WORLD)
        ran = pieces if micro_batches == WORLD else [pieces[rank]]
        total = 0.0
        for piece in ran:
            loss = model(piece).pow(2).mean() / len(ran)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        if after is not None:
            after()
        losses.append(total)
    return losses


def _global(losses: list) -> list[float]:
    out = []
    for loss in losses:
        t = loss.clone()
        dist.all_reduce(t)
        out.append((t / WORLD).item())
    return out


def _wrap(model, backend: str | None, bucketing: str = "none"):
    model = simplefsdp.data_parallel(model, init_device_mesh("cpu", (WORLD,)), mode="fully_shard")
    if backend is not None:
        simplefsdp.compile(model, backend=backend, bucketing=bucketing)
    return model


def _parity_body(backend: str | None, bucketings: tuple[str, ...] = ("none",)) -> dict:
    rank = dist.get_rank()
    # One process, each rank's micro-batch in turn: the same input scales
    # (tensorwise float8 scales the activations per micro-batch).
    reference = _build(True)
    reference_losses = _train(reference, WORLD)
    # Uncompiled, the twin gathers in high precision; compiled, it is the
    # uncompiled float8 model (the eager test compares those two).
    high = _wrap(_build(backend is not None), None)
    high_losses = _global(_train(high, 1, rank))
    reports = {}
    for bucketing in bucketings:
        float8 = _wrap(_build(True), backend, bucketing)
        float8_losses = _global(_train(float8, 1, rank))
        params = {}
        for (name, p), (_, q), (_, r) in zip(
            reference.named_parameters(), float8.named_parameters(), high.named_parameters()
        ):
            params[name] = (p.detach(), q.full_tensor(), r.full_tensor())
        _check_parity(
            {
                "reference": [float(x) for x in reference_losses],
                "float8": float8_losses,
                "high": high_losses,
                "params": params,
            },
            exact=backend != "inductor",
        )
        if backend is not None:
            reports[bucketing] = simplefsdp.comm_report(float8).to_dict()
    return reports


def _check_parity(result: dict, exact: bool = True) -> None:
    # Same scale (the whole tensor's amax) and the same per-element casts:
    # gathering float8 bytes equals gathering fp32 and casting after, and
    # bucketing only moves bytes (one amax all-reduce: MAX is exact).
    # Inductor's kernels may round the fp32 gradient sums differently.
    if exact:
        assert result["float8"] == result["high"], result
        for name, (_, q, r) in result["params"].items():
            assert torch.equal(q, r), name
    else:
        for name, (_, q, r) in result["params"].items():
            torch.testing.assert_close(q, r, rtol=1e-5, atol=1e-6, msg=name)
    # Against one process: the gradients are summed in another order (the
    # reduce-scatter vs autograd accumulation) and AdamW divides by sqrt(v):
    # fp32 rounding only, no float8 difference.
    torch.testing.assert_close(
        torch.tensor(result["float8"]), torch.tensor(result["reference"]), rtol=1e-5, atol=1e-6
    )
    for name, (p, q, _) in result["params"].items():
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    diffs = [(q - p).abs().max().item() for p, q, _ in result["params"].values()]
    print(f"max |param - one process| = {max(diffs):.3g}", flush=True)


def test_float8_all_gather_eager_matches_one_process():
    run_distributed(_parity_body, world_size=WORLD, args=(None,))


def test_float8_all_gather_compiled_gathers_float8_bytes():
    reports = run_distributed(
        _parity_body, world_size=WORLD, args=("aot_eager", ("none", "per_block"))
    )[0]
    report = reports["none"]
    forward = next(g for g in report["graphs"] if g["graph"] == "forward")
    gathers = [c for c in forward["collectives"] if c["kind"] == "all_gather"]
    float8 = [c for c in gathers if c["dtype"] == "float8_e4m3fn"]
    # The two converted weights (64x32, 32x64): one byte per element.
    assert sorted(c["bytes"] for c in float8) == [2048, 2048], gathers
    # The unconverted last layer and the biases still gather in fp32.
    assert all(c["dtype"] == "float32" for c in gathers if c not in float8), gathers
    # Resharded after forward: backward gathers the first weight's float8
    # bytes again (the last bucket is kept gathered, keep_gathered="auto")
    # and reuses the forward's scale (no amax all-reduce in backward).
    backward = next(g for g in report["graphs"] if g["graph"] == "backward")
    regathers = [c for c in backward["collectives"] if c["kind"] == "all_gather"]
    assert [c["bytes"] for c in regathers if c["dtype"] == "float8_e4m3fn"] == [2048], regathers
    assert all(c["bytes"] < 2048 for c in regathers if c["dtype"] == "float32"), regathers
    assert not any(c["kind"] == "all_reduce" for c in backward["collectives"]), backward
    _check_bucketed(reports["per_block"])


def _check_bucketed(report: dict) -> None:
    """Bucketed (one bucket: the Sequential's parameters), the float8 and
    fp32 shards travel in one all-gather as bytes, and the two amaxes in one
    all-reduce (Note: [Mixed dtypes in one all-gather bucket], Note: [One
    amax all-reduce per graph])."""
    forward = next(g for g in report["graphs"] if g["graph"] == "forward")
    kinds = [c["kind"] for c in forward["collectives"]]
    assert kinds == ["all_reduce", "all_gather"], forward["collectives"]
    amax, gather = forward["collectives"]
    assert amax["bytes"] == 8 and sorted(amax["params"]) == ["0.weight", "2.weight"], amax
    assert gather["dtype_bytes"] == {"float8_e4m3fn": 4096, "float32": 1176}, gather
    assert gather["bytes"] == 4096 + 1176
    backward = next(g for g in report["graphs"] if g["graph"] == "backward")
    by_kind = {c["kind"]: c for c in backward["collectives"]}
    assert "all_reduce" not in by_kind  # the scale is saved from forward
    assert by_kind["all_gather"]["dtype_bytes"] == {"float32": 768, "float8_e4m3fn": 2048}
    # the float8 weights' gradients reduce-scatter with the others' (fp32)
    assert [c["kind"] for c in backward["collectives"]].count("reduce_scatter") == 1
    assert by_kind["reduce_scatter"]["dtype_bytes"] == {"float32": 4 * (2048 + 2048) + 1176}


@pytest.mark.heavy
def test_float8_inductor_bucketed_matches_one_process():
    reports = run_distributed(_parity_body, world_size=WORLD, args=("inductor", ("per_block",)))
    _check_bucketed(reports[0]["per_block"])


def _eager_refusal_body() -> str:
    model = _wrap(_build(True), None)
    try:
        simplefsdp.eager(model)
    except ValueError as e:
        return str(e)
    return "no error"


def test_eager_executor_refuses_float8_weights():
    message = run_distributed(_eager_refusal_body, world_size=WORLD)[0]
    assert "float8 all-gather weight" in message and "\n" not in message, message


def _fsdp2_body() -> None:
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    from simplefsdp.engines import ParallelModel

    def sharded():
        model = _build(True)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    fsdp2 = sharded()
    fsdp2_losses = _global(_train(fsdp2, 1, rank))
    # The fsdp2 engine precomputes all scales in one all-reduce after each
    # optimizer step (torchao's precompute_float8_dynamic_scale_for_fsdp):
    # the same scales, so the same training.
    precomputed = sharded()
    engine = ParallelModel(module=precomputed, forward=precomputed, engine="fsdp2", mesh=mesh)
    assert _global(_train(precomputed, 1, rank, engine.after_optimizer_step)) == fsdp2_losses
    assert precomputed[0].weight._local_tensor._precomputed_scale is not None
    ours = _wrap(_build(True), None)
    our_losses = _global(_train(ours, 1, rank))
    # FSDP2 runs torchao's own pre/post all-gather hooks: the same amax
    # all-reduce, scale and casts, hence bitwise the same training.
    assert our_losses == fsdp2_losses, (our_losses, fsdp2_losses)
    for (name, p), (_, q) in zip(fsdp2.named_parameters(), ours.named_parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name


def test_float8_all_gather_matches_fsdp2():
    run_distributed(_fsdp2_body, world_size=WORLD)


def _checkpoint_body(folder: str) -> None:
    import pathlib

    import simplefsdp.checkpoint as ckpt

    rank = dist.get_rank()
    float8 = _wrap(_build(True), None)
    _train(float8, 1, rank)
    opt = torch.optim.AdamW(float8.parameters(), lr=1e-2)
    float8(torch.randn(LOCAL_BATCH, 32)).sum().backward()
    opt.step()
    path = ckpt.save(float8, opt, pathlib.Path(folder) / "step-1")
    dist.barrier()
    # Plain tensors only: no torchao class pickled into the files (a process
    # without torchao, or a high-precision model, can read them).
    for file in pathlib.Path(path).rglob("*"):
        if file.is_file():
            assert b"WeightWithDynamicFloat8CastTensor" not in file.read_bytes(), file
    for target in (_wrap(_build(False), None), _wrap(_build(True), None)):
        ckpt.load(target, torch.optim.AdamW(target.parameters(), lr=1e-2), path, rng=False)
        for (name, p), (_, q) in zip(float8.named_parameters(), target.named_parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor()), name


def test_float8_checkpoint_loads_into_high_precision_and_float8_models(tmp_path):
    run_distributed(_checkpoint_body, world_size=WORLD, args=(str(tmp_path),))


# --------------------------------------------------------------------------- tensor parallel

TP_STEPS, TP_LR = 4, 0.5


def _llama(float8: bool) -> torch.nn.Module:
    from simplefsdp import convert_linears_to_float8
    from simplefsdp.models.llama3 import Transformer, get_config

    torch.manual_seed(0)
    model = Transformer(get_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    return convert_linears_to_float8(model, "tensorwise") if float8 else model


def _tp_body(backend: str | None) -> dict:
    from torch.distributed.tensor import DTensor

    from simplefsdp.engines import EngineSpec, build_mesh
    from simplefsdp.models.llama3.parallelize import cross_entropy, parallelize_llama

    reference = _llama(True)
    spec = EngineSpec(tp=WORLD, compile=backend is not None, backend=backend or "aot_eager")
    mesh = build_mesh("simplefsdp", "fully_shard", "cpu", WORLD, tp=WORLD)
    # Sequence parallelism would all-gather float8 activations, which gloo
    # cannot (no float8 type): the replicated-activation plan on CPU.
    tp = parallelize_llama(_llama(True), spec, mesh, torch.device("cpu"), sequence_parallel=False)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=TP_LR)
    tp_opt = torch.optim.SGD(tp.module.parameters(), lr=TP_LR)
    ref_losses, tp_losses = [], []
    for _ in range(TP_STEPS):
        loss = cross_entropy(reference(inputs), targets)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
        tp_losses.append(tp.step(inputs, targets).item())
        tp_opt.step()
        tp_opt.zero_grad()
    diffs = {}
    for (name, p), (_, q) in zip(reference.named_parameters(), tp.module.named_parameters()):
        q = q.full_tensor() if isinstance(q, DTensor) else q
        diffs[name] = ((q - p).abs().max() / p.abs().max()).item()
    return {"ref": ref_losses, "tp": tp_losses, "diffs": diffs}


def _check_tp(result: dict) -> None:
    # Every float8 scale under TP is the whole tensor's amax (the DTensor amax
    # all-reduces over the TP ranks) and each element's cast is the same, so
    # the float8 operands equal one process's; what differs is the fp32 sum
    # of the row-wise layers' partial outputs (an all-reduce) and of the
    # gradients: rounding at 1e-7, far below one float8 step (2**-3 relative).
    torch.testing.assert_close(
        torch.tensor(result["tp"]), torch.tensor(result["ref"]), rtol=1e-5, atol=0
    )
    assert max(result["diffs"].values()) < 1e-5, result["diffs"]
    assert result["ref"][-1] < result["ref"][0] - 0.5, result["ref"]  # it trained


def test_float8_tensor_parallel_matches_one_process():
    _check_tp(run_distributed(_tp_body, world_size=WORLD, args=(None,))[0])


@pytest.mark.heavy
def test_float8_tensor_parallel_compiled_matches_one_process():
    _check_tp(run_distributed(_tp_body, world_size=WORLD, args=("aot_eager",))[0])


# --------------------------------------------------------------------------- export


def _float8_checkpoint_body(folder: str) -> dict:
    from dataclasses import asdict

    from simplefsdp.checkpoint import Checkpointer
    from simplefsdp.models.llama3 import Transformer, get_config
    from simplefsdp.train.config import load_config
    from simplefsdp.train.parallelism import parallelize_job

    job = load_config(None, ["--float8.enable", "true", "--compile.enable", "false"])
    args = get_config("debug", n_layers=1)
    with torch.device("meta"):
        model = Transformer(args)
    parallel = parallelize_job(model, job, torch.device("cpu"))
    stored = dict(parallel.module.named_parameters())
    assert is_float8(stored["layers.0.attention.wq.weight"])  # the run trains in float8
    optimizer = torch.optim.AdamW(parallel.module.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    parallel.step(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    ck = Checkpointer(folder, model=parallel.module, optimizer=optimizer,
                      device=torch.device("cpu"), keep_last=1, config_hash="h",
                      config_json={"model_args": asdict(args)})  # fmt: skip
    ck.save(1, {"scheduler": {}, "data_loader": {}})
    return {k: v.full_tensor().numpy() for k, v in parallel.module.state_dict().items()}


def is_float8(param) -> bool:
    from simplefsdp.frontend.float8 import is_float8_weight

    return is_float8_weight(param)


def test_export_of_a_float8_run_is_plain_weights(tmp_path):
    """``simplefsdp export`` of a float8 run: plain tensors named as the
    unconverted model's, loadable into it, equal to the trained weights."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from simplefsdp.checkpoint.export import export_checkpoint, model_args_from_config
    from simplefsdp.models.llama3 import Transformer

    trained = run_distributed(_float8_checkpoint_body, world_size=WORLD, args=(str(tmp_path),))[0]
    weights_path, config_path = export_checkpoint(tmp_path, tmp_path / "out" / "model.safetensors")
    weights = load_file(str(weights_path))
    import json

    plain = Transformer(model_args_from_config(json.loads(config_path.read_text())))
    assert weights.keys() == plain.state_dict().keys()
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in weights.values())
    plain.load_state_dict(weights, strict=True)
    for name, tensor in weights.items():
        assert torch.equal(tensor, torch.from_numpy(trained[name])), name
