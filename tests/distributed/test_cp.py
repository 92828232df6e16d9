"""Context parallelism at parity with one process on the whole sequence.

Each case trains a tiny Llama 3 through the engines' recipe (``Layout(cp=...)``,
``parallelize_model``) for a few SGD steps and compares, against the same model
in one process fed the whole batch: the first step's loss, every gradient of
the first step, and the parameters after the last step (float64, so the
tolerance is far below any real error). Causal and document-masked batches,
each backend, eager; one compiled case; one cp 4 case (heavy).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from simplefsdp.testing import run_distributed

STEPS, BATCH, SEQ, LR, EOS = 3, 2, 16, 0.5, 0
MOE = ("moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
TOL = 2e-6  # relative; gradients are reduced in float32


def _model(family: str = "llama3") -> tuple[object, torch.nn.Module]:
    from simplefsdp.models.registry import resolve_flavor

    sizes = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64}
    if family == "moe":
        sizes.update(
            dense_hidden_dim=64, num_experts=4, top_k=2, moe_hidden_dim=16, load_balance="none"
        )
    if family not in ("llama3", "moe"):  # the published families' debug flavors, smaller
        sizes = {"n_layers": 2, "vocab_size": 64}
        if family in MOE:  # an auxiliary loss is a statistic of each rank's tokens
            sizes["load_balance"] = "none"
    spec, config = resolve_flavor(f"{family}_debug", max_seq_len=64, **sizes)
    torch.manual_seed(0)
    # float64 but for MoE (grouped matmuls run in float32 at most)
    model = spec.build(config).to(torch.float32 if family in MOE else torch.float64)
    with torch.no_grad():  # decisive routing: rounding must not flip a token's experts
        for name, param in model.named_parameters():
            if name.endswith("router.gate.weight"):
                param.mul_(100)
    return spec, model


def _tokens(seq: int, rows: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 64, (rows, seq + 1), generator=g)
    tokens[0, [3, 9]] = EOS  # documents of 4, 6 and 7 tokens in row 0
    tokens[1:, seq // 2] = EOS
    return tokens


def _reference(documents: bool, seq: int, family: str = "llama3", rows: int = BATCH) -> dict:
    from simplefsdp.context_parallel import SequenceOptions

    spec, model = _model(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tokens = _tokens(seq, rows)
    options = SequenceOptions(eos_id=EOS if documents else None)
    out: dict = {}
    for step in range(STEPS):
        inputs, targets, context = options.prepare(tokens[:, :-1], tokens[:, 1:])
        logits = model(inputs, context=context) if options.active else model(inputs)
        loss = spec.loss(logits, targets)
        loss.backward()
        if step == 0:
            out["loss"] = loss.item()
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _cp_run(
    cases: list[tuple[str, bool, bool]],
    cp: int,
    seq: int,
    family: str = "llama3",
    dp: int = 1,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    compile_backend: str = "aot_eager",
) -> list[dict]:
    """Each ``(backend, documents, compile)`` case on ``dp x cp x tp`` ranks
    (``ep`` borrowed from ``dp x cp``): its differences. Data-parallel rank
    ``i`` trains rows ``i * BATCH ..`` of the reference's ``dp * BATCH``."""
    import torch.distributed as dist

    from simplefsdp.engines import EngineSpec, PipelineSpec
    from simplefsdp.engines.recipe import RecipeOptions, parallelize_model
    from simplefsdp.layout import Layout

    meshes = Layout(dp_shard=dp, cp=cp, tp=tp, ep=ep, pp=pp).build("cpu")
    results = []
    refs: dict = {}
    for backend, documents, compiled in cases:
        spec, model = _model(family)
        engine = EngineSpec(
            engine="simplefsdp",
            mode="fully_shard",
            compile=compiled,
            backend=compile_backend,
            tp=tp,
            ep=ep,
        )
        pipeline = PipelineSpec(pp, "1f1b", microbatches=2) if pp > 1 else None
        options = RecipeOptions(pipeline, cp_backend=backend, eos_id=EOS if documents else None)
        parallel = parallelize_model(model, spec, meshes, engine, torch.device("cpu"), options)
        opt = torch.optim.SGD(parallel.module.parameters(), lr=LR)
        rows = slice(meshes.batch_rank * BATCH, (meshes.batch_rank + 1) * BATCH)
        tokens = _tokens(seq, dp * BATCH)[rows]
        if documents not in refs:
            refs[documents] = _reference(documents, seq, family, dp * BATCH)
        ref = refs[documents]
        diff = {"loss": 0.0, "grads": 0.0, "params": 0.0}
        for step in range(STEPS):
            with parallel.compile_context():
                loss = parallel.step(tokens[:, :-1], tokens[:, 1:])
            if step == 0:  # the mean over the ranks that hold a loss
                total = torch.tensor([0.0, 0.0] if loss is None else [loss.item(), 1.0])
                dist.all_reduce(total)
                diff["loss"] = abs(total[0].item() / total[1].item() - ref["loss"]) / ref["loss"]
                for name, p in parallel.module.named_parameters():
                    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    err = (grad - ref["grads"][name]).abs().max() / ref["grads"][name].abs().max()
                    diff["grads"] = max(diff["grads"], err.item())
            opt.step()
            opt.zero_grad()
        for name, value in parallel.module.state_dict().items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            if name in ref["params"]:
                err = (value - ref["params"][name]).abs().max() / ref["params"][name].abs().max()
                diff["params"] = max(diff["params"], err.item())
        results.append(diff)
    return results


