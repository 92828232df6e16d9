"""PyTorch's own FSDP/DTensor test models under data_parallel, on 2-4 CPU ranks.

The models are the ones torch ships with its package
(``torch/testing/_internal/common_fsdp.py`` and
``torch/testing/_internal/distributed/_tensor/common_dtensor.py``). Each one is
trained for a few AdamW steps (with global gradient clipping), each rank on
its half of a global batch, for every mode and executor, and compared with the
same model trained in one process on the global batch: the rank-averaged loss
of every step and the final parameters (fp32, rtol 1e-5).

Executors: ``data_parallel`` alone ("uncompiled"), the eager executor
(``simplefsdp.eager(model, bucketing="per_block")``) and
``simplefsdp.compile(model, backend="aot_eager")`` with the auto plan (a fixed
default cost model) where there are all-gathers to plan, ``per_block`` for
``replicate``. Modes ``fully_shard`` and ``replicate`` on 2 ranks for every
model, ``hybrid_shard`` on 4 ranks (2 x 2) for ``NestedWrappedModule`` and
``Transformer``. Every configuration of a model group runs inside one
``run_distributed`` call; a failing configuration does not stop the others,
and the test lists every failure.

Two comparisons are adjusted, each for a reason the model has (see
``Case``): the key bias of ``nn.MultiheadAttention`` has an exactly zero
gradient, so its entries are left out of the parameter comparison; and a
parameter forward never reads gets a zero gradient from the eager executor
(flat buckets, as FSDP1), not ``None``, so its reference does the same.

Built on CPU with the models' own ``NO_FSDP``/``DEVICE_NEVER`` construction
(a ``DummyProcessGroup`` stands in for the group their constructors read the
rank from) and moved to CPU (``SkipModel``, ``NestedLinear`` move themselves to
torch's test device, CUDA where there is one; their ``wrap()`` calls return
the module unchanged outside torch's ``enable_wrap``). ``ModuleWithDelay`` and
``DummyDDP`` are wrappers (the first is tested as
``NestedWrappedModuleWithDelay``). Not covered, with the reason:

- The ``FSDPInitMode.RECURSIVE`` constructions of every model and
  ``AlwaysWrapNestedWrappedModule``'s: they wrap submodules in torch's FSDP1
  with a real process group (``MixtureOfExperts`` also creates one with
  ``dist.new_group``); data_parallel replaces FSDP, so the unwrapped model is
  the one to test. ``AlwaysWrapNestedWrappedModule`` without FSDP builds
  exactly ``NestedWrappedModule`` (tested).
- ``MLPStack.parallelize`` and ``Transformer.parallelize`` (tensor and expert
  parallelism), ``TensorParallelForExpert``/``ExpertParallel*``: parallel
  styles for a TP/EP mesh, not data parallelism.
- ``TransformerWithSharedParams(add_bn=True)``: its ``BatchNorm1d(bs)`` takes
  the batch dimension (``T x B``) as channels, so its size is fixed to the
  per-rank batch (2) and a single process cannot run the global batch; it is
  tested with ``add_bn=False`` (the constructor's option).
- Delays of ``ModuleWithDelay``/``NestedWrappedModuleWithDelay`` and
  ``MixtureOfExperts(delay_before_free_ms)``: ``torch.cuda._sleep`` (CUDA
  only; on CPU they are no-ops, and the modules are tested without delay).
- ``MixtureOfExperts``' per-rank experts: its own set-up gives each rank
  different expert weights (seed ``42 + rank``) that are never reduced
  (expert parallelism through a 1-rank FSDP group). data_parallel has one
  mesh per wrapped root and refuses to wrap a wrapped submodule again, so the
  experts are data-parallel parameters like the rest: distributed from rank
  0's values, gradients averaged. The model is tested that way, against a
  single process.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import time
import traceback
import types
import unittest
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import simplefsdp
from simplefsdp.compiler import CostModel
from simplefsdp.testing import run_distributed

LOCAL_BATCH = 2
STEPS = 3
RTOL, ATOL = 1e-5, 1e-5


@dataclass(frozen=True)
class Case:
    """One torch test model: how to build it, feed it and score it."""

    build: Callable[[], nn.Module]  # deterministic, on CPU
    batch: Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]  # global inputs
    loss: Callable[[object, tuple[torch.Tensor, ...]], torch.Tensor]  # (output, inputs)
    batch_dims: tuple[int, ...] | None = None  # per input; default 0
    # Parameter-name suffix -> entries (dim 0) left out of the final parameter
    # comparison: entries whose exact gradient is 0, so that what they get is
    # round-off, which AdamW normalises into steps of about lr either way.
    roundoff_entries: tuple[tuple[str, slice], ...] = ()
    unused: tuple[str, ...] = ()  # parameters forward never reads
    # Absolute tolerance of the final parameter comparison, where gradients
    # are so small that AdamW (eps 1e-8) turns their round-off into a
    # visible part of a step (default ATOL).
    param_atol: float | None = None


def _import_torch_testing(module: str):
    """Import one of torch's ``torch.testing._internal`` modules.

    They import ``expecttest`` (through ``common_utils``) for the base class of
    torch's ``TestCase``, which is not a dependency of ours: without it, a
    stand-in module with ``unittest.TestCase`` lets them import. We use their
    models only, never their test cases.
    """
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase
        sys.modules.setdefault("expecttest", stand_in)
    return importlib.import_module(f"torch.testing._internal.{module}")


# --- common_fsdp.py ---------------------------------------------------------


def _fsdp():
    return _import_torch_testing("common_fsdp")


def _group():
    # The constructors read rank() and size() only: for MixtureOfExperts'
    # per-rank expert seed and for get_input (not used here). Rank 0's group
    # on every rank builds one model everywhere, the one data_parallel would
    # distribute from rank 0 anyway.
    return _fsdp().DummyProcessGroup(0, 2)


def _nested(cls_name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        m = _fsdp()
        cls = getattr(m, cls_name)
        return cls.init(
            _group(), m.FSDPInitMode.NO_FSDP, m.DEVICEInitMode.DEVICE_NEVER, deterministic=True
        )

    return build


def _with_delay() -> nn.Module:
    m = _fsdp()
    return m.NestedWrappedModuleWithDelay.init(
        _group(), m.FSDPInitMode.NO_FSDP, m.DEVICEInitMode.DEVICE_NEVER, deterministic=True
    )


def _transformer_with_shared_params() -> nn.Module:
    m = _fsdp()
    # deterministic=True also puts it in eval mode (no dropout).
    return m.TransformerWithSharedParams.init(
        _group(),
        m.FSDPInitMode.NO_FSDP,
        m.DEVICEInitMode.DEVICE_NEVER,
        deterministic=True,
        add_bn=False,
    )


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return factory().to("cpu")

    return build


def _rand(*shape: int) -> Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]:
    def batch(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(n, *shape, generator=gen),)

    return batch


def _square_mean(output, _inputs) -> torch.Tensor:
    outputs = output if isinstance(output, tuple) else (output,)
    return sum(o.square().mean() for o in outputs)


def _tokens_batch(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    src = torch.randint(0, 23, (6, n), generator=gen)  # T x B
    tgt = torch.randint(0, 23, (4, n), generator=gen)
    return src, tgt


def _tokens_loss(output, inputs) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), inputs[1].reshape(-1))


# --- common_dtensor.py --------------------------------------------------------


def _dtensor():
    return _import_torch_testing("distributed._tensor.common_dtensor")


def _dtensor_transformer(**overrides) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        m = _dtensor()
        torch.manual_seed(0)
        return m.Transformer(m.ModelArgs(dropout_p=0.0, **overrides))

    return build


def _lm_batch(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 8, (n, 12), generator=gen),)


def _lm_loss(output, inputs) -> torch.Tensor:
    tokens = inputs[0]
    return F.cross_entropy(output[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


CASES: dict[str, Case] = {
    # common_fsdp.py
    "NestedWrappedModule": Case(_nested("NestedWrappedModule"), _rand(8), _square_mean),
    "NonUniformReqGradNWM": Case(_nested("NonUniformReqGradNWM"), _rand(8), _square_mean),
    "NestedWrappedModuleWithDelay": Case(_with_delay, _rand(8), _square_mean),
    "MixtureOfExperts": Case(_nested("MixtureOfExperts"), _rand(8), _square_mean),
    "TransformerWithSharedParams": Case(
        _transformer_with_shared_params,
        _tokens_batch,
        _tokens_loss,
        batch_dims=(1, 1),
        # nn.MultiheadAttention's key bias (in_proj_bias[d:2d]) shifts every
        # score of a query by one constant, which softmax cancels: its
        # gradient is round-off (about 1e-8 here, against 0.03 to 1 for the
        # query and value biases).
        roundoff_entries=(("in_proj_bias", slice(16, 32)),),
    ),
    "MLP(with_buffer)": Case(
        _seeded(lambda: _fsdp().MLP(8, with_buffer=True)), _rand(8), _square_mean
    ),
    "MLPStack": Case(
        _seeded(lambda: _fsdp().MLPStack(8, with_seq_parallel=True)),
        _rand(3, 8),
        _square_mean,
        # Behind the final LayerNorm the first MLP's gradients are at most
        # about 1e-5 and some entries about 5e-8, near AdamW's eps, where the
        # round-off of LayerNorm backward's cancellations (compiled graph
        # against eager, both fp32) moved one entry of 0.in_proj.weight by
        # 1.9e-5 in 3 steps of lr 1e-2 on an AVX-512 CPU: 1e-4 is 1% of a step.
        param_atol=1e-4,
    ),
    "DoubleLinear": Case(_seeded(lambda: _fsdp().DoubleLinear(8)), _rand(8), _square_mean),
    "DoubleLinear(unused lin2)": Case(
        _seeded(lambda: _fsdp().DoubleLinear(8, use_second_linear=False)),
        _rand(8),
        _square_mean,
        unused=("lin2.weight", "lin2.bias"),
    ),
    "SkipModel": Case(
        _seeded(lambda: _fsdp().SkipModel(double_nest=True)), _rand(10), _square_mean
    ),
    # common_dtensor.py
    "MLPModule": Case(_seeded(lambda: _dtensor().MLPModule("cpu")), _rand(10), _square_mean),
    "MLPStacked": Case(
        _seeded(lambda: _dtensor().MLPStacked("cpu", n_layers=3)), _rand(10), _square_mean
    ),
    "RMSNormPython": Case(_seeded(lambda: _dtensor().RMSNormPython(8)), _rand(8), _square_mean),
    "Transformer": Case(_dtensor_transformer(), _lm_batch, _lm_loss),
    "Transformer(checkpoint_activations)": Case(
        _dtensor_transformer(checkpoint_activations=True), _lm_batch, _lm_loss
    ),
    "Transformer(experts, untied)": Case(
        _dtensor_transformer(num_experts=2, weight_tying=False), _lm_batch, _lm_loss
    ),
}

EXECUTORS = ("uncompiled", "eager", "compile")


# --- one training run -------------------------------------------------------


def _global_batch(case: Case, step: int, world: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + step)
    return case.batch(gen, LOCAL_BATCH * world)


def _local(case: Case, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    rank = dist.get_rank()
    dims = case.batch_dims or (0,) * len(inputs)
    return tuple(
        t.narrow(d, rank * LOCAL_BATCH, LOCAL_BATCH).contiguous()
        for t, d in zip(inputs, dims, strict=True)
    )


def _train(
    case: Case, model: nn.Module, world: int, local: bool, zero_grads: tuple[str, ...] = ()
) -> list[torch.Tensor]:
    """STEPS AdamW steps; the (rank-averaged) loss of each. ``zero_grads``:
    parameters given a zero gradient where backward left none."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    params = dict(model.named_parameters())
    losses = []
    for step in range(STEPS):
        inputs = _global_batch(case, step, world)
        if local:
            inputs = _local(case, inputs)
        loss = case.loss(model(*inputs), inputs)
        loss.backward()
        for fqn in zero_grads:
            if params[fqn].grad is None:
                params[fqn].grad = torch.zeros_like(params[fqn])
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if local:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss)
    return losses