EAGER = [
    ("allgather", False, False),
    ("ring", False, False),
    ("ulysses", False, False),
    ("allgather", True, False),
    ("ring", True, False),
    ("ulysses", True, False),
]


def _check(cases, results, tol: float = TOL) -> None:
    for case, diff in zip(cases, results, strict=True):
        worst = max(diff["loss"], diff["grads"], diff["params"])
        assert worst < tol, (case, diff)


def test_cp2_backends_at_parity() -> None:
    """cp 2, every backend, causal and document-masked, against one process."""
    results = run_distributed(_cp_run, 2, args=(EAGER, 2, SEQ))
    _check(EAGER, results[0])
    _check(EAGER, results[1])


@pytest.mark.heavy
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_cp2_compiled_at_parity(compile_backend: str) -> None:
    """Compiled by simplefsdp.compile: its passes bucket and reorder the
    parameters' collectives and leave the context-parallel ones in place."""
    cases = [("allgather", True, True), ("ring", False, True), ("ulysses", True, True)]
    if compile_backend == "inductor":
        cases = cases[:1]
    results = run_distributed(
        _cp_run, 2, args=(cases, 2, SEQ), kwargs={"compile_backend": compile_backend}
    )
    _check(cases, results[0])


@pytest.mark.heavy
def test_cp4_at_parity() -> None:
    cases = [("allgather", True, False), ("ring", False, False), ("ulysses", True, False)]
    _check(cases, run_distributed(_cp_run, 4, args=(cases, 4, 32))[0])


COMPOSED = [("allgather", True, False), ("ring", False, False), ("ulysses", True, False)]


@pytest.mark.heavy
@pytest.mark.parametrize(
    "family, degrees",
    [
        ("llama3", {"dp": 2}),
        ("llama3", {"tp": 2}),
        ("moe", {"dp": 2, "ep": 2}),
        ("llama3", {"pp": 2}),
    ],
    ids=["dp2xcp2", "tp2xcp2", "moe-ep2xcp2", "pp2xcp2"],
)
def test_cp2_composes_at_parity(family: str, degrees: dict) -> None:
    """cp 2 with data, tensor, expert or pipeline parallelism on 4 ranks."""
    cases = COMPOSED
    if degrees.get("pp", 1) > 1:
        cases = [(backend, False, False) for backend, _, _ in COMPOSED]  # causal only
    results = run_distributed(
        _cp_run, 4, args=(cases, 2, SEQ), kwargs={"family": family, **degrees}
    )
    for rank in results:
        _check(cases, rank, 1e-4 if family in MOE else TOL)


# Each published family's attention (QK-norm; sinks and sliding windows;
# multi-head latent attention) under one backend with documents, the MoE
# families in float32 as above.
FAMILIES = {
    "qwen3": ("ulysses", True, False),
    "qwen3_moe": ("allgather", False, False),
    "gpt_oss": ("ring", True, False),
    "deepseek_v3": ("allgather", True, False),
}


def _families_run(families: dict) -> dict:
    return {family: _cp_run([case], 2, SEQ, family)[0] for family, case in families.items()}


def test_cp2_published_families_at_parity() -> None:
    results = run_distributed(_families_run, 2, args=(FAMILIES,))
    for rank in results:
        for family, diff in rank.items():
            _check([FAMILIES[family]], [diff], 1e-4 if family in MOE else TOL)


def _attend_run(windows: list[int | None]) -> list[dict]:
    """``attend`` with sinks, a sliding window, grouped keys, ``d_v != d_qk`` and
    documents on 2 ranks, per backend and load balance: forward and gradient
    differences (queries, keys, values, sinks) against one process's whole
    sequence. At 32 tokens a window of 5 or 3 runs in chunks under every
    backend but ``ring`` (head-tail runs of 8 positions, chunks of the
    window; the documents' balance deals runs of 2, shorter than the
    window)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp.context_parallel import SequenceOptions
    from simplefsdp.context_parallel.attention import BACKENDS
    from simplefsdp.models.common.attention import attend

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(5)
    b, h, h_kv, t, d, d_v = 2, 4, 2, 32, 8, 6
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h_kv, t, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h_kv, t, d_v, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    grad_out = torch.randn(b, h, t, d_v, generator=g, dtype=torch.float64)
    tokens = torch.randint(1, 9, (b, t), generator=g)
    tokens[0, [4, 11, 23]] = EOS
    tokens[1, [6, 20]] = EOS

    def run(options: SequenceOptions, window) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        _, _, context = options.prepare(tokens)
        local = context.index[context.rank]
        lq, lk, lv = (x[:, :, local] for x in leaves[:3])
        out = attend(lq, lk, lv, sliding_window=window, sinks=leaves[3], context=context)
        out.backward(grad_out[:, :, local])
        grads = [x.grad for x in leaves]
        for grad in grads:  # each rank holds its queries' part of every gradient
            dist.all_reduce(grad)
        return out, grads

    results = []
    for window in windows:
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        full = SequenceOptions(eos_id=EOS).prepare(tokens)[2]  # one process, whole sequence
        ref = attend(*leaves[:3], sliding_window=window, sinks=leaves[3], context=full)
        ref.backward(grad_out)
        for backend, balance in itertools.product(BACKENDS, ("documents", "head_tail")):
            options = SequenceOptions(
                cp=2, rank=mesh.get_local_rank(), group=mesh.get_group().group_name,
                backend=backend, eos_id=EOS, load_balance=balance,
            )  # fmt: skip
            out, grads = run(options, window)
            local = options.prepare(tokens)[2].index[options.rank]
            results.append(
                {
                    "case": (window, backend, balance),
                    "out": (out - ref.detach()[:, :, local]).abs().max().item(),
                    "grads": max((a - x.grad).abs().max().item() for a, x in zip(grads, leaves)),
                }
            )
    return results


def test_attend_with_sinks_and_windows_across_ranks() -> None:
    """What families with sinks and sliding windows (and grouped keys, and
    values of another head size) get from ``attend`` under cp 2."""
    for rank in run_distributed(_attend_run, 2, args=([None, 5, 3],)):
        assert len(rank) == 18
        for diff in rank:
            assert max(diff["out"], diff["grads"]) < 1e-12, diff