def _mesh(mode: str):
    world = dist.get_world_size()
    if mode == "hybrid_shard":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _wrap(model: nn.Module, mode: str, executor: str) -> nn.Module:
    model = simplefsdp.data_parallel(model, _mesh(mode), mode=mode)
    if executor == "eager":
        simplefsdp.eager(model, bucketing="per_block")
    elif executor in ("compile", "compile_breaks"):  # the latter: fullgraph=False
        torch._dynamo.reset()  # a fresh model of a class seen before: no recompile limit
        bucketing = "per_block" if mode == "replicate" else "auto"
        simplefsdp.compile(
            model,
            backend="aot_eager",
            bucketing=bucketing,
            cost_model=CostModel(),
            fullgraph=executor == "compile",
        )
    return model


def _check(case: Case, initial: nn.Module, reference, mode: str, executor: str) -> None:
    ref_losses, ref_params = reference
    model = _wrap(copy.deepcopy(initial), mode, executor)
    losses = _train(case, model, dist.get_world_size(), local=True)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL)
    named = dict(model.named_parameters())
    assert list(named) == list(ref_params), (list(named), list(ref_params))
    for fqn, param in named.items():
        assert isinstance(param, DTensor), fqn
        full, expected = param.full_tensor(), ref_params[fqn]
        for suffix, entries in case.roundoff_entries:
            if fqn.endswith(suffix):
                full, expected = full.clone(), expected.clone()
                full[entries] = expected[entries] = 0.0
        atol = ATOL if case.param_atol is None else case.param_atol
        torch.testing.assert_close(
            full, expected, rtol=RTOL, atol=atol, msg=lambda m, fqn=fqn: f"{fqn}: {m}"
        )


def _parity_body(configs: list[tuple[str, str, str]]) -> list[str]:
    """Check each (model, mode, executor); returns one line per failure."""
    world = dist.get_world_size()
    initial: dict[str, nn.Module] = {}
    references: dict[tuple[str, bool], tuple] = {}
    failures = []
    for name, mode, executor in configs:
        case = CASES[name]
        if name not in initial:
            initial[name] = case.build()
        # The eager executor's flat buckets give parameters that no rank used
        # a zero gradient, as FSDP1's flat parameters do (uncompiled and
        # compiled data_parallel leave them None, like a single process), so
        # AdamW's weight decay still moves them: its reference does the same.
        zero_unused = executor == "eager" and bool(case.unused)
        if (name, zero_unused) not in references:
            ref = copy.deepcopy(initial[name])
            zero_grads = case.unused if zero_unused else ()
            losses = _train(case, ref, world, local=False, zero_grads=zero_grads)
            references[name, zero_unused] = (
                losses,
                {n: p.detach() for n, p in ref.named_parameters()},
            )
        start = time.perf_counter()
        try:
            _check(case, initial[name], references[name, zero_unused], mode, executor)
        except Exception as exc:  # noqa: BLE001 - collected, reported by the test
            message = "".join(traceback.format_exception_only(exc)).strip()
            failures.append(f"{name}/{mode}/{executor}: {message[:2000]}")
        dist.barrier()
        # SIMPLEFSDP_TEST_TIMING=1 (with pytest -s): seconds per configuration.
        if dist.get_rank() == 0 and os.environ.get("SIMPLEFSDP_TEST_TIMING"):
            print(f"{name}/{mode}/{executor}: {time.perf_counter() - start:.2f}s", flush=True)
    return failures


def _run(configs: list[tuple[str, str, str]], world: int = 2) -> None:
    failures = run_distributed(_parity_body, world, args=(configs,), timeout_s=600)
    errors = sorted(set().union(*failures))
    assert not errors, f"{len(errors)} of {len(configs)} configurations failed:\n" + "\n".join(
        errors
    )


SMALL_MODELS = [
    # common_fsdp.py
    "NestedWrappedModule",
    "NonUniformReqGradNWM",
    "NestedWrappedModuleWithDelay",
    "MixtureOfExperts",
    "MLP(with_buffer)",
    "MLPStack",
    "DoubleLinear",
    "DoubleLinear(unused lin2)",
    "SkipModel",
    # common_dtensor.py
    "MLPModule",
    "MLPStacked",
    "RMSNormPython",
]
TRANSFORMERS = [
    "TransformerWithSharedParams",  # common_fsdp.py
    "Transformer",  # common_dtensor.py, tied embedding
    "Transformer(checkpoint_activations)",
    "Transformer(experts, untied)",
]
MODES = ("fully_shard", "replicate")


def _configs(names: list[str], executors: tuple[str, ...]) -> list[tuple[str, str, str]]:
    return [(name, mode, ex) for name in names for mode in MODES for ex in executors]


def test_small_models_uncompiled_and_eager() -> None:
    _run(_configs(SMALL_MODELS, ("uncompiled", "eager")))


def test_transformers_uncompiled_and_eager() -> None:
    _run(_configs(TRANSFORMERS, ("uncompiled", "eager")))


@pytest.mark.slow
def test_small_models_compiled() -> None:
    _run(_configs(SMALL_MODELS, ("compile",)))


@pytest.mark.slow
def test_transformers_compiled() -> None:
    _run(_configs(TRANSFORMERS, ("compile",)))


@pytest.mark.slow
@pytest.mark.heavy  # half a minute on 2 CPU cores; run with -m heavy
def test_hybrid_shard_4_ranks() -> None:
    configs = [
        (name, "hybrid_shard", executor)
        for name in ("NestedWrappedModule", "Transformer")
        for executor in EXECUTORS
    ]
    _run(configs, world=4)
